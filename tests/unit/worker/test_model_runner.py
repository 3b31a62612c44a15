"""The model runner against transformers, without the scheduler.

Each test drives ``ModelRunner.execute_model`` with hand-built ``SchedulerOutput``s (a
tiny block allocator lives in ``Driver`` below) and checks greedy tokens against
``transformers`` ``generate`` token for token, on tiny random checkpoints of each family:

- llama: grouped-query attention, tied embeddings, "llama3" RoPE scaling;
- qwen2: untied embeddings, Q/K/V bias;
- qwen3: per-head q/k norm, ``head_dim`` larger than ``hidden_size / num_heads``;
- mistral: a sliding window smaller than the prompts and not a multiple of the block size.

Also: the sampler's masks, penalties and min_tokens on hand-made logits; seeded sampling;
logprobs and prompt logprobs against transformers' log-softmax; bfloat16; the loader's
errors and dtype rules; RoPE parameters in both config.json formats.

Model math on many tiny checkpoints: the runner runs eagerly (the ``eager`` fixture), except
in the tests that turn the compiled forward on to check it against eager and transformers.
"""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from engine.kv_cache.kv_cache_interface import KVCacheConfig
from engine.model.layers import compute_inv_freq, rope_parameters_from_config
from engine.model.loader import load_model, resolve_dtype
from engine.model.sampler import Sampler, SamplingMetadata, apply_penalties, apply_top_k_top_p
from engine.outputs import ModelRunnerOutput
from engine.sampling_params import SamplingParams
from engine.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
from engine.worker.model_runner import ModelRunner, apply_grammar_bitmask
from tests.tiny_models import build_tiny_checkpoint, hf_greedy, hf_logits

pytestmark = pytest.mark.usefixtures("eager")

BLOCK_SIZE = 8
NUM_BLOCKS = 48
VOCAB = 256
EOS = 2
GREEDY = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
ARCH_KWARGS = {
    "llama": dict(tie_word_embeddings=True, rope_parameters=LLAMA3_ROPE),
    "qwen2": dict(tie_word_embeddings=False),
    "qwen3": dict(head_dim=32),
    "mistral": dict(sliding_window=6),
}
ARCHS = list(ARCH_KWARGS)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("tiny")
    return {arch: str(build_tiny_checkpoint(root / arch, arch, **kw)) for arch, kw in ARCH_KWARGS.items()}


def make_runner(
    path: str,
    dtype: torch.dtype = torch.float32,
    max_num_batched_tokens: int = 128,
    attention_backend: str | None = "TORCH_SDPA",
) -> ModelRunner:
    config = EngineConfig(
        ModelConfig(model=path, attention_backend=attention_backend),
        cache_config=CacheConfig(block_size=BLOCK_SIZE),
        scheduler_config=SchedulerConfig(max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=16),
    )
    runner = ModelRunner(config, torch.device("cpu"), dtype)
    runner.load_model()
    runner.profile_run()
    runner.initialize_kv_cache(KVCacheConfig(num_blocks=NUM_BLOCKS, spec=runner.get_kv_cache_spec()))
    runner.warm_up()
    return runner


def prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(VOCAB) for _ in range(length)]


class _Req:
    def __init__(self, prompt_ids, params, blocks, num_computed):
        self.tokens = list(prompt_ids)
        self.num_prompt = len(prompt_ids)
        self.params = params
        self.blocks = list(blocks)
        self.num_computed = num_computed
        self.known_to_worker = False
        self.resumed = False

    @property
    def output(self) -> list[int]:
        return self.tokens[self.num_prompt :]


