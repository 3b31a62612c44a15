"""Offline throughput: Glassbox's ``LLM.generate`` against transformers' static batching.

The workload follows nano-vllm's and vLLM's offline benchmark, scaled to a CPU: by default
32 prompts of random token ids, input lengths uniform in 32–512, output lengths uniform in
32–256, greedy, EOS ignored. Both engines run it in the same process on the same "small"
random Llama (hidden 512, 8 layers, 8 heads, 4 KV heads, vocab 8192), built here with
transformers; ``--model-size 0.5b`` builds one shaped like Qwen2.5-0.5B instead (hidden 896,
24 layers, 14 heads, 2 KV heads, intermediate 4864; vocab 8192 as the small one, so the
prompts are the same: ~372 M parameters, random weights, nothing downloaded). It prints output tokens/s for each (median of ``--runs`` runs), their ratio,
and the share of engine step time spent inside the model forward.

    .venv/bin/python benchmarks/offline_throughput.py                    # float32 and bfloat16
    .venv/bin/python benchmarks/offline_throughput.py --dtype float32 --num-prompts 8 --runs 1
    .venv/bin/python benchmarks/offline_throughput.py --model-size 0.5b --skip-transformers

transformers runs in static batches of ``--hf-batch-size`` prompts, left-padded; each
batch generates as many tokens as its longest requested output, but only the requested
tokens count as output (that is what a user would get).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

SMALL = dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=8, num_attention_heads=8,
             num_key_value_heads=4, vocab_size=8192, max_position_embeddings=1024)  # fmt: skip
# Qwen2.5-0.5B's shape (without its q/k/v biases and its 151936-token vocabulary): a random
# Llama of about 372 M parameters, untied embeddings, on the small one's vocabulary.
QWEN_0_5B = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2, vocab_size=8192, max_position_embeddings=1024)  # fmt: skip
MODEL_SIZES = {"small": SMALL, "0.5b": QWEN_0_5B}


def describe_model(shape: dict) -> str:
    """The model part of a workload's description (vs_vllm.py's and roofline.py's)."""
    return (f"random Llama hidden {shape['hidden_size']}, {shape['num_hidden_layers']} layers, "
            f"{shape['num_attention_heads']} heads, {shape['num_key_value_heads']} KV heads, "
            f"intermediate {shape['intermediate_size']}, vocab {shape['vocab_size']}")  # fmt: skip


