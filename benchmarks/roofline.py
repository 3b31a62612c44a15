"""The hardware's limit for ``vs_vllm.py``'s offline workload: how fast it could possibly run here.

A throughput figure alone (438 out tok/s) says nothing about how much is left. This script
measures what the machine can do, turns it into a lower bound on the workload's time, and
prints each engine's throughput as a fraction of the matching upper bound on throughput:

    .venv/bin/python benchmarks/roofline.py --tok-s glassbox=float32:438 glassbox=bfloat16:470
    .venv/bin/python benchmarks/roofline.py --num-prompts 128 --model-size 0.5b --svg /tmp/roofline.svg

**Peaks** (all usable cores at once, one pinned process per core, best of ``--repeats``):

- *instruction peak*: ``cpu_fma_peak.py``'s loop of 12 independent chains of ``vfmadd231ps``
  (16 float32 multiply-adds) and ``vdpbf16ps`` (32 bfloat16 multiply-adds) — or, on a CPU with
  AMX, of the tile instruction ``tdpbf16ps`` (8,192) for bfloat16 — run on every core at once,
  each core's best round summed over the cores. Without AVX512-BF16 the bfloat16 peak is the torch bfloat16 matmul's (oneDNN's) rate;
  without AVX-512 or g++ both peaks are the torch matmul's. The output says which.
- *practical peak*: a matmul of two ``--matmul-size``² matrices (all threads), the faster of
  ``torch.matmul`` and oneDNN's matmul on a pre-packed weight (what the engines' linears run;
  in float32 on an AMD CPU ``torch.matmul`` is MKL's slower path), the most a real GEMM
  reaches; a second bound is computed with it.

**Bandwidth**: ``torch.sum`` over a ``--buffer-mib`` float32 buffer (all threads, best of
``--repeats``), in GB/s of bytes read.

**Schedule**: the prompts of ``offline_throughput.make_workload`` (same seed, lengths and
model shape as ``vs_vllm.py``) go through a continuous-batching schedule like Glassbox's
(and vLLM V1's) scheduler with its ``LLM`` defaults, ``max_num_batched_tokens`` and
``max_num_seqs`` read from ``engine.engine_args``: each step first gives every running
request its tokens (a decode 1, an unfinished prefill the rest of its prompt) in order while
the token budget lasts, then admits waiting requests (first come, first served) while the
budget and ``max_num_seqs`` allow, a prompt longer than what is left chunked. A step that
computes a prompt's last token samples the first output token; each decode step samples one
more; a request of ``n`` output tokens computes ``prompt + n - 1`` tokens. The KV cache is
taken as large enough (no preemption), as it is on this workload.

**Cost of one step** (the model is a Llama of ``MODEL_SIZES[--model-size]``; ``size`` is the
dtype's bytes, 4 or 2; the KV cache has the model's dtype):

- FLOPs = 2 × (parameters of the decoder's linears: q, k, v, o, gate, up, down) × tokens
  + 2 × (lm_head parameters) × requests scheduled (one logits row each)
  + 4 × layers × heads × head_dim × (query, key) pairs, where a request that has ``c``
  tokens computed and computes ``n`` more has ``n·c + n(n+1)/2`` causal pairs (QKᵀ and PV,
  2 FLOPs each per multiply-add).
- bytes = (decoder linears + lm_head) × size (every weight read once per step)
  + 2 × layers × kv_heads × head_dim × size × (KV entries each scheduled request's attention
  reads: its whole context after the step, ``c + n``; the new entries' writes stand in that
  read).
- time ≥ max(FLOPs ÷ (2 × multiply-adds/s), bytes ÷ bandwidth).

Left out, each of which only makes the true time longer: embeddings, norms, rotary,
activations, softmax, sampling, the Python between steps. The sum over steps is a lower
bound on the workload's seconds; output tokens ÷ it is an upper bound on out tok/s.

Throughputs to compare come from ``--tok-s NAME=DTYPE:VALUE`` (``glassbox=float32:438``) and
from ``vllm_recorded.json``'s entry of this very workload (with the date and machine it was
recorded on, as ``vs_vllm.py`` prints them). ``--svg PATH`` draws them against the bounds.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(Path(__file__).resolve().parent)]

from cpu_fma_peak import MULTIPLY_ADDS, compile_peak, cpu_flags, read_peak, start_peak  # noqa: E402
from offline_throughput import MODEL_SIZES, describe_model, make_workload  # noqa: E402
from vs_vllm import cpu_model, load_average, read_recorded, recorded_label, recorded_value  # noqa: E402

DTYPES = ("float32", "bfloat16")
DTYPE_BYTES = {"float32": 4, "bfloat16": 2}


# --- the bound --------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelCost:
    """What one token, one logits row and one (query, key) pair cost a Llama of a shape."""

    linear_params: int  # the decoder layers' q, k, v, o, gate, up, down weights
    lm_head_params: int
    attention_flops_per_pair: int  # 4 × layers × heads × head_dim
    kv_entries_per_token: int  # 2 × layers × kv_heads × head_dim (K and V)

    @classmethod
    def from_shape(cls, shape: dict) -> ModelCost:
        h, layers = shape["hidden_size"], shape["num_hidden_layers"]
        heads, kv_heads = shape["num_attention_heads"], shape["num_key_value_heads"]
        head_dim = shape.get("head_dim", h // heads)
        attention = h * heads * head_dim * 2 + h * kv_heads * head_dim * 2  # q and o, k and v
        mlp = 3 * h * shape["intermediate_size"]
        return cls(linear_params=layers * (attention + mlp), lm_head_params=h * shape["vocab_size"],
                   attention_flops_per_pair=4 * layers * heads * head_dim,
                   kv_entries_per_token=2 * layers * kv_heads * head_dim)  # fmt: skip


@dataclass(frozen=True)
class StepWork:
    """The work of one scheduled step."""

    tokens: int  # tokens computed (prefill chunks + decodes)
    requests: int  # requests scheduled (one logits row each)
    pairs: int  # causal (query, key) pairs of attention
    kv_read: int  # KV entries (tokens) read by attention
    prefill_tokens: int

    def flops(self, cost: ModelCost) -> int:
        return (2 * cost.linear_params * self.tokens + 2 * cost.lm_head_params * self.requests
                + cost.attention_flops_per_pair * self.pairs)  # fmt: skip

    def bytes(self, cost: ModelCost, size: int) -> int:
        return (
            cost.linear_params + cost.lm_head_params
        ) * size + cost.kv_entries_per_token * size * self.kv_read


def default_budget() -> tuple[int, int]:
    """Glassbox's offline (``LLM``) defaults: (max_num_batched_tokens, max_num_seqs)."""
    from engine.engine_args import DEFAULT_MAX_NUM_BATCHED_TOKENS, DEFAULT_MAX_NUM_SEQS

    return DEFAULT_MAX_NUM_BATCHED_TOKENS["llm"], DEFAULT_MAX_NUM_SEQS["llm"]