class Driver:
    """Plays the scheduler: allocates blocks, builds SchedulerOutputs, records sampled tokens.

    Block 0 is the null block. Freed blocks go to the front of the free list, so the next
    allocation reuses (and overwrites) them.
    """

    def __init__(self, runner: ModelRunner):
        self.runner = runner
        self.free = list(range(1, NUM_BLOCKS))
        self.reqs: dict[str, _Req] = {}
        self.finished: set[str] = set()

    def add(self, req_id, prompt_ids, params=GREEDY, cached_blocks=(), num_cached=0):
        self.reqs[req_id] = _Req(prompt_ids, params, cached_blocks, num_cached)

    def step(self, plan: dict[str, int], allowed: dict[str, list[int]] | None = None) -> ModelRunnerOutput:
        """``allowed``: structured outputs, request → the only tokens its grammar allows."""
        new_reqs, cached = [], CachedRequestData()
        for req_id, n in plan.items():
            req = self.reqs[req_id]
            needed = -(-(req.num_computed + n) // BLOCK_SIZE) - len(req.blocks)
            added = [self.free.pop(0) for _ in range(max(0, needed))]
            req.blocks += added
            if not req.known_to_worker:
                req.known_to_worker = True
                new_reqs.append(
                    NewRequestData(
                        req_id=req_id,
                        prompt_token_ids=req.tokens[: req.num_prompt],
                        sampling_params=req.params,
                        eos_token_id=EOS,
                        block_ids=(list(req.blocks),),
                        num_computed_tokens=req.num_computed,
                    )
                )
                continue
            cached.req_ids.append(req_id)
            cached.resumed_from_preemption.append(req.resumed)
            cached.resumed_req_token_ids.append(list(req.tokens) if req.resumed else None)
            if req.resumed:
                cached.new_block_ids.append((list(req.blocks),))
            else:
                cached.new_block_ids.append((added,) if added else None)
            cached.num_computed_tokens.append(req.num_computed)
            req.resumed = False
        so = SchedulerOutput(
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=cached,
            num_scheduled_tokens=dict(plan),
            total_num_scheduled_tokens=sum(plan.values()),
            finished_req_ids=self.finished,
        )
        if allowed:
            so.structured_output_request_ids = list(allowed)
            so.grammar_bitmask = bitmask_of(list(allowed.values()), VOCAB).tobytes()
        self.finished = set()
        out = self.runner.execute_model(so)
        assert sorted(out.req_ids) == sorted(plan)
        for req_id, n in plan.items():
            req = self.reqs[req_id]
            req.num_computed += n
            sampled = out.sampled_token_ids[out.req_id_to_index[req_id]]
            if req.num_computed >= len(req.tokens):
                assert len(sampled) == 1
                req.tokens += sampled
            else:
                assert sampled == [], "a partial prefill must not sample"
        return out

    def decode(self, req_ids, steps: int) -> None:
        for _ in range(steps):
            self.step({r: 1 for r in req_ids})

    def preempt(self, req_id) -> None:
        req = self.reqs[req_id]
        self.free = req.blocks + self.free
        req.blocks, req.num_computed, req.resumed = [], 0, True

    def finish(self, req_id) -> None:
        self.free = self.reqs.pop(req_id).blocks + self.free
        self.finished.add(req_id)


def bitmask_of(rows: list[list[int]], vocab: int) -> np.ndarray:
    """The int32 bitmask a grammar would send: row i allows exactly ``rows[i]``."""
    bits = np.zeros((len(rows), -(-vocab // 32) * 32), dtype=np.uint8)
    for i, tokens in enumerate(rows):
        bits[i, tokens] = 1
    return np.packbits(bits, axis=1, bitorder="little").view(np.int32)


def assert_matches_hf(path: str, driver: Driver, req_ids) -> None:
    for req_id in req_ids:
        req = driver.reqs[req_id]
        expected = hf_greedy(path, req.tokens[: req.num_prompt], len(req.output))
        assert req.output == expected, f"{req_id}: ours {req.output} vs transformers {expected}"


# ---------------------------------------------------------------------------- vs transformers


@pytest.mark.parametrize("arch", ARCHS)
def test_tiny_checkpoints_have_clear_greedy_margins(checkpoints, arch):
    # Equivalence tests compare argmaxes; a near-tie could flip on a last-bit difference.
    for seed, n in ((1, 5), (12, 33)):
        ids = prompt(seed, n)
        logits = hf_logits(checkpoints[arch], ids + hf_greedy(checkpoints[arch], ids, 10))[n - 1 :]
        top2 = logits.topk(2, dim=-1).values  # (11, 2)
        assert (top2[:, 0] - top2[:, 1]).min() > 1e-3
        assert logits.softmax(-1).max(-1).values.mean() > 0.5  # peaked, not flat


@pytest.mark.parametrize("arch", ARCHS)
def test_mixed_prompts_in_one_step_then_batched_decodes(checkpoints, arch):
    path = checkpoints[arch]
    driver = Driver(make_runner(path))
    lengths = {"a": 1, "b": 5, "c": 17, "d": 30}  # "a" is a one-token prompt: treated as a decode
    for i, (req_id, n) in enumerate(lengths.items()):
        driver.add(req_id, prompt(i, n))
    driver.step(dict(lengths))
    driver.decode(list(lengths), steps=11)
    assert_matches_hf(path, driver, lengths)


@pytest.mark.parametrize(
    "backend, compiled",
    [("TORCH_SDPA", False), ("PAGED_INDUCTOR", False), ("TORCH_SDPA", True), ("CPU_PAGED_CPP", False)],
)
@pytest.mark.parametrize("arch", ARCHS)
def test_chunked_prefill_alongside_decodes(checkpoints, arch, backend, compiled, monkeypatch):
    # PAGED_INDUCTOR: decodes read the pages in place through the compiled kernel (one
    # compile for every batch shape; Mistral's window makes a second one). compiled: the
    # whole forward through torch.compile (the default outside tests), which must give the
    # eager forward's tokens - transformers' - with one graph for every step, a step of a
    # single token included.
    monkeypatch.setenv("GLASSBOX_TORCH_COMPILE", "1" if compiled else "0")
    path = checkpoints[arch]
    runner = make_runner(path, attention_backend=backend)
    assert (runner.compiled is not None) == compiled
    driver = Driver(runner)
    driver.add("a", prompt(10, 7))
    driver.add("b", prompt(11, 12))
    driver.step({"a": 7, "b": 12})
    # "long" is prefilled in chunks of 11, 13 and 9 (chunk edges off the block edges) while
    # "a" and "b" decode in the same steps; each later chunk follows cached tokens.
    driver.add("long", prompt(12, 33))
    for chunk in (11, 13, 9):
        driver.step({"a": 1, "b": 1, "long": chunk})
    driver.decode(["a", "b", "long"], steps=6)
    assert_matches_hf(path, driver, ["a", "b"])
    driver.finish("a")
    driver.decode(["long"], steps=2)  # one token in the step
    assert_matches_hf(path, driver, ["long"])
    if compiled:
        assert runner.compiled.num_graphs == 1


def test_a_new_thread_count_mid_run_makes_no_second_graph(checkpoints, monkeypatch):
    """The CPU thread governor lowers the threads while other processes take CPUs, through
    ``set_op_threads``: a second graph in the middle of serving (a compile, paid by a request)
    is never made for it, and torch's own count is put back after every op. Tokens stay
    transformers'."""
    from engine.model.cpu.op_threads import get_op_threads, set_op_threads

    monkeypatch.setenv("GLASSBOX_TORCH_COMPILE", "1")
    path = checkpoints["llama"]
    runner = make_runner(path)
    graph_threads = torch.get_num_threads()
    driver = Driver(runner)
    driver.add("a", prompt(30, 9))
    driver.add("b", prompt(31, 14))
    try:
        driver.step({"a": 9, "b": 14})
        set_op_threads(1)
        assert get_op_threads() == 1
        driver.decode(["a", "b"], steps=3)
        assert torch.get_num_threads() == graph_threads  # put back after every op
        set_op_threads(graph_threads + 1)
        driver.decode(["a", "b"], steps=3)
    finally:
        set_op_threads(None)
    assert_matches_hf(path, driver, ["a", "b"])
    assert runner.compiled is not None and runner.compiled.num_graphs == 1


@pytest.mark.parametrize("arch", ARCHS)
def test_prefix_cache_hit_reuses_blocks_of_an_earlier_request(checkpoints, arch):
    path = checkpoints[arch]
    driver = Driver(make_runner(path))
    first = prompt(20, 21)
    driver.add("first", first)
    driver.step({"first": 21})
    driver.decode(["first"], steps=3)
    # "second" shares first's two full blocks (16 tokens): only its tail is computed.
    second = first[:16] + prompt(21, 6)
    driver.add("second", second, cached_blocks=driver.reqs["first"].blocks[:2], num_cached=16)
    driver.step({"first": 1, "second": 6})
    driver.decode(["first", "second"], steps=8)
    assert_matches_hf(path, driver, ["first", "second"])


@pytest.mark.parametrize("arch", ARCHS)
def test_preempted_request_resumes_with_replaced_blocks(checkpoints, arch):
    path = checkpoints[arch]
    driver = Driver(make_runner(path))
    driver.add("victim", prompt(30, 13))
    driver.add("other", prompt(31, 9))
    driver.step({"victim": 13, "other": 9})
    driver.decode(["victim", "other"], steps=4)
    old_blocks = list(driver.reqs["victim"].blocks)
    driver.preempt("victim")
    # "intruder" takes the freed blocks and keeps writing into them while the victim
    # resumes: a runner that kept the victim's old block ids would corrupt both.
    driver.add("intruder", prompt(32, 20))
    driver.step({"other": 1, "intruder": 20})
    assert driver.reqs["intruder"].blocks[:3] == old_blocks
    # The victim recomputes prompt + 5 outputs (18 tokens) in two chunks, into new blocks.
    driver.step({"other": 1, "intruder": 1, "victim": 10})
    driver.step({"other": 1, "intruder": 1, "victim": 8})
    assert not set(driver.reqs["victim"].blocks) & set(old_blocks)
    driver.decode(["victim", "other", "intruder"], steps=5)
    assert len(driver.reqs["victim"].output) == 11
    assert_matches_hf(path, driver, ["victim", "other", "intruder"])


def test_bfloat16_run_picks_tokens_transformers_rates_near_best(checkpoints):
    path = checkpoints["qwen2"]
    driver = Driver(make_runner(path, dtype=torch.bfloat16))
    assert driver.runner.kv_caches[0][0].dtype == torch.bfloat16
    prompts = {f"p{i}": prompt(40 + i, n) for i, n in enumerate((4, 11, 19))}
    for req_id, ids in prompts.items():
        driver.add(req_id, ids)
    driver.step({r: len(p) for r, p in prompts.items()})
    for req_id, ids in prompts.items():
        logprobs = hf_logits(path, ids)[-1].log_softmax(-1)
        picked = driver.reqs[req_id].output[0]
        # bf16 may flip a near-tie, never pick a token float32 finds unlikely.
        assert logprobs[picked] >= logprobs.max() - 1.0


# ---------------------------------------------------------------------------- sampling


def test_seeded_sampling_repeats_whatever_the_batch(checkpoints):
    path = checkpoints["llama"]
    hot = dict(temperature=3.0, max_tokens=64, ignore_eos=True)  # flat enough to vary
    ids = prompt(50, 9)

    driver = Driver(make_runner(path))
    driver.add("s1", ids, SamplingParams(seed=7, **hot))
    driver.add("s2", ids, SamplingParams(seed=7, **hot))
    driver.add("s3", ids, SamplingParams(seed=8, **hot))
    driver.step({"s1": 9, "s2": 9, "s3": 9})
    driver.decode(["s1", "s2", "s3"], steps=15)
    s1, s2, s3 = (driver.reqs[r].output for r in ("s1", "s2", "s3"))
    assert s1 == s2
    assert s1 != s3

    alone = Driver(make_runner(path))  # a different runner, and no batch mates
    alone.add("solo", ids, SamplingParams(seed=7, **hot))
    alone.step({"solo": 9})
    alone.decode(["solo"], steps=15)
    assert alone.reqs["solo"].output == s1


def test_logprobs_and_prompt_logprobs_match_transformers(checkpoints):
    path = checkpoints["qwen3"]
    driver = Driver(make_runner(path))
    ids = prompt(60, 14)
    driver.add("r", ids, SamplingParams(temperature=0.0, logprobs=3, prompt_logprobs=2, ignore_eos=True))
    first = driver.step({"r": 6})  # prompt logprobs arrive a chunk at a time
    second = driver.step({"r": 8})
    assert "r" not in first.logprobs  # nothing sampled yet

    rows = first.prompt_logprobs_dict["r"].logprobs + second.prompt_logprobs_dict["r"].logprobs
    row_ids = (
        first.prompt_logprobs_dict["r"].logprob_token_ids + second.prompt_logprobs_dict["r"].logprob_token_ids
    )
    assert len(rows) == len(ids) - 1  # position 0 has no logprob
    reference = hf_logits(path, ids).log_softmax(-1)  # (14, vocab)
    for k, (row, row_tokens) in enumerate(zip(rows, row_ids)):
        assert len(row) == 3 and row_tokens[0] == ids[k + 1]
        assert row[0] == pytest.approx(reference[k, ids[k + 1]].item(), abs=1e-4)
        assert row_tokens[1:] == reference[k].topk(2).indices.tolist()

    sampled = second.sampled_token_ids[second.req_id_to_index["r"]][0]
    lp = second.logprobs["r"]
    assert len(lp.logprob_token_ids) == 1 and len(lp.logprob_token_ids[0]) == 4
    assert lp.logprob_token_ids[0][0] == sampled
    assert lp.logprobs[0][0] == pytest.approx(reference[-1, sampled].item(), abs=1e-4)
    assert lp.logprob_token_ids[0][1:] == reference[-1].topk(3).indices.tolist()
    assert lp.ranks == [1]  # greedy picks the best token


def test_grammar_bitmask_masks_only_its_own_rows_before_sampling(checkpoints):
    # Two greedy requests; the grammar of "so" allows two tokens, neither its greedy pick:
    # it samples the better of the two, and "free" samples what transformers does.
    path = checkpoints["llama"]
    driver = Driver(make_runner(path))
    ids = prompt(1, 12)
    logits = hf_logits(path, ids)[-1]  # (vocab,) the last position's
    best = int(logits.argmax())
    ranked = [int(t) for t in logits.argsort(descending=True)]
    allowed = [ranked[5], ranked[9]]
    driver.add("so", ids)
    driver.add("free", prompt(2, 9))
    driver.step({"so": 12, "free": 9}, allowed={"so": allowed})
    assert driver.reqs["so"].output == [ranked[5]] != [best]
    assert_matches_hf(path, driver, ["free"])


def test_apply_grammar_bitmask_on_hand_made_logits():
    vocab = 40  # not a multiple of 32: the row has two words, the last one partly past the vocabulary
    logits = torch.arange(3 * vocab, dtype=torch.float32).reshape(3, vocab)
    so = SchedulerOutput(scheduled_new_reqs=[], scheduled_cached_reqs=CachedRequestData(),
                         num_scheduled_tokens={}, total_num_scheduled_tokens=0, finished_req_ids=set(),
                         structured_output_request_ids=["b", "a"],
                         grammar_bitmask=bitmask_of([[3, 33], [0, 39]], vocab).tobytes())  # fmt: skip
    apply_grammar_bitmask(so, ["a", "plain", "b"], logits)
    finite = [sorted(torch.isfinite(row).nonzero().flatten().tolist()) for row in logits]
    assert finite == [[0, 39], list(range(vocab)), [3, 33]]
    assert logits[2, 33] == 2 * vocab + 33  # allowed logits are left as they were


def _meta(params, outputs=None, prompts=None, generators=None, vocab=6):
    n = len(params)
    return SamplingMetadata.build(
        params,
        prompts or [[] for _ in range(n)],
        outputs or [[] for _ in range(n)],
        generators or [None] * n,
        [EOS] * n,
        vocab,
        torch.device("cpu"),
    )


def test_top_k_top_p_min_p_masks():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]] * 4))
    kept = apply_top_k_top_p(logits, torch.tensor([2, 4, 4, 1]), torch.tensor([1.0, 0.8, 0.81, 1.0]))
    assert (kept > float("-inf")).tolist() == [
        [True, True, False, False],  # top-k 2
        [True, True, False, False],  # top-p 0.8: 0.5 + 0.3 reaches it
        [True, True, True, False],  # top-p 0.81 needs the third token
        [True, False, False, False],  # top-k 1
    ]
    # min-p 0.25: tokens below 0.25 * 0.5 are out; sampling never picks them.
    params = [SamplingParams(temperature=1.0, min_p=0.25, seed=s) for s in range(64)]
    gens = [torch.Generator().manual_seed(s) for s in range(64)]
    picks = Sampler()(
        logits[:1].expand(64, 4).clone(), _meta(params, generators=gens, vocab=4)
    ).sampled_token_ids
    assert set(picks.tolist()) == {0, 1, 2}


