"""A model's bfloat16 linears at one row count: oneDNN's packed matmul against torch's brgemm micro-kernel.

What it measures: one pass over every linear of ``offline_throughput.py``'s "small" random
Llama (``--model-size 0.5b``: the one shaped like Qwen2.5-0.5B) — per layer q/k/v, o,
gate/up and down, plus the LM head, random bfloat16 weights — at each row count of
``--rows`` (the tokens of a step), through

- ``oneDNN``: ``torch.ops.mkldnn._linear_pointwise`` on the weight packed by
  ``torch.ops.mkldnn._reorder_linear_weight`` (what ``CPUPackedLinearMethod`` calls);
- ``brgemm``: ``brgemm_linear_cpu.brgemm_linear`` on the weight packed by
  ``brgemm_linear_cpu.pack_weight`` (``engine/model/cpu/csrc/brgemm_linear_cpu.cpp``).

For each row count, both sides' **first** pass is timed on its own — oneDNN compiles a
primitive for each new row count and weight shape there, the micro-kernel only for a row
count under 64 it has not met — then ``--repeats`` passes each, interleaved, and the
median (the **steady** state). The two sides are checked to agree first. The CPU (model
name; AVX-512, AVX512-BF16, AMX) and the load average before and after are printed.

    .venv/bin/python benchmarks/linear_kernels.py
    .venv/bin/python benchmarks/linear_kernels.py --rows 8 64 2048 --model-size 0.5b --repeats 9
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parent.parent), str(Path(__file__).resolve().parent)]

from offline_throughput import QWEN_0_5B, SMALL  # noqa: E402

from engine.model.cpu import brgemm_linear_cpu  # noqa: E402


def load_average() -> str:
    return "/".join(f"{x:.2f}" for x in os.getloadavg())


def cpu_text() -> str:
    """The CPU's model name and the flags that decide a bfloat16 matmul's speed."""
    name, flags = "unknown", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and name == "unknown":
                name = line.split(":", 1)[1].strip()
            elif line.startswith("flags") and not flags:
                flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    have = [label for flag, label in (("avx512f", "AVX-512"), ("avx512_bf16", "AVX512-BF16"), ("amx_tile", "AMX"))
            if flag in flags]  # fmt: skip
    return f"{name} ({', '.join(have) or 'no AVX-512'})"


def model_weights(shape: dict) -> list[torch.Tensor]:
    """The model's linear weights, (out, in), bfloat16, random, in the order a step meets them."""
    g = torch.Generator().manual_seed(0)
    h, inter = shape["hidden_size"], shape["intermediate_size"]
    head_dim = h // shape["num_attention_heads"]
    qkv = (shape["num_attention_heads"] + 2 * shape["num_key_value_heads"]) * head_dim
    per_layer = [(qkv, h), (h, h), (2 * inter, h), (h, inter)]
    shapes = per_layer * shape["num_hidden_layers"] + [(shape["vocab_size"], h)]
    return [(torch.randn(o, i, generator=g) * 0.05).bfloat16() for o, i in shapes]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[8, 32, 64, 128, 512, 2048])
    ap.add_argument("--model-size", choices=("small", "0.5b"), default="small")
    ap.add_argument("--repeats", type=int, default=5, help="steady-state passes of each side (median)")
    args = ap.parse_args()

    why = brgemm_linear_cpu.kernel_unavailable(torch.bfloat16)
    if why:
        sys.exit(f"the brgemm micro-kernel cannot run here: {why}")
    if not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        sys.exit("oneDNN has no bfloat16 matmul on this CPU")
    weights = model_weights(SMALL if args.model_size == "small" else QWEN_0_5B)
    onednn = [torch.ops.mkldnn._reorder_linear_weight(w, 32) for w in weights]
    brgemm = [brgemm_linear_cpu.pack_weight(w) for w in weights]

    def onednn_pass(inputs: dict[int, torch.Tensor]) -> None:
        for w, packed in zip(weights, onednn, strict=True):
            torch.ops.mkldnn._linear_pointwise(inputs[w.shape[1]], packed, None, "none", [], "")

    def brgemm_pass(inputs: dict[int, torch.Tensor]) -> None:
        for w, packed in zip(weights, brgemm, strict=True):
            brgemm_linear_cpu.brgemm_linear(inputs[w.shape[1]], packed, w.shape[0])

    x = torch.randn(3, weights[0].shape[1]).bfloat16()
    want = torch.ops.mkldnn._linear_pointwise(x, onednn[0], None, "none", [], "").float()
    got = brgemm_linear_cpu.brgemm_linear(x, brgemm[0], weights[0].shape[0]).float()
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)

    print(f"cpu: {cpu_text()}; {torch.get_num_threads()} torch threads; load average {load_average()}")
    print(f"model ({args.model_size}): {len(weights)} bfloat16 linears, "
          f"{sum(w.numel() for w in weights) * 2 / 2**20:.0f} MiB of weights; steady: median of {args.repeats}")  # fmt: skip
    print(
        "| rows | oneDNN first ms | brgemm first ms | oneDNN steady ms | brgemm steady ms | oneDNN ÷ brgemm, steady |"
    )
    print("|---|---|---|---|---|---|")
    with torch.inference_mode():
        for rows in args.rows:
            inputs = {k: torch.randn(rows, k).bfloat16() for k in {w.shape[1] for w in weights}}
            first = {}
            for name, fn in (("oneDNN", onednn_pass), ("brgemm", brgemm_pass)):
                t0 = time.perf_counter()
                fn(inputs)
                first[name] = time.perf_counter() - t0
            steady = {"oneDNN": [], "brgemm": []}
            for i in range(args.repeats):
                order = [("oneDNN", onednn_pass), ("brgemm", brgemm_pass)]
                for name, fn in order if i % 2 == 0 else order[::-1]:
                    t0 = time.perf_counter()
                    fn(inputs)
                    steady[name].append(time.perf_counter() - t0)
            o, b = statistics.median(steady["oneDNN"]), statistics.median(steady["brgemm"])
            print(f"| {rows} | {1e3 * first['oneDNN']:.2f} | {1e3 * first['brgemm']:.2f} | {1e3 * o:.2f} | "
                  f"{1e3 * b:.2f} | {o / b:.2f}× |", flush=True)  # fmt: skip
    print(f"load average after: {load_average()}")


if __name__ == "__main__":
    main()