def schedule(prompt_lens: list[int], out_lens: list[int], max_num_batched_tokens: int,
             max_num_seqs: int) -> list[StepWork]:  # fmt: skip
    """The steps of a continuous-batching schedule of the workload (module docstring)."""
    waiting = list(range(len(prompt_lens)))
    running: list[int] = []
    computed = [0] * len(prompt_lens)
    sampled = [0] * len(prompt_lens)
    steps = []
    while waiting or running:
        budget = max_num_batched_tokens
        scheduled: list[tuple[int, int]] = []
        for r in running:
            if budget == 0:
                break
            n = 1 if computed[r] >= prompt_lens[r] else min(prompt_lens[r] - computed[r], budget)
            scheduled.append((r, n))
            budget -= n
        while waiting and budget > 0 and len(running) < max_num_seqs:
            r = waiting.pop(0)
            running.append(r)
            n = min(prompt_lens[r], budget)
            scheduled.append((r, n))
            budget -= n
        pairs = kv = prefill = 0
        for r, n in scheduled:
            c = computed[r]
            pairs += n * c + n * (n + 1) // 2
            kv += c + n
            prefill += n if c < prompt_lens[r] else 0
            computed[r] = c + n
            if computed[r] >= prompt_lens[r]:
                sampled[r] += 1
        steps.append(StepWork(tokens=sum(n for _, n in scheduled), requests=len(scheduled), pairs=pairs,
                              kv_read=kv, prefill_tokens=prefill))  # fmt: skip
        running = [r for r in running if sampled[r] < out_lens[r]]
    return steps