def test_penalties_follow_vllm_rules():
    logits = torch.tensor([[3.0, -2.0, 2.0, 0.5, 0.0, 0.0]])
    rep = SamplingParams(temperature=0.0, repetition_penalty=2.0)
    # Token 0 is in the prompt: 3.0 / 2 = 1.5 falls below token 2, which greedy now picks.
    out = Sampler()(logits.clone(), _meta([rep], outputs=[[1]], prompts=[[0]]))
    assert out.sampled_token_ids.tolist() == [2]

    meta = _meta(
        [
            SamplingParams(
                temperature=0.0, repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.3
            )
        ],
        outputs=[[1, 3, 3]],
        prompts=[[0]],
    )
    penalised = apply_penalties(logits.clone(), meta)[0].tolist()
    # repetition: positive logits divided, negative multiplied (prompt and output tokens);
    # frequency: 0.5 per output occurrence; presence: 0.3 once per output token.
    assert penalised == pytest.approx([1.5, -4.0 - 0.5 - 0.3, 2.0, 0.25 - 1.0 - 0.3, 0.0, 0.0])


def test_min_tokens_blocks_stop_tokens_until_reached():
    logits = torch.tensor([[0.0, 1.0, 5.0, 0.0, 4.0, 0.0]])  # EOS (2) is the argmax, 4 next
    params = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[4])
    early = Sampler()(logits.clone(), _meta([params], outputs=[[1]]))
    assert early.sampled_token_ids.tolist() == [1]  # neither EOS nor the stop id 4
    done = Sampler()(logits.clone(), _meta([params], outputs=[[1, 1]]))
    assert done.sampled_token_ids.tolist() == [2]