def build_small_model(path: Path, shape: dict = SMALL) -> Path:
    """A random Llama of ``shape`` (the benchmark's "small" one by default), saved with the
    bundled tokenizer files."""
    import shutil

    from transformers import LlamaConfig, LlamaForCausalLM

    from engine.config import DEFAULT_MODEL

    torch.manual_seed(0)
    config = LlamaConfig(**shape, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    LlamaForCausalLM(config).to(torch.float32).save_pretrained(path, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        src = Path(DEFAULT_MODEL) / name
        if src.exists():
            shutil.copy(src, path / name)
    return path


def make_workload(n: int, seed: int, in_range: tuple[int, int], out_range: tuple[int, int]):
    rng = random.Random(seed)
    prompts = [
        [rng.randrange(3, SMALL["vocab_size"]) for _ in range(rng.randint(*in_range))] for _ in range(n)
    ]
    outputs = [rng.randint(*out_range) for _ in range(n)]
    return prompts, outputs


def run_transformers(path: Path, prompts, out_lens, dtype: torch.dtype, batch_size: int) -> float:
    """Seconds for static batched greedy generation of the whole workload."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(path, dtype=dtype).eval()
    start = time.perf_counter()
    for i in range(0, len(prompts), batch_size):
        batch, lens = prompts[i : i + batch_size], out_lens[i : i + batch_size]
        width = max(len(p) for p in batch)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        with torch.inference_mode():
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max(lens), min_new_tokens=max(lens),
                           do_sample=False, pad_token_id=0)  # fmt: skip
    return time.perf_counter() - start


class StepTimer:
    """Time spent in ``EngineCore.step`` and, inside it, in the model forward (+ logits).

    The forward is timed around the model runner's ``_run_model`` (the call of the compiled
    callable, or of the eager model), never inside the module's ``forward``: torch.compile
    traces that, and cannot trace ``time.perf_counter``."""

    def __init__(self, llm) -> None:
        core = llm.engine_core.engine_core
        runner = core.model_executor.driver_worker.worker.model_runner
        self.step_s = 0.0
        self.forward_s = 0.0
        step, forward, logits = core.step, runner._run_model, runner.model.compute_logits

        def timed_step():
            t = time.perf_counter()
            try:
                return step()
            finally:
                self.step_s += time.perf_counter() - t

        def timed(fn):
            def wrapper(*a, **k):
                t = time.perf_counter()
                try:
                    return fn(*a, **k)
                finally:
                    self.forward_s += time.perf_counter() - t

            return wrapper

        core.step = timed_step
        runner._run_model = timed(forward)
        runner.model.compute_logits = timed(logits)


def run_glassbox(llm, prompts, out_lens) -> tuple[float, float]:
    """Seconds for the whole workload through ``LLM.generate``, and the forward share of step time."""
    from engine import SamplingParams

    params = [
        SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, detokenize=False) for n in out_lens
    ]
    timer = StepTimer(llm)
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    assert [len(o.outputs[0].token_ids) for o in outs] == out_lens
    return elapsed, timer.forward_s / max(timer.step_s, 1e-9)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--input-len", type=int, nargs=2, default=(32, 512))
    ap.add_argument("--output-len", type=int, nargs=2, default=(32, 256))
    ap.add_argument("--dtype", choices=("float32", "bfloat16", "both"), default="both")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--hf-batch-size", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model-size", choices=sorted(MODEL_SIZES), default="small",
                    help="small: hidden 512, 8 layers; 0.5b: Qwen2.5-0.5B's shape (~372 M parameters)")  # fmt: skip
    ap.add_argument("--skip-transformers", action="store_true")
    args = ap.parse_args()

    # In-process (InprocClient): the step timer wraps the engine core and the model directly.
    # benchmarks/process_tree_overhead.py measures what the process tree adds.
    os.environ["GLASSBOX_ENABLE_MULTIPROCESSING"] = "0"
    from engine import LLM

    prompts, out_lens = make_workload(
        args.num_prompts, args.seed, tuple(args.input_len), tuple(args.output_len)
    )
    total_out = sum(out_lens)
    dtypes = ["float32", "bfloat16"] if args.dtype == "both" else [args.dtype]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        path = build_small_model(Path(tmp) / args.model_size, MODEL_SIZES[args.model_size])
        for dtype in dtypes:
            hf_times, gb_times, shares = [], [], []
            with LLM(str(path), dtype=dtype, max_model_len=1024) as llm:
                run_glassbox(llm, prompts[:2], [4, 4])  # warm the allocator
                for _ in range(args.runs):
                    elapsed, share = run_glassbox(llm, prompts, out_lens)
                    gb_times.append(elapsed)
                    shares.append(share)
            if not args.skip_transformers:
                for _ in range(args.runs):
                    hf_times.append(
                        run_transformers(path, prompts, out_lens, getattr(torch, dtype), args.hf_batch_size)
                    )
            gb = total_out / statistics.median(gb_times)
            hf = total_out / statistics.median(hf_times) if hf_times else float("nan")
            rows.append((dtype, hf, gb, gb / hf if hf_times else float("nan"), statistics.median(shares)))

    print(f"\nworkload: {args.num_prompts} prompts, input {args.input_len[0]}-{args.input_len[1]}, "
          f"output {args.output_len[0]}-{args.output_len[1]} tokens ({total_out} output tokens), "
          f"median of {args.runs} runs, torch threads {torch.get_num_threads()}; "
          f"model: {describe_model(MODEL_SIZES[args.model_size])}")  # fmt: skip
    print(f"{'dtype':<10}{'transformers tok/s':>20}{'glassbox tok/s':>17}{'ratio':>8}{'forward share':>15}")
    for dtype, hf, gb, ratio, share in rows:
        print(f"{dtype:<10}{hf:>20.1f}{gb:>17.1f}{ratio:>7.2f}x{share * 100:>14.1f}%")


if __name__ == "__main__":
    main()