@dataclass(frozen=True)
class Bound:
    seconds: float
    out_tok_s: float
    compute_bound_steps: int
    steps: int


def lower_bound(steps: list[StepWork], cost: ModelCost, size: int, flops_per_s: float, bytes_per_s: float,
                output_tokens: int) -> Bound:  # fmt: skip
    """Σ over steps of max(FLOPs ÷ peak, bytes ÷ bandwidth), and what it means for out tok/s."""
    seconds, compute_bound = 0.0, 0
    for s in steps:
        compute, memory = s.flops(cost) / flops_per_s, s.bytes(cost, size) / bytes_per_s
        seconds += max(compute, memory)
        compute_bound += compute >= memory
    return Bound(seconds, output_tokens / seconds, compute_bound, len(steps))


# --- the measurements -------------------------------------------------------------------------


@dataclass
class Peak:
    multiply_adds_per_s: float
    source: str


def instruction_peaks(cores: list[int], repeats: int) -> dict[str, Peak | None]:
    """Multiply-adds/s of all ``cores`` at once (one pinned loop each; the sum of each core's
    best of ``repeats`` rounds); ``None`` for a dtype whose instruction this CPU (or this toolchain) lacks."""
    flags = cpu_flags()
    if shutil.which("g++") is None or "avx512f" not in flags:
        return {d: None for d in DTYPES}
    best = {cpu: (0.0, 0.0, 0.0) for cpu in cores}  # each core's best round: another process's time slice
    with tempfile.TemporaryDirectory() as tmp:  # on one core in one round is not held against it
        exe = compile_peak(Path(tmp))
        for _ in range(repeats):
            procs = {cpu: start_peak(exe, cpu) for cpu in cores}
            for cpu, proc in procs.items():
                best[cpu] = tuple(max(a, b) for a, b in zip(best[cpu], read_peak(proc)))
    fma, dp, amx = (sum(b[i] for b in best.values()) for i in range(3))
    n = len(cores)
    out: dict[str, Peak | None] = {
        "float32": Peak(fma * 16e9, f"vfmadd231ps zmm × 16 lanes, {n} cores at once")
    }
    if amx > 0:  # AMX tiles: what oneDNN's bfloat16 matmul runs on where the CPU has them
        out["bfloat16"] = Peak(amx * MULTIPLY_ADDS["amx"] * 1e9, f"AMX tdpbf16ps × 8,192, {n} cores at once")
    else:
        out["bfloat16"] = (Peak(dp * 32e9, f"vdpbf16ps zmm × 32 products, {n} cores at once")
                           if dp > 0 and "avx512_bf16" in flags else None)  # fmt: skip
    return out


def matmul_rates(dtype: str, size: int, repeats: int) -> dict[str, float]:
    """Multiply-adds/s of a ``size``×``size`` matmul (all threads), best of ``repeats``, two
    ways: ``torch.matmul`` (MKL's sgemm in float32, which on an AMD CPU takes a slower path —
    on the Zen 5 37 % of the FMA peak) and oneDNN's matmul on a pre-packed weight
    (``mkldnn._linear_pointwise``: what Glassbox's and vLLM's CPU linears run). Without oneDNN
    only the first."""
    import torch

    a = torch.randn(size, size).to(getattr(torch, dtype))
    b = torch.randn(size, size).to(getattr(torch, dtype))
    ways = {"torch.matmul": lambda: torch.matmul(a, b)}
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(b, size)
        torch.ops.mkldnn._linear_pointwise(a, packed, None, "none", [], "")
        ways["oneDNN packed linear"] = lambda: torch.ops.mkldnn._linear_pointwise(
            a, packed, None, "none", [], ""
        )
    except (RuntimeError, AttributeError):
        pass
    rates = {}
    for name, fn in ways.items():
        fn()  # warm: the library picks and caches its kernel
        best = float("inf")
        for _ in range(repeats):
            t = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - t)
        rates[name] = size**3 / best
    return rates


def matmul_peak(dtype: str, size: int, repeats: int) -> float:
    """The faster of ``matmul_rates``: multiply-adds/s."""
    return max(matmul_rates(dtype, size, repeats).values())