def test_greedy_rows_ignore_the_random_path_and_logprobs_rank():
    logits = torch.tensor([[0.0, 3.0, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0], [5.0, 0.0, 0.0, 4.9]])
    params = [
        SamplingParams(temperature=0.0, logprobs=2),
        SamplingParams(temperature=1.0, top_k=1, logprobs=0),  # top-k 1: the random path is forced
        SamplingParams(temperature=0.0),
    ]
    out = Sampler()(logits.clone(), _meta(params, vocab=4))
    assert out.sampled_token_ids.tolist() == [1, 0, 0]
    lp = out.logprobs_tensors
    raw = logits.log_softmax(-1)
    assert lp.token_ids[0].tolist() == [1, 1, 2]  # sampled first, then the top 2
    assert lp.logprobs[0, 0].item() == pytest.approx(raw[0, 1].item())
    assert lp.ranks.tolist() == [1, 4, 1]  # all four entries of row 1 tie: rank counts them


# ---------------------------------------------------------------------------- loader, rope


def test_loader_names_missing_weights(checkpoints, tmp_path):
    import shutil

    shutil.copytree(checkpoints["qwen2"], tmp_path / "m")
    weights = load_file(tmp_path / "m" / "model.safetensors")
    del weights["model.layers.1.self_attn.k_proj.bias"]
    del weights["lm_head.weight"]
    save_file(weights, tmp_path / "m" / "model.safetensors")
    with pytest.raises(
        ValueError,
        match=r"missing 2 weight\(s\): lm_head\.weight, model\.layers\.1\.self_attn\.qkv_proj\.bias \(from q_proj/k_proj/v_proj\)",
    ):
        load_model(ModelConfig(model=str(tmp_path / "m")), torch.device("cpu"), torch.float32)


