"""The paged-KV-cache picture (``docs/pictures/kv-cache-blocks.svg``), drawn from a real run.

A scripted two-step workload runs through the real ``Scheduler`` (and so the real
``KVCacheManager`` and ``BlockPool``) and the real ``ModelRunner._update_states`` /
``_prepare_inputs`` (the worker's block tables and ``slot_mapping``), with no model, no
worker process and no server: the sampled tokens are made up, everything else is what those
classes hold after the second step. So the picture cannot show a block table, a ref count,
a hash or a slot the code would not produce::

    .venv/bin/python -m engine.distributed.pictures     # writes every picture in docs/pictures/

The workload (block size 8, 12 blocks; block 0 is the null block):

- step 1: request A (a 20-token prompt) and request C (9 tokens, ``max_tokens=1``) prefill.
  C samples its one token and finishes: its blocks go back to the free queue, and its full
  block keeps its hash (free, yet still a prefix-cache hit until the pool hands it out);
- step 2: request B arrives with A's first 16 tokens and 7 of its own. Its first two blocks
  are a prefix-cache hit on A's (ref count 2); A decodes one token, B prefills 7.

A test regenerates the picture and compares byte for byte (``tests/unit/kv_cache/test_kv_cache_picture.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from engine.utils.svg import MARGIN, MUTED, TEXT, Canvas, write_svgs

BLOCK_SIZE = 8  # the smallest --block-size but 1: eight slots a block fit on a page
NUM_BLOCKS = 12  # null block included
SHARED_PREFIX = list(range(100, 116))  # 16 tokens: two full blocks
PROMPTS = {
    "A": SHARED_PREFIX + [201, 202, 203, 204],
    "C": list(range(300, 309)),
    "B": SHARED_PREFIX + [401, 402, 403, 404, 405, 406, 407],
}
MAX_TOKENS = {"A": 8, "C": 1, "B": 8}
ARRIVALS = (("A", "C"), ("B",))  # the requests added before step 1, before step 2
SAMPLED_TOKEN = 7  # what the made-up sampler returns
FILE_NAME = "kv-cache-blocks.svg"
COMMAND = "python -m engine.distributed.pictures"


@dataclass
class BlockState:
    block_id: int
    ref_cnt: int
    hash_hex: str | None  # the first 8 hex digits of the block hash, None when not cached
    is_null: bool
    holders: list[str]  # the requests whose block table holds it


@dataclass
class StepInputs:
    num_scheduled_tokens: dict[str, int]
    prefix_hits: dict[str, int]  # new requests: the tokens the prefix cache gave them
    req_ids: list[str]  # the worker's batch order (decodes first)
    positions: list[int]
    slot_mapping: list[int]
    block_tables: dict[str, list[int]]  # the worker's mirror, after _update_states
    finished: list[str] = field(default_factory=list)  # the requests this step finished


@dataclass
class KVSnapshot:
    """What the classes hold after the workload's last step."""

    block_size: int
    blocks: list[BlockState]
    block_tables: dict[str, list[int]]  # KVCacheManager.req_to_blocks, as ids
    num_computed_tokens: dict[str, int]
    num_cached_blocks: dict[str, int]  # KVCacheManager.num_cached_block: leading blocks hashed
    free_queue: list[int]  # head (handed out and evicted first) to tail
    finished: list[str]
    steps: list[StepInputs] = field(default_factory=list)
    written: dict[int, int] = field(default_factory=dict)  # slot -> the step that last wrote it