def read_bandwidth(mib: int, repeats: int) -> float:
    """Bytes/s of ``torch.sum`` over a ``mib`` MiB float32 buffer (all threads), best of ``repeats``."""
    import torch

    buf = torch.ones(mib * 2**20 // 4)
    buf.sum()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        buf.sum()
        best = min(best, time.perf_counter() - t)
    return buf.numel() * 4 / best


# --- the report -------------------------------------------------------------------------------


def parse_tok_s(text: str) -> tuple[str, str, float]:
    name, sep, rest = text.partition("=")
    dtype, sep2, value = rest.partition(":")
    try:
        number = float(value)
    except ValueError:
        number = -1.0
    if not sep or not sep2 or not name or dtype not in DTYPES or number <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: expected NAME=DTYPE:VALUE, e.g. glassbox=float32:438")
    return name, dtype, number


def cpu_features() -> str:
    flags = cpu_flags()

    def has(*names: str) -> str:
        return "yes" if all(n in flags for n in names) else "no"

    return (f"AVX-512 {has('avx512f')}, AVX512-BF16 {has('avx512_bf16')}, "
            f"AMX {has('amx_tile', 'amx_bf16')}")  # fmt: skip


def recorded_figures(args) -> list[tuple[str, dict[str, float]]]:
    """(label, {dtype: out tok/s}) of vllm_recorded.json's entry of this workload, if any: vLLM's
    figures, and Glassbox's of the same run where the entry has them."""
    this = {"num_prompts": args.num_prompts, "input_len": list(args.input_len),
            "output_len": list(args.output_len), "max_model_len": args.max_model_len,
            "model_size": args.model_size}  # fmt: skip
    out = []
    for entry in read_recorded().get("offline", {}).values():
        if all(recorded_value(entry, k) == v for k, v in this.items()):
            label = (f"vLLM {entry['vllm_version']} RECORDED {entry['date']} on {entry['cpu_model']}, "
                     f"{entry['cores']} cores ({recorded_label(entry)})")  # fmt: skip
            out.append((label, {d: float(v) for d, v in entry["out_tok_s"].items()}))
            if entry.get("glassbox_same_run"):
                label = (f"Glassbox in that RECORDED run ({entry['date']}, {entry['cpu_model']}, "
                         f"{entry['cores']} cores)")  # fmt: skip
                out.append((label, {d: float(v) for d, v in entry["glassbox_same_run"].items()}))
    return out


COLOURS = ["#0969da", "#8250df", "#1a7f37", "#bc4c00", "#cf222e", "#57606a"]


def draw_svg(bounds: dict[str, tuple[Bound, Bound]], engines: list[tuple[str, dict[str, float]]],
             title: str, subtitle: str) -> str:  # fmt: skip
    """A bar per engine and dtype, the two bounds as lines across each dtype's group."""
    from engine.utils.svg import MUTED, Canvas

    c = Canvas()
    left, top, plot_h, bar_w = 90, 92, 300, 52
    c.text(24, 28, title, size=15, bold=True)
    c.text(24, 48, subtitle, size=11, colour=MUTED)
    dtypes = list(bounds)
    top_value = max([b.out_tok_s for pair in bounds.values() for b in pair]
                    + [v for _, f in engines for v in f.values()])  # fmt: skip
    step = next(m * 10**k for k in range(12) for m in (1, 2, 5) if top_value / (m * 10**k) <= 6)
    axis_max = step * (int(top_value * 1.08 / step) + 1)

    def y(v: float) -> float:
        return top + plot_h - v / axis_max * plot_h

    group_w = max(1, len(engines)) * (bar_w + 12) + 28
    label_w = 150  # the bounds' labels, right of each group
    width = (group_w + label_w) * len(dtypes)
    t = 0.0
    while t <= axis_max + 1e-9:
        c.path([(left, y(t)), (left + width - label_w, y(t))], "#d0d7de", width=0.8, end=False)
        c.text(left - 8, y(t) + 4, f"{t:,.0f}", size=11, anchor="end", colour=MUTED)
        t += step
    c.text(left - 8, top - 18, "out tok/s", size=11, anchor="end", colour=MUTED)
    for g, dtype in enumerate(dtypes):
        x0 = left + g * (group_w + label_w)
        instr, practical = bounds[dtype]
        for i, (_name, figures) in enumerate(engines):
            x = x0 + 20 + i * (bar_w + 12)
            value = figures.get(dtype)
            if value is None:
                continue
            c.rect(x, y(value), bar_w, y(0) - y(value), fill=COLOURS[i % len(COLOURS)], stroke="none")
            c.text(x + bar_w / 2, y(value) - 5, f"{value:,.0f}", size=11, anchor="middle", chip=True)
            if y(0) - y(value) > 22:
                c.text(x + bar_w / 2, y(value) + 15, f"{value / instr.out_tok_s:.0%}", size=11, bold=True,
                       anchor="middle", colour="#ffffff")  # fmt: skip
        label_ys = []
        for bound, dashed, label in ((instr, False, "instruction peak"), (practical, True, "matmul peak")):
            by = y(bound.out_tok_s)
            c.path([(x0 + 6, by), (x0 + group_w, by)], "#cf222e", width=2, dashed=dashed, end=False)
            ly = by + 4
            for other in label_ys:  # two bounds close together: their labels one above the other
                if abs(ly - other) < 14:
                    ly = other - 14 if ly <= other else other + 14
            label_ys.append(ly)
            c.text(x0 + group_w + 6, ly, f"{bound.out_tok_s:,.0f} ({label})", size=10.5, colour="#cf222e")
        c.text(x0 + group_w / 2, y(0) + 20, dtype, size=13, bold=True, anchor="middle")
    c.path([(left, y(0)), (left + width - label_w, y(0))], "#1f2328", width=1.2, end=False)
    ly = y(0) + 46
    for i, (name, _) in enumerate(engines):
        c.rect(24, ly - 10 + i * 18, 12, 12, fill=COLOURS[i % len(COLOURS)], stroke="none")
        c.text(42, ly + i * 18, name, size=11)
    c.text(24, ly + len(engines) * 18 + 6, "% in a bar: its share of the instruction-peak bound; red lines: the "
           "bounds (solid: instruction peak, dashed: matmul peak)", size=10, colour=MUTED)  # fmt: skip
    return c.render(title, subtitle, "benchmarks/roofline.py")  # no "--" in an XML comment


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--input-len", type=int, nargs=2, default=(32, 512))
    ap.add_argument("--output-len", type=int, nargs=2, default=(32, 256))
    ap.add_argument("--max-model-len", type=int, default=1024, help="only to match recorded figures")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model-size", choices=sorted(MODEL_SIZES), default="small")
    ap.add_argument("--tok-s", type=parse_tok_s, nargs="*", default=[], metavar="NAME=DTYPE:VALUE",
                    help="a throughput to compare with the bound, e.g. glassbox=float32:438")  # fmt: skip
    ap.add_argument("--repeats", type=int, default=5, help="best of this many, for each measurement")
    ap.add_argument("--matmul-size", type=int, default=2048)
    ap.add_argument("--buffer-mib", type=int, default=1024)
    ap.add_argument("--svg", help="also draw the table as an SVG bar chart here")
    args = ap.parse_args()

    import torch

    cores = sorted(os.sched_getaffinity(0))
    load_before = load_average()
    instruction = instruction_peaks(cores, args.repeats)
    rates = {d: matmul_rates(d, args.matmul_size, args.repeats) for d in DTYPES}
    practical = {d: max(rates[d].values()) for d in DTYPES}
    bandwidth = read_bandwidth(args.buffer_mib, args.repeats)
    peaks: dict[str, Peak] = {}
    for d in DTYPES:
        peak = instruction[d]
        if peak is None:
            why = "no AVX512-BF16" if d == "bfloat16" and instruction["float32"] else "no AVX-512 or no g++"
            peak = Peak(practical[d], f"{why}: the best {d} matmul's rate stands in")
        peaks[d] = peak

    shape = MODEL_SIZES[args.model_size]
    cost = ModelCost.from_shape(shape)
    prompts, out_lens = make_workload(
        args.num_prompts, args.seed, tuple(args.input_len), tuple(args.output_len)
    )
    batched, seqs = default_budget()
    steps = schedule([len(p) for p in prompts], out_lens, batched, seqs)
    total_out = sum(out_lens)
    bounds = {d: (lower_bound(steps, cost, DTYPE_BYTES[d], 2 * peaks[d].multiply_adds_per_s, bandwidth, total_out),
                  lower_bound(steps, cost, DTYPE_BYTES[d], 2 * practical[d], bandwidth, total_out))
              for d in DTYPES}  # fmt: skip

    print(f"workload: {args.num_prompts} prompts of random token ids (seed {args.seed}), input "
          f"{args.input_len[0]}–{args.input_len[1]}, output {args.output_len[0]}–{args.output_len[1]} tokens "
          f"({sum(map(len, prompts))} in, {total_out} out); model ({args.model_size}): {describe_model(shape)}, "
          f"{cost.linear_params / 1e6:.1f} M in the decoder's linears + {cost.lm_head_params / 1e6:.1f} M lm_head")  # fmt: skip
    print(f"machine: {cpu_model()}, {len(cores)} usable cores; {cpu_features()}; load average "
          f"{load_before} before, {load_average()} after the measurements; torch threads {torch.get_num_threads()}")  # fmt: skip
    print(f"\npeaks (best of {args.repeats}):")
    for d in DTYPES:
        p = peaks[d]
        print(f"  {d:<9} instruction peak {2 * p.multiply_adds_per_s / 1e9:8.1f} GFLOP/s ({p.source}); "
              f"matmul {args.matmul_size}³: " + ", ".join(
                  f"{name} {2 * r / 1e9:.1f} GFLOP/s ({r / p.multiply_adds_per_s:.0%} of it)"
                  for name, r in rates[d].items()))  # fmt: skip
    print(
        f"memory bandwidth: {bandwidth / 1e9:.1f} GB/s (torch.sum over {args.buffer_mib} MiB float32, "
        f"{torch.get_num_threads()} threads)"
    )
    prefill_steps = sum(s.prefill_tokens > 0 for s in steps)
    print(f"schedule: {len(steps)} steps ({prefill_steps} with prefill tokens, {len(steps) - prefill_steps} "
          f"decode only) at max_num_batched_tokens {batched}, max_num_seqs {seqs} (Glassbox's LLM defaults)")  # fmt: skip

    engines: dict[str, dict[str, float]] = {}
    for name, dtype, value in args.tok_s:
        engines.setdefault(name, {})[dtype] = value
    engine_list = list(engines.items()) + recorded_figures(args)
    for d in DTYPES:
        instr, prac = bounds[d]
        print(f"\n{d}: lower bound {instr.seconds:.2f} s → at most {instr.out_tok_s:,.0f} out tok/s at the "
              f"instruction peak ({instr.compute_bound_steps}/{instr.steps} steps compute-bound); "
              f"{prac.seconds:.2f} s → {prac.out_tok_s:,.0f} out tok/s at the matmul peak "
              f"({prac.compute_bound_steps}/{prac.steps} compute-bound)")  # fmt: skip
        print("| engine | out tok/s | ÷ instruction-peak bound | ÷ matmul-peak bound |")
        print("|---|---|---|---|")
        print(f"| bound | {instr.out_tok_s:,.0f} | 1 | {instr.out_tok_s / prac.out_tok_s:.2f} |")
        for name, figures in engine_list:
            if d in figures:
                v = figures[d]
                print(f"| {name} | {v:,.0f} | {v / instr.out_tok_s:.3f} | {v / prac.out_tok_s:.3f} |")
    print(
        "\n(the instruction-peak bound is the hard one; the matmul-peak bound is only as hard as one large "
        "matmul's rate is the best a GEMM reaches here, and a busy machine measures every peak low)"
    )
    if any("RECORDED" in e[0] for e in engine_list):
        print("\n(recorded figures: from the date and machine named; a fraction of this machine's bound "
              "is only indicative when that machine is not this one)")  # fmt: skip
    if args.svg:
        title = (
            f"Out tok/s against this machine's limit ({args.model_size} model, {args.num_prompts} prompts)"
        )
        subtitle = (f"{cpu_model()}, {len(cores)} cores; bandwidth {bandwidth / 1e9:.1f} GB/s; "
                    f"benchmarks/roofline.py")  # fmt: skip
        Path(args.svg).write_text(draw_svg(bounds, engine_list, title, subtitle), encoding="utf-8")
        print(f"\nwrote {args.svg}")


if __name__ == "__main__":
    main()