def test_resolve_dtype_rules():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_dtype("auto", "float16", cpu) == torch.bfloat16
    assert resolve_dtype("auto", "float16", cuda) == torch.float16
    assert resolve_dtype("auto", "float32", cuda) == torch.float32
    assert resolve_dtype("auto", "bfloat16", cpu) == torch.bfloat16
    assert resolve_dtype("float32", "bfloat16", cpu) == torch.float32


@pytest.mark.parametrize("rope_type", ["default", "linear", "llama3"])
def test_rope_parameters_in_both_config_formats_match_transformers(rope_type):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    scaling = {"linear": {"factor": 4.0}, "llama3": dict(LLAMA3_ROPE)}.get(rope_type, {})
    scaling.pop("rope_theta", None)
    v5 = {
        "rope_parameters": {"rope_type": rope_type, "rope_theta": 5e5, **scaling},
        "max_position_embeddings": 4096,
    }
    v4 = {"rope_theta": 5e5, "max_position_embeddings": 4096}
    if scaling:
        v4["rope_scaling"] = {"type": rope_type, **scaling}  # the oldest spelling
    ours_v5 = compute_inv_freq(64, rope_parameters_from_config(v5))
    ours_v4 = compute_inv_freq(64, rope_parameters_from_config(v4))
    hf_config = LlamaConfig(hidden_size=256, num_attention_heads=4, **v5)
    if rope_type == "default":
        expected = 1.0 / (5e5 ** (torch.arange(0, 64, 2).float() / 64))
    else:
        expected, _ = ROPE_INIT_FUNCTIONS[rope_type](hf_config, "cpu")
    torch.testing.assert_close(ours_v5, expected)
    torch.testing.assert_close(ours_v4, expected)