def run_workload() -> KVSnapshot:
    """Run ``ARRIVALS`` through the scheduler and the model runner's input preparation."""
    import torch

    from engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
    from engine.kv_cache.kv_cache_interface import FullAttentionSpec, KVCacheConfig
    from engine.kv_cache.kv_cache_utils import get_request_block_hasher
    from engine.outputs import ModelRunnerOutput
    from engine.sampling_params import SamplingParams
    from engine.sched.request import Request
    from engine.sched.scheduler import Scheduler
    from engine.worker.model_runner import ModelRunner

    spec = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=1, head_size=8, dtype_size=4, num_layers=1)
    scheduler = Scheduler(
        SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4, max_model_len=64),
        CacheConfig(block_size=BLOCK_SIZE),
        KVCacheConfig(num_blocks=NUM_BLOCKS, spec=spec),
    )
    # The worker's side, without a model: the mirror of each request and the step's inputs.
    runner = ModelRunner(
        EngineConfig(ModelConfig(), cache_config=CacheConfig(block_size=BLOCK_SIZE)),
        torch.device("cpu"),
        torch.float32,
    )
    hasher = get_request_block_hasher(BLOCK_SIZE)
    steps: list[StepInputs] = []
    written: dict[int, int] = {}
    finished: list[str] = []
    for step, arrivals in enumerate(ARRIVALS, start=1):
        for req_id in arrivals:
            params = SamplingParams(max_tokens=MAX_TOKENS[req_id])
            scheduler.add_request(Request(req_id, PROMPTS[req_id], params, eos_token_id=None,
                                          arrival_time=float(step), block_hasher=hasher))  # fmt: skip
        so = scheduler.schedule()
        runner._update_states(so)
        batch = runner._prepare_inputs(so)
        slots = batch.attn_metadata.slot_mapping.tolist()
        for slot in slots:
            written[slot] = step
        steps.append(
            StepInputs(
                num_scheduled_tokens=dict(so.num_scheduled_tokens),
                prefix_hits={new.req_id: new.num_computed_tokens for new in so.scheduled_new_reqs},
                req_ids=list(batch.req_ids),
                positions=batch.positions.tolist(),
                slot_mapping=slots,
                block_tables={r: list(runner.requests[r].block_ids) for r in batch.req_ids},
            )
        )
        # Every request whose prompt is complete samples a token (as execute_model would).
        req_ids = list(so.num_scheduled_tokens)
        sampled = []
        for req_id in req_ids:
            request = scheduler.requests[req_id]
            done = request.num_computed_tokens >= request.num_tokens
            sampled.append([SAMPLED_TOKEN] if done else [])
            if done:
                runner.requests[req_id].output_token_ids.append(SAMPLED_TOKEN)
        outputs = scheduler.update_from_output(
            so,
            ModelRunnerOutput(
                req_ids=req_ids,
                req_id_to_index={r: i for i, r in enumerate(req_ids)},
                sampled_token_ids=sampled,
            ),  # fmt: skip
        )
        steps[-1].finished = [o.request_id for eco in outputs.values() for o in eco.outputs if o.finished]
        finished += steps[-1].finished

    manager = scheduler.kv_cache_manager
    pool = manager.block_pool
    tables = {r: [b.block_id for b in blocks] for r, blocks in manager.req_to_blocks.items()}
    blocks = [
        BlockState(
            block_id=b.block_id,
            ref_cnt=b.ref_cnt,
            hash_hex=b.block_hash.hex()[:8] if b.block_hash is not None else None,
            is_null=b.is_null,
            holders=sorted(r for r, ids in tables.items() if b.block_id in ids),
        )
        for b in pool.blocks
    ]
    return KVSnapshot(
        block_size=manager.block_size,
        blocks=blocks,
        block_tables=tables,
        num_computed_tokens={r: scheduler.requests[r].num_computed_tokens for r in tables},
        num_cached_blocks=dict(manager.num_cached_block),
        free_queue=[b.block_id for b in pool.free_block_queue.get_all_free_blocks()],
        finished=finished,
        steps=steps,
        written=written,
    )


# ---------------------------------------------------------------------------- drawing

# Per state: fill, stroke, dashed, what the legend says.
STYLES: dict[str, tuple[str, str, bool, str]] = {
    "null": ("#eaeef2", "#6e7781", False, "the null block (block 0): never handed out, pads block tables"),
    "A": ("#ddf4ff", "#0969da", False, "held by A alone (ref_cnt 1)"),
    "B": ("#fff1e5", "#bc4c00", False, "held by B alone (ref_cnt 1)"),
    "shared": ("#fbefff", "#8250df", False, "held by A and B: a cached prefix block, ref_cnt 2"),
    "cached": (
        "#dafbe1",
        "#1a7f37",
        True,
        "free but still cached: keeps its hash, a hit until the pool reuses it",
    ),
    "free": ("#ffffff", "#8c959f", True, "free (old data, if any, is never read)"),
}
NO_HASH = "\u2013"  # a block that is not cached
WRITTEN = "#cf222e"  # the outline of the slots the last step wrote
STALE = "#afb8c1"  # the fill of a slot a finished request wrote, in a free block with no hash

BLOCK_W, BLOCK_H, BLOCK_GAP = 150, 104, 14
CELL_W, CELL_H = 15, 22
PER_ROW = 6


def _state(block: BlockState) -> str:
    if block.is_null:
        return "null"
    if len(block.holders) > 1:
        return "shared"
    if block.holders:
        return block.holders[0]
    return "cached" if block.hash_hex is not None else "free"


def _swatch(svg: Canvas, x: float, y: float, state: str, w: float = 18, h: float = 14) -> None:
    fill, stroke, dashed, _ = STYLES[state]
    svg.rect(x, y, w, h, fill=fill, stroke=stroke, dashed=dashed, width=1.5, rx=2)