def test_unknown_attention_backend_names_the_flag(checkpoints):
    from engine.config import ConfigError

    with pytest.raises(ConfigError, match="--attention-backend.*TORCH_SDPA, PAGED_INDUCTOR, CPU_PAGED_CPP"):
        ModelConfig(model=checkpoints["llama"], attention_backend="FLASH_ATTN")
    assert ModelConfig(model=checkpoints["llama"]).attention_backend is None  # the worker chooses


def test_paged_decode_kernel_equals_the_gather_and_compiles_once_for_every_batch():
    """PAGED_INDUCTOR's kernel against TORCH_SDPA's gather + SDPA on a scattered cache, for
    batches of 1 to 9 decodes of different lengths: same outputs,
    and no new graph after the first batch (a batch of one decode included)."""
    from torch._dynamo.utils import counters

    from engine.model.attention import Attention, AttentionMetadata
    from engine.model.attention_selector import set_attention_backend

    torch.manual_seed(0)
    bs, heads, kv_heads, dim, blocks = 4, 4, 2, 8, 64
    k_cache, v_cache = torch.randn(blocks, bs, kv_heads, dim), torch.randn(blocks, bs, kv_heads, dim)
    reference, paged = Attention(heads, dim, kv_heads, dim**-0.5), Attention(heads, dim, kv_heads, dim**-0.5)
    set_attention_backend([paged], "PAGED_INDUCTOR")
    graphs = []
    for nd, lens in ((3, (9, 2, 14)), (1, (5,)), (9, (1, 3, 8, 13, 16, 7, 2, 11, 4))):
        order = torch.randperm(blocks - 1) + 1  # pages anywhere in the cache
        table = order[: nd * 4].view(nd, 4).int()
        seq_lens = torch.tensor(lens, dtype=torch.int32)
        pos = torch.arange(max(lens))
        slots = table.long()[:, pos // bs] * bs + pos % bs
        meta = AttentionMetadata(
            num_reqs=nd, num_decodes=nd, slot_mapping=torch.zeros(0, dtype=torch.long),
            query_start_loc=torch.arange(nd + 1, dtype=torch.int32), seq_lens=seq_lens, block_table=table,
            query_start_loc_cpu=list(range(nd + 1)), seq_lens_cpu=list(lens),
            num_computed_tokens_cpu=[n - 1 for n in lens], max_decode_seq_len=max(lens), block_size=bs,
            decode_slots=slots,
        )  # fmt: skip
        q = torch.randn(nd, heads, dim)
        with torch.inference_mode():
            none = torch.empty(0, kv_heads, dim)  # no new K/V to write: the cache holds them all
            expected = reference.impl.forward(q, none, none, (k_cache, v_cache), meta)
            got = paged.impl.decode_kernel(q, k_cache, v_cache, slots, seq_lens, paged.scale, None)
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
        graphs.append(counters["stats"]["unique_graphs"])
    assert graphs[1] == graphs[2] == graphs[0], f"recompiled for a new batch shape: {graphs}"


def test_every_attention_backend_name_selects_the_backend_of_that_name():
    from engine.config import ATTENTION_BACKENDS
    from engine.model.attention_selector import get_attn_backend

    assert [get_attn_backend(name).get_name() for name in ATTENTION_BACKENDS] == list(ATTENTION_BACKENDS)
    with pytest.raises(ValueError, match="FLASH_ATTN.*choose one of TORCH_SDPA"):
        get_attn_backend("FLASH_ATTN")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_weights_are_packed_for_onednn_and_give_the_same_products(checkpoints, dtype):
    from engine.model.layers import ColumnParallelLinear, RowParallelLinear

    if not torch.backends.mkldnn.is_available():
        pytest.skip("this torch build has no oneDNN")
    if dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        pytest.skip("this CPU has no bfloat16 matmul in oneDNN")
    model = load_model(ModelConfig(model=checkpoints["qwen2"]), torch.device("cpu"), dtype)
    linears = [m for m in model.modules() if isinstance(m, (ColumnParallelLinear, RowParallelLinear))]
    assert linears and all(m.packed_weight is not None for m in linears + [model.lm_head])
    x = torch.randn(5, model.lm_head.weight.shape[1], dtype=dtype)
    with torch.inference_mode():
        got = model.lm_head.linear_method.apply(model.lm_head, x)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, torch.nn.functional.linear(x, model.lm_head.weight), atol=tol, rtol=tol)


@pytest.mark.parametrize("mode", ["native", "upcast"])
def test_bf16_linears_forced_native_or_upcast_compute_the_same_bfloat16_product(
    checkpoints, monkeypatch, mode
):
    """--cpu-bf16-linear upcast multiplies the upcast weight in float32, native runs oneDNN's
    bfloat16 kernel: the same math (bfloat16 operands, float32 sums, one rounding), so either
    product is the exact one rounded to bfloat16; only upcast keeps float32 copies."""
    from engine.model.cpu import linear as cpu_linear

    if not torch.backends.mkldnn.is_available() or not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        pytest.skip("this CPU has no bfloat16 matmul in oneDNN")
    model = load_model(
        ModelConfig(model=checkpoints["qwen2"], cpu_bf16_linear=mode), torch.device("cpu"), torch.bfloat16
    )
    qkv = model.model.layers[0].self_attn.qkv_proj  # Qwen2's has a bias
    upcast = mode == "upcast"
    assert qkv.bias is not None and (qkv.packed_weight_f32 is not None) == upcast
    assert (model.lm_head.packed_weight_f32 is not None) == upcast
    linear = [(v.choice, v.source) for v in model.measured_choices if v.name == "bf16_linear"]
    assert linear == [(mode, "forced by --cpu-bf16-linear")]
    for rows in (1, 3, 64, 101):
        x = torch.randn(rows, qkv.weight.shape[1], dtype=torch.bfloat16)
        with torch.inference_mode():
            got = qkv(x)
        exact = (x.double() @ qkv.weight.double().T + qkv.bias.double()).float()
        # One rounding of a float32 sum: within a bfloat16 step (2^-8 relative) of the exact value.
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got.float(), exact, atol=1e-2, rtol=2**-8)
    if upcast:  # a big model on a small machine: no float32 copies, the bfloat16 kernel serves
        monkeypatch.setattr(cpu_linear, "F32_COPIES_MAX_SHARE", 1e-12)
        cfg = ModelConfig(model=checkpoints["qwen2"], cpu_bf16_linear="upcast")
        tight = load_model(cfg, torch.device("cpu"), torch.bfloat16)
        assert tight.lm_head.packed_weight is not None and tight.lm_head.packed_weight_f32 is None
        assert tight.measured_choices[0].choice == "native"
        assert "no memory for float32 copies" in tight.measured_choices[0].source


def test_paged_inductor_with_enforce_eager_or_without_a_compiler_is_one_clear_error(checkpoints, monkeypatch):
    from engine.config import ConfigError
    from engine.worker.model_runner import _check_inductor_can_compile

    with pytest.raises(ConfigError, match="--attention-backend.*--enforce-eager.*TORCH_SDPA"):
        ModelConfig(model=checkpoints["llama"], attention_backend="PAGED_INDUCTOR", enforce_eager=True)
    monkeypatch.setenv("CXX", "/nonexistent/g++")
    with pytest.raises(RuntimeError, match="C\\+\\+ compiler.*--attention-backend TORCH_SDPA"):
        _check_inductor_can_compile(torch.device("cpu"))