def _heading(svg: Canvas, y: float, title: str, note: str) -> None:
    w = svg.text(MARGIN, y, title, size=13.5, bold=True)
    svg.text(MARGIN + w * 1.08 + 14, y, note, size=12, colour=MUTED)  # bold runs wider than estimated


def draw(snap: KVSnapshot) -> str:
    bs = snap.block_size
    last = snap.steps[-1]
    step_no = len(snap.steps)
    svg = Canvas()
    svg.text(MARGIN, MARGIN + 14, f"The paged KV cache after step {step_no}", size=15, mono=True, bold=True)
    svg.text(MARGIN, MARGIN + 34, f"block_size {bs}, {len(snap.blocks)} blocks; what Scheduler, KVCacheManager, "
             "BlockPool and ModelRunner._prepare_inputs hold after a scripted run (no model)",
             size=12.5, colour=MUTED)  # fmt: skip
    y = MARGIN + 60
    for i, step in enumerate(snap.steps, start=1):
        parts = []
        for req_id, n in step.num_scheduled_tokens.items():
            hit = step.prefix_hits.get(req_id, 0)
            new = req_id in step.prefix_hits
            kind = "prefill" if n > 1 else "decode"
            part = f"{req_id} {kind}s {n} token{'s' if n != 1 else ''}"
            if new and hit:
                part += f" after a {hit}-token prefix-cache hit"
            parts.append(part)
        line = f"step {i}: " + ", ".join(parts)
        if step.finished:
            line += f"; {', '.join(step.finished)} samples its last token, finishes and frees its blocks"
        svg.text(MARGIN, y, line, size=12.5)
        y += 18

    # The pool.
    y += 16
    _heading(svg, y, "BlockPool.blocks", f"cells: the {bs} slots of a block, filled where KV was written; "
             f"outlined: written in step {step_no}")  # fmt: skip
    top = y + 12
    for block in snap.blocks:
        row, col = divmod(block.block_id, PER_ROW)
        bx = MARGIN + col * (BLOCK_W + BLOCK_GAP)
        by = top + row * (BLOCK_H + BLOCK_GAP)
        state = _state(block)
        fill, stroke, dashed, _ = STYLES[state]
        svg.rect(bx, by, BLOCK_W, BLOCK_H, fill=fill, stroke=stroke, dashed=dashed, width=1.6, rx=6)
        svg.text(bx + 10, by + 18, f"block {block.block_id}", size=13, mono=True, bold=True)
        who = {"null": "null", "shared": "A, B", "cached": "cached", "free": "free"}.get(state, state)
        svg.text(bx + BLOCK_W - 10, by + 18, who, size=11.5, anchor="end", colour=stroke, bold=True)
        cx0 = bx + (BLOCK_W - bs * CELL_W) / 2
        for k in range(bs):
            slot = block.block_id * bs + k
            cell_fill = stroke if slot in snap.written and not block.is_null else "#ffffff"
            if cell_fill != "#ffffff" and state in ("free", "cached"):
                cell_fill = STALE if state == "free" else stroke  # stale, never read again
            now = snap.written.get(slot) == step_no
            svg.rect(cx0 + k * CELL_W, by + 27, CELL_W, CELL_H, fill=cell_fill,
                     stroke=WRITTEN if now else "#8c959f", width=2.2 if now else 0.8)  # fmt: skip
        svg.text(bx + 10, by + 66, f"slots {block.block_id * bs}\u2013{block.block_id * bs + bs - 1}", size=11,
                 mono=True, colour=MUTED)  # fmt: skip
        if block.is_null:
            details = ["no ref_cnt", "no hash"]
        else:
            details = [f"ref_cnt {block.ref_cnt}", f"hash {block.hash_hex or NO_HASH}"]
        for j, detail in enumerate(details):
            svg.text(bx + 10, by + 82 + 14 * j, detail, size=11, mono=True, colour=TEXT)
    rows = -(-len(snap.blocks) // PER_ROW)
    y = top + rows * (BLOCK_H + BLOCK_GAP) + 20

    # The block tables.
    _heading(svg, y, "Block tables", "KVCacheManager.req_to_blocks: block ids in token order; the worker "
             "keeps the same list per request")  # fmt: skip
    y += 14
    by_id = {b.block_id: b for b in snap.blocks}
    for req_id in sorted({*snap.block_tables, *snap.finished}):
        ids = snap.block_tables.get(req_id)
        svg.text(MARGIN + 8, y + 19, req_id, size=13, mono=True, bold=True)
        x = MARGIN + 32
        if ids is None:
            when = next(i for i, s in enumerate(snap.steps, start=1) if req_id in s.finished)
            svg.text(x, y + 19, f"[ ]  finished in step {when}: KVCacheManager.free returned its blocks, tail first",
                     size=12, colour=MUTED)  # fmt: skip
        else:
            for block_id in ids:
                fill, stroke, dashed, _ = STYLES[_state(by_id[block_id])]
                svg.rect(x, y + 4, 34, 22, fill=fill, stroke=stroke, dashed=dashed, width=1.5, rx=3)
                svg.text(x + 17, y + 19, str(block_id), size=12.5, mono=True, bold=True, anchor="middle")
                x += 38
            n = snap.num_computed_tokens[req_id]
            svg.text(x + 10, y + 19, f"num_computed_tokens {n}: KV of tokens 0\u2013{n - 1}; its hashed full "
                     f"blocks: {snap.num_cached_blocks[req_id]}", size=12, colour=MUTED)  # fmt: skip
        y += 30

    # The slot mapping of the last step.
    y += 22
    _heading(svg, y, f"slot_mapping of step {step_no}", f"ModelRunner._prepare_inputs, decodes first: "
             f"slot = block_table[req][pos // {bs}] \u00b7 {bs} + pos % {bs}")  # fmt: skip
    y += 10
    names = ["request", "position", "block", "slot"]
    col_w, label_w = 52, 76
    for j, name in enumerate(names):
        svg.text(MARGIN + 8, y + 20 + 22 * j, name, size=12, colour=MUTED)
    order = [r for r in last.req_ids for _ in range(last.num_scheduled_tokens[r])]
    for k, (req_id, pos, slot) in enumerate(zip(order, last.positions, last.slot_mapping, strict=True)):
        block_id = last.block_tables[req_id][pos // bs]
        assert slot == block_id * bs + pos % bs, (req_id, pos, slot)
        x = MARGIN + label_w + k * col_w
        fill, stroke, dashed, _ = STYLES[_state(by_id[block_id])]
        svg.rect(x, y + 4, col_w - 4, 88, fill=fill, stroke=stroke, dashed=dashed, width=1.2, rx=3)
        for j, value in enumerate([req_id, pos, block_id, slot]):
            svg.text(x + (col_w - 4) / 2, y + 20 + 22 * j, str(value), size=12.5, mono=True, bold=j == 3,
                     anchor="middle", colour=WRITTEN if j == 3 else TEXT)  # fmt: skip
    y += 128

    # The free queue.
    _heading(
        svg,
        y,
        "BlockPool.free_block_queue",
        "head: handed out (and evicted) first; freed blocks join the tail",
    )
    y += 12
    svg.text(MARGIN + 8, y + 19, "head", size=12, colour=MUTED)
    x = MARGIN + 52
    for block_id in snap.free_queue:
        fill, stroke, dashed, _ = STYLES[_state(by_id[block_id])]
        svg.rect(x, y + 4, 34, 22, fill=fill, stroke=stroke, dashed=dashed, width=1.5, rx=3)
        svg.text(x + 17, y + 19, str(block_id), size=12.5, mono=True, bold=True, anchor="middle")
        x += 38
    svg.text(x + 6, y + 19, f"tail   ({len(snap.free_queue)} free; the null block is never in it)", size=12,
             colour=MUTED)  # fmt: skip
    y += 58

    # The legend.
    for state, (_, _, _, text) in STYLES.items():
        _swatch(svg, MARGIN, y - 11, state)
        svg.text(MARGIN + 28, y, text, size=12)
        y += 20
    svg.rect(MARGIN + 2, y - 12, CELL_W - 2, 15, fill=STALE, stroke="#8c959f", width=0.8)
    svg.text(MARGIN + 28, y, "a slot written earlier by a finished request: stale, never read", size=12)
    y += 20
    svg.rect(MARGIN + 2, y - 12, CELL_W - 2, 15, fill="#ffffff", stroke=WRITTEN, width=2.2)
    svg.text(MARGIN + 28, y, f"a slot written in step {step_no}: the slot_mapping", size=12)
    return svg.render("The paged KV cache: blocks, block tables, slot mapping", "; ".join(
        f"block {b.block_id}: {_state(b)}" for b in snap.blocks), f"`{COMMAND}` from engine/kv_cache/pictures.py")  # fmt: skip


def render() -> dict[str, str]:
    """The picture: file name -> SVG text."""
    return {FILE_NAME: draw(run_workload())}


def write_pictures(out_dir: Path) -> list[Path]:
    return write_svgs(render(), out_dir)