def test_default_attention_backend_is_the_cpp_kernel_on_a_cpu_else_sdpa_with_a_warning(
    checkpoints, monkeypatch, caplog
):
    """No --attention-backend: a CPU worker takes the C++ paged kernel when it builds, and
    says why when it falls back to TORCH_SDPA (here: no C++ compiler)."""
    runner = make_runner(checkpoints["llama"], attention_backend=None)
    assert runner.attention_backend == "CPU_PAGED_CPP"
    assert {layer.backend.get_name() for layer in runner.attention_layers} == {"CPU_PAGED_CPP"}
    from engine.model.cpu import paged_attention_cpu

    monkeypatch.setattr(paged_attention_cpu, "_lib", None)  # as in a fresh worker process
    monkeypatch.setenv("CXX", "/nonexistent/g++")
    with caplog.at_level("WARNING"):
        runner = make_runner(checkpoints["llama"], attention_backend=None)
    assert runner.attention_backend == "TORCH_SDPA"
    assert "CPU_PAGED_CPP" in caplog.text and "/nonexistent/g++" in caplog.text


_GENERATE_COMPILED = """
import json, sys
from engine import LLM, SamplingParams
llm = LLM(sys.argv[1], max_model_len=128)
out = llm.generate([{"prompt_token_ids": list(range(3, 20))}], SamplingParams(temperature=0, max_tokens=8,
                   ignore_eos=True), use_tqdm=False)
print(json.dumps(out[0].outputs[0].token_ids))
"""


def test_a_compiler_that_does_not_work_falls_back_to_eager_and_says_why(tiny_dir, tmp_path):
    """A fresh user's find: with a C++ compiler on PATH that fails (here /usr/bin/false), the
    compile crashed the worker; now the C++ kernel and torch.compile each fall back (to
    TORCH_SDPA, to eager) with a warning, and the tokens are still transformers'."""
    import json
    import os
    import subprocess
    import sys

    env = {**os.environ, "CXX": "/usr/bin/false", "GLASSBOX_TORCH_COMPILE": "1",
           "GLASSBOX_ENABLE_MULTIPROCESSING": "0", "GLASSBOX_CACHE_ROOT": str(tmp_path / "cache")}  # fmt: skip
    path = str(tiny_dir("llama"))  # with a tokenizer, for LLM
    done = subprocess.run([sys.executable, "-c", _GENERATE_COMPILED, path], env=env,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "torch.compile failed, running the model eagerly" in done.stderr
    assert (
        "attention backend TORCH_SDPA: the C++ paged kernel (CPU_PAGED_CPP) is not available" in done.stderr
    )
    tokens = json.loads(done.stdout.strip().splitlines()[-1])
    assert tokens == hf_greedy(path, list(range(3, 20)), 8)


@pytest.mark.parametrize("huge", ["1", "0"])
def test_kv_cache_on_huge_pages_or_not_is_one_cache_per_layer_and_gives_transformers_greedy(
    checkpoints, huge, monkeypatch
):
    monkeypatch.setenv("GLASSBOX_CPU_KV_HUGE_PAGES", huge)
    path = checkpoints["llama"]
    runner = make_runner(path, attention_backend="CPU_PAGED_CPP")
    spans = sorted(
        (t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for kv in runner.kv_caches for t in kv
    )
    assert len(spans) == 2 * runner.get_kv_cache_spec().num_layers
    assert all(end <= nxt for (_, end), (nxt, _) in zip(spans, spans[1:])), "two layers share KV memory"
    if huge == "0":
        assert runner.kv_cache_pages == "4 KiB pages (GLASSBOX_CPU_KV_HUGE_PAGES=0)"
    else:  # the tiny model's cache is smaller than one huge page
        assert runner.kv_cache_pages == "4 KiB pages (the cache is under 2 MiB)"
        thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
        if thp.exists() and ("[always]" in thp.read_text() or "[madvise]" in thp.read_text()):
            spec = runner.get_kv_cache_spec()  # a cache of 8 MiB: Linux backs it with 2 MiB pages
            big = KVCacheConfig(num_blocks=8 * 2**20 // spec.bytes_per_block, spec=spec)
            runner.initialize_kv_cache(big)
            assert runner.kv_cache_pages.startswith("2 MiB pages"), runner.kv_cache_pages
            runner.initialize_kv_cache(KVCacheConfig(num_blocks=NUM_BLOCKS, spec=spec))
    driver = Driver(runner)
    lengths = {"a": 9, "b": 21}
    for i, (req_id, n) in enumerate(lengths.items()):
        driver.add(req_id, prompt(i, n))
    driver.step(dict(lengths))
    driver.decode(list(lengths), steps=8)
    assert_matches_hf(path, driver, lengths)
