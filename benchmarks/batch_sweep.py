"""Out tok/s against batch size, Glassbox and the real vLLM beside the hardware's limit, and
where a Glassbox step's time goes at each batch size — as tables and as SVG pictures.

A throughput at one workload (``vs_vllm.py``) hides how an engine scales: a decode step of one
request reads every weight to make one token, a step of 64 makes 64 tokens from the same
read, and somewhere the arithmetic takes over from the memory. This script runs each engine
once per dtype (a fresh process each, interleaved over ``--runs``) and, in that one ``LLM``,
generates ``--batch-sizes`` requests at once — each ``--input-len`` random prompt tokens,
``--output-len`` greedy tokens, EOS ignored — one batch size after another, timing each:

    .venv/bin/python benchmarks/batch_sweep.py --vllm-python ~/vllm-cpu/.venv/bin/python \\
        --svg docs/pictures/batch-sweep.svg --phases-svg docs/pictures/step-phases.svg
    .venv/bin/python benchmarks/batch_sweep.py --batch-sizes 1 4 --runs 1 --dtype float32   # Glassbox only

**The limit** at each batch size is ``roofline.py``'s: this machine's multiply-add peak per
dtype and its read bandwidth (measured here, after the engines, all cores at once), and the
schedule of the batch (every prompt in the first steps, then one decode each per step) —
each step at whichever of FLOPs ÷ peak and bytes (weights once, plus the KV it reads) ÷
bandwidth binds. ``--no-limit`` skips the measurement.

**Phases** (Glassbox only, ``--phases``, on by default): one more Glassbox run per dtype with
``--collect-detailed-traces all`` and a span file; each batch size's steps are read back
from the engine's own spans and split into: ``schedule`` (``scheduler.schedule``),
``ipc`` (``executor.execute_model`` less the worker's ``worker.execute_model``: the
broadcast, the wake-up, the reply), ``inputs`` (the worker's step less forward and sampling:
state updates, input tensors), ``forward`` (``model_runner.forward``), ``sample``
(``model_runner.sample``), ``update`` (``scheduler.update_from_output``) and ``between``
(wall time between steps: outputs to the caller, the busy loop); milliseconds per step,
medians over the batch's decode steps. The traced run is slower (spans cost), so its times
are not the throughput runs'; its shares are what the picture shows.

Every figure comes with the CPU model, its flags that matter and the load average; on a
busy machine both engines lose alike (interleaved), but the limit is measured low.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(Path(__file__).resolve().parent)]

from offline_throughput import MODEL_SIZES, build_small_model, describe_model  # noqa: E402
from vs_vllm import (  # noqa: E402
    check_vllm_python,
    cpu_model,
    load_average,
    make_engines,
    parse_settings,
    parse_variant,
    positive_int,
    run_child_script,
)

RESULT = "BATCH_SWEEP_RESULT "
PHASES = ("schedule", "ipc", "inputs", "forward", "sample", "update", "between")
PHASE_COLOURS = {"schedule": "#8250df", "ipc": "#bf8700", "inputs": "#d4a72c", "forward": "#0969da",
                 "sample": "#1a7f37", "update": "#cf222e", "between": "#8c959f"}  # fmt: skip
ENGINE_COLOURS = ("#0969da", "#cf222e", "#1a7f37", "#8250df")

CHILD = r"""
import json, sys, time


def main():
    job = json.load(open(sys.argv[1]))
    if job["engine"] == "vllm":
        import vllm
        from vllm import LLM, SamplingParams

        version = vllm.__version__
        kwargs = dict(model=job["model"], dtype=job["dtype"], max_model_len=job["max_model_len"], seed=0)
    else:
        import engine
        from engine import LLM, SamplingParams

        version = engine.__version__
        kwargs = dict(model=job["model"], dtype=job["dtype"], max_model_len=job["max_model_len"])
        kwargs.update(job["llm_kwargs"])
    llm = LLM(**kwargs)
    prompts, out_len = job["prompts"], job["output_len"]

    def generate(n, max_tokens):
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)
        t = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts[:n]], [params] * n, use_tqdm=False)
        seconds = time.perf_counter() - t
        got = sum(len(o.outputs[0].token_ids) for o in outs)
        if got != n * max_tokens:
            sys.exit(f"batch {n}: {got} output tokens, expected {n * max_tokens}")
        return seconds

    generate(2, 4)  # warm-up
    sizes = []
    for n in job["batch_sizes"]:
        start_ns = time.time_ns()
        seconds = generate(n, out_len)
        sizes.append(dict(batch=n, seconds=seconds, tok_s=n * out_len / seconds, start_ns=start_ns,
                          end_ns=time.time_ns()))
    print("@RESULT@" + json.dumps(dict(engine=job["engine"], version=version, sizes=sizes)), flush=True)
    if job["engine"] != "vllm":
        llm.shutdown()


if __name__ == "__main__":
    main()
""".replace("@RESULT@", RESULT)


def run_child(engine, dtype: str, tag: str, work: Path, common: dict, timeout: float, extra: dict) -> dict:
    """One fresh process of ``engine`` over every batch size; its JSON result."""
    job = {**common, "engine": "vllm" if engine.is_vllm else "glassbox", "dtype": dtype,
           "llm_kwargs": {**engine.kwargs, **extra}}  # fmt: skip
    return run_child_script(
        engine.python, job, tag, work, engine.env, timeout, RESULT, f"{engine.name} ({dtype})"
    )[0]


# --- phases from the engine's own spans ----------------------------------------------------------


def step_phases(spans: list[dict], start_ns: int, end_ns: int) -> dict[str, float]:
    """Median milliseconds per decode step of each of ``PHASES``, over the ``engine_core.step``
    spans that start in ``[start_ns, end_ns)`` and schedule no prefill token; empty when none."""
    by_parent: dict[str, list[dict]] = {}
    for s in spans:
        by_parent.setdefault(s.get("parent_span_id") or "", []).append(s)

    def child(span: dict, name: str) -> dict | None:
        return next((c for c in by_parent.get(span["span_id"], []) if c["name"] == name), None)

    steps = sorted((s for s in spans if s["name"] == "engine_core.step" and start_ns <= s["start_ns"] < end_ns),
                   key=lambda s: s["start_ns"])  # fmt: skip
    rows: list[dict[str, float]] = []
    for i, step in enumerate(steps):
        a = step["attributes"]
        if a.get("glassbox.step.num_new_reqs", 0) or a.get("glassbox.step.num_scheduled_tokens") != a.get(
            "glassbox.step.num_cached_reqs"
        ):
            continue  # a prefill in it: not a decode step
        schedule, execute = child(step, "scheduler.schedule"), child(step, "executor.execute_model")
        update = child(step, "scheduler.update_from_output")
        worker = None
        if execute is not None:  # the worker's span is linked under the engine core's by trace context
            worker = next((w for w in spans if w["name"] == "worker.execute_model"
                           and w.get("parent_span_id") == execute["span_id"]), None)  # fmt: skip
        if None in (schedule, execute, update, worker) or i + 1 >= len(steps):
            continue
        forward, sample = child(worker, "model_runner.forward"), child(worker, "model_runner.sample")
        f = forward["duration_ms"] if forward else 0.0
        sm = sample["duration_ms"] if sample else 0.0
        rows.append({"schedule": schedule["duration_ms"], "ipc": execute["duration_ms"] - worker["duration_ms"],
                     "inputs": max(0.0, worker["duration_ms"] - f - sm), "forward": f, "sample": sm,
                     "update": update["duration_ms"],
                     "between": max(0.0, (steps[i + 1]["start_ns"] - step["end_ns"]) / 1e6)})  # fmt: skip
    if not rows:
        return {}
    return {p: statistics.median(r[p] for r in rows) for p in PHASES} | {"steps": float(len(rows))}


def read_spans(path: Path) -> list[dict]:
    spans = []
    for line in path.read_text().splitlines():
        try:
            spans.append(json.loads(line))
        except ValueError:
            continue
    return spans


# --- the limit ------------------------------------------------------------------------------------


def limit_tok_s(batch: int, input_len: int, output_len: int, shape: dict, dtype: str, flops_per_s: float,
                bytes_per_s: float) -> float:  # fmt: skip
    """``roofline.py``'s bound on out tok/s for ``batch`` requests of ``input_len`` → ``output_len``."""
    from roofline import DTYPE_BYTES, ModelCost, default_budget, lower_bound, schedule

    batched, seqs = default_budget()
    steps = schedule([input_len] * batch, [output_len] * batch, batched, seqs)
    cost = ModelCost.from_shape(shape)
    return lower_bound(
        steps, cost, DTYPE_BYTES[dtype], flops_per_s, bytes_per_s, batch * output_len
    ).out_tok_s


def measure_limits(repeats: int) -> tuple[dict[str, float], float, str]:
    """(FLOP/s per dtype at the instruction peak, or the matmul's where there is none; read
    bytes/s; how they were measured)."""
    from roofline import DTYPES, instruction_peaks, matmul_peak, read_bandwidth

    cores = sorted(os.sched_getaffinity(0))
    peaks = instruction_peaks(cores, repeats)
    flops, how = {}, []
    for d in DTYPES:
        if peaks[d] is not None:
            flops[d] = 2 * peaks[d].multiply_adds_per_s
            how.append(f"{d} {flops[d] / 1e9:.0f} GFLOP/s ({peaks[d].source})")
        else:
            flops[d] = 2 * matmul_peak(d, 2048, repeats)
            how.append(f"{d} {flops[d] / 1e9:.0f} GFLOP/s (a matmul's rate)")
    bandwidth = read_bandwidth(1024, repeats)
    how.append(f"read {bandwidth / 1e9:.1f} GB/s")
    return flops, bandwidth, "; ".join(how)


# --- pictures ------------------------------------------------------------------------------------


def _nice_max(value: float) -> tuple[float, float]:
    step = next(m * 10**k for k in range(-2, 12) for m in (1, 2, 5) if value / (m * 10**k) <= 6)
    return step, step * (int(value * 1.05 / step) + 1)


def draw_sweep_svg(series: dict[str, dict[int, float]], limits: dict[str, dict[int, float]], title: str,
                   subtitle: str) -> str:  # fmt: skip
    """Out tok/s against batch size (log scale across): a line per engine and dtype, the
    limit per dtype dashed."""
    import math

    from engine.utils.svg import MUTED, Canvas

    c = Canvas()
    left, top, w, h = 90, 92, 560, 320
    c.text(24, 28, title, size=15, bold=True)
    c.text(24, 48, subtitle, size=11, colour=MUTED)
    batches = sorted({b for s in series.values() for b in s} | {b for s in limits.values() for b in s})
    top_value = max([v for s in (*series.values(), *limits.values()) for v in s.values()] + [1.0])
    step, axis_max = _nice_max(top_value)
    lo, hi = (
        math.log2(batches[0]),
        math.log2(batches[-1]) if batches[-1] > batches[0] else math.log2(batches[0]) + 1,
    )

    def x(b: float) -> float:
        return left + (math.log2(b) - lo) / (hi - lo) * w

    def y(v: float) -> float:
        return top + h - v / axis_max * h

    t = 0.0
    while t <= axis_max + 1e-9:
        c.path([(left, y(t)), (left + w, y(t))], "#d0d7de", width=0.8, end=False)
        c.text(left - 8, y(t) + 4, f"{t:,.0f}", size=11, anchor="end", colour=MUTED)
        t += step
    for b in batches:
        c.text(x(b), top + h + 18, str(b), size=11, anchor="middle", colour=MUTED)
    c.text(
        left + w / 2, top + h + 38, "requests at once (batch size)", size=11, anchor="middle", colour=MUTED
    )
    c.text(left - 8, top - 18, "out tok/s", size=11, anchor="end", colour=MUTED)
    legend = []
    for i, (name, points) in enumerate(series.items()):
        colour = ENGINE_COLOURS[i % len(ENGINE_COLOURS)]
        pts = [(x(b), y(v)) for b, v in sorted(points.items())]
        c.path(pts, colour, width=2.2, end=False)
        for px, py in pts:
            c.rect(px - 3, py - 3, 6, 6, fill=colour, stroke="none")
        legend.append((name, colour, False))
    for name, points in limits.items():
        pts = [(x(b), y(v)) for b, v in sorted(points.items())]
        c.path(pts, "#57606a", width=1.6, dashed=True, end=False)
        legend.append((name, "#57606a", True))
    ly = top + 8
    for name, colour, dashed in legend:
        c.path(
            [(left + w + 20, ly - 4), (left + w + 44, ly - 4)], colour, width=2.2, dashed=dashed, end=False
        )
        c.text(left + w + 50, ly, name, size=11)
        ly += 18
    return c.render(title, subtitle, "benchmarks/batch_sweep.py")


def draw_phases_svg(phases: dict[str, dict[int, dict[str, float]]], title: str, subtitle: str) -> str:
    """A stacked bar per dtype and batch size: milliseconds of one decode step by phase."""
    from engine.utils.svg import MUTED, Canvas

    c = Canvas()
    left, top, h, bar_w, gap = 90, 92, 300, 34, 10
    c.text(24, 28, title, size=15, bold=True)
    c.text(24, 48, subtitle, size=11, colour=MUTED)
    bars = [(d, b, p) for d, per in phases.items() for b, p in sorted(per.items()) if p]
    top_value = max([sum(p[k] for k in PHASES) for _, _, p in bars] + [1.0])
    step, axis_max = _nice_max(top_value)
    width = len(bars) * (bar_w + gap) + 12 * len(phases)

    def y(v: float) -> float:
        return top + h - v / axis_max * h

    t = 0.0
    while t <= axis_max + 1e-9:
        c.path([(left, y(t)), (left + width, y(t))], "#d0d7de", width=0.8, end=False)
        c.text(left - 8, y(t) + 4, f"{t:g}", size=11, anchor="end", colour=MUTED)
        t += step
    c.text(24, top - 18, "ms per decode step", size=11, colour=MUTED)
    xpos, last_dtype = left + 6, None
    for dtype, batch, p in bars:
        if last_dtype is not None and dtype != last_dtype:
            xpos += 12
        if dtype != last_dtype:
            c.text(xpos, top + h + 36, dtype, size=12, bold=True)
        last_dtype = dtype
        base = 0.0
        for k in PHASES:
            v = p[k]
            if v > 0:
                c.rect(xpos, y(base + v), bar_w, y(base) - y(base + v), fill=PHASE_COLOURS[k], stroke="none")
            base += v
        c.text(xpos + bar_w / 2, y(base) - 5, f"{base:.1f}", size=10, anchor="middle")
        c.text(xpos + bar_w / 2, top + h + 16, str(batch), size=11, anchor="middle", colour=MUTED)
        xpos += bar_w + gap
    lx = left + width + 24
    for i, k in enumerate(reversed(PHASES)):
        c.rect(lx, top + i * 18, 12, 12, fill=PHASE_COLOURS[k], stroke="none")
        c.text(lx + 18, top + i * 18 + 10, k, size=11)
    c.text(left, top + h + 56, "bars: batch size (requests at once); stacked: a decode step's phases, medians",
           size=10, colour=MUTED)  # fmt: skip
    return c.render(title, subtitle, "benchmarks/batch_sweep.py")


# --- main -----------------------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch-sizes", type=positive_int, nargs="+", default=[1, 4, 16, 64])
    ap.add_argument("--input-len", type=positive_int, default=128)
    ap.add_argument("--output-len", type=positive_int, default=128)
    ap.add_argument("--dtype", choices=("float32", "bfloat16", "both"), default="both")
    ap.add_argument(
        "--runs", type=positive_int, default=2, help="runs per engine and dtype; figures are medians"
    )
    ap.add_argument("--model-size", choices=sorted(MODEL_SIZES), default="small")
    ap.add_argument(
        "--vllm-python", help="python of a virtualenv with vLLM's CPU build (omit: Glassbox only)"
    )
    ap.add_argument("--glassbox-args", nargs="*", default=[], metavar="KEY=VALUE")
    ap.add_argument(
        "--variant", type=parse_variant, action="append", default=[], metavar="NAME:KEY=VALUE,..."
    )
    ap.add_argument("--no-phases", dest="phases", action="store_false", help="skip the traced Glassbox run")
    ap.add_argument(
        "--no-limit", dest="limit", action="store_false", help="skip measuring the machine's limit"
    )
    ap.add_argument(
        "--repeats", type=positive_int, default=5, help="best of this many, for the limit's peaks"
    )
    ap.add_argument("--svg", help="draw out tok/s against batch size here")
    ap.add_argument("--phases-svg", help="draw a decode step's phases per batch size here")
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--log-dir", help="keep every child's job, output and span file here")
    args = ap.parse_args()
    parse_settings(args.glassbox_args)
    if args.vllm_python:
        args.vllm_python = check_vllm_python(ap, args.vllm_python)
    args.contention = False
    cores = sorted(os.sched_getaffinity(0))
    engines = make_engines(args, cores)
    dtypes = ["float32", "bfloat16"] if args.dtype == "both" else [args.dtype]
    shape = MODEL_SIZES[args.model_size]
    rng = random.Random(0)
    batch_sizes = sorted(set(args.batch_sizes))
    prompts = [[rng.randrange(3, shape["vocab_size"]) for _ in range(args.input_len)]
               for _ in range(max(batch_sizes))]  # fmt: skip
    from roofline import cpu_features

    machine = f"{cpu_model()}, {len(cores)} cores; {cpu_features()}"
    print(f"workload: 1–{max(batch_sizes)} requests at once ({', '.join(map(str, batch_sizes))}), each "
          f"{args.input_len} random prompt tokens → {args.output_len} greedy tokens, EOS ignored; model "
          f"({args.model_size}): {describe_model(shape)}")  # fmt: skip
    print(f"machine: {machine}; load average {load_average()}", flush=True)

    tok_s: dict[tuple[str, str], dict[int, list[float]]] = {}
    phases: dict[str, dict[int, dict[str, float]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.log_dir) if args.log_dir else Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        model = build_small_model(Path(tmp) / args.model_size, shape)
        (work / "child.py").write_text(CHILD)
        max_len = args.input_len + args.output_len + 8
        common = {"model": str(model), "max_model_len": max_len, "prompts": prompts,
                  "output_len": args.output_len, "batch_sizes": batch_sizes}  # fmt: skip
        for run in range(args.runs):
            order = engines[run % len(engines) :] + engines[: run % len(engines)]
            for dtype in dtypes:
                for e in order:
                    before = load_average()
                    r = run_child(e, dtype, f"run{run + 1}-{dtype}-{e.name.replace(':', '-')}", work, common,
                                  args.timeout, {})  # fmt: skip
                    for s in r["sizes"]:
                        tok_s.setdefault((e.name, dtype), {}).setdefault(s["batch"], []).append(s["tok_s"])
                    sizes = ", ".join(f"{s['batch']}: {s['tok_s']:,.0f}" for s in r["sizes"])
                    print(f"run {run + 1}/{args.runs} {dtype:<8} {e.name:<16} out tok/s by batch size {sizes}; "
                          f"load average {before} -> {load_average()}", flush=True)  # fmt: skip
        if args.phases:
            glassbox = engines[0]
            for dtype in dtypes:
                spans_path = work / f"phases-{dtype}.spans.jsonl"
                spans_path.unlink(missing_ok=True)
                r = run_child(glassbox, dtype, f"phases-{dtype}", work, common, args.timeout,
                              {"trace_file": str(spans_path), "collect_detailed_traces": "all"})  # fmt: skip
                spans = read_spans(spans_path)
                phases[dtype] = {
                    s["batch"]: step_phases(spans, s["start_ns"], s["end_ns"]) for s in r["sizes"]
                }
    limits: dict[str, dict[int, float]] = {}
    how = ""
    if args.limit:
        flops, bandwidth, how = measure_limits(args.repeats)
        for d in dtypes:
            limits[f"limit, {d}"] = {b: limit_tok_s(b, args.input_len, args.output_len, shape, d, flops[d], bandwidth)
                                     for b in batch_sizes}  # fmt: skip

    print(f"\nmachine: {machine}; load average now {load_average()}; medians of {args.runs} runs, each engine "
          f"in a fresh process per run, interleaved")  # fmt: skip
    if how:
        print(f"limit: {how} (roofline.py's bound for each batch)")
    names = [e.name for e in engines]
    header = ["batch"] + [f"{n} {d}" for d in dtypes for n in names]
    if args.vllm_python:
        header += [f"{n} ÷ vLLM {d}" for d in dtypes for n in names if n != "vllm"]
    if limits:
        header += [f"share of the limit, {n} {d}" for d in dtypes for n in names]
    print("\n| " + " | ".join(header) + " |")
    print("|---" * len(header) + "|")
    med = {k: {b: statistics.median(v) for b, v in per.items()} for k, per in tok_s.items()}
    for b in batch_sizes:
        cells = [str(b)] + [f"{med[(n, d)][b]:,.0f}" for d in dtypes for n in names]
        if args.vllm_python:
            cells += [
                f"**{med[(n, d)][b] / med[('vllm', d)][b]:.2f}×**"
                for d in dtypes
                for n in names
                if n != "vllm"
            ]
        if limits:
            cells += [f"{med[(n, d)][b] / limits[f'limit, {d}'][b]:.2f}" for d in dtypes for n in names]
        print("| " + " | ".join(cells) + " |")
    if phases:
        print(
            "\nGlassbox, ms per decode step by phase (medians; a traced run, so slower than the runs above):"
        )
        print("| dtype | batch | " + " | ".join(PHASES) + " | total | steps |")
        print("|---" * (len(PHASES) + 4) + "|")
        for d, per in phases.items():
            for b, p in sorted(per.items()):
                if p:
                    total = sum(p[k] for k in PHASES)
                    print(
                        f"| {d} | {b} | "
                        + " | ".join(f"{p[k]:.2f}" for k in PHASES)
                        + f" | {total:.2f} | {p['steps']:.0f} |"
                    )
    subtitle = f"{machine}; {args.input_len} → {args.output_len} tokens each; {args.model_size} model"
    if args.svg:
        series = {f"{'vLLM 0.32' if n == 'vllm' else n} {d}": med[(n, d)] for d in dtypes for n in names}
        Path(args.svg).write_text(draw_sweep_svg(series, limits, "Out tok/s against batch size", subtitle),
                                  encoding="utf-8")  # fmt: skip
        print(f"\nwrote {args.svg}")
    if args.phases_svg and phases:
        Path(args.phases_svg).write_text(draw_phases_svg(phases, "Where a Glassbox decode step's time goes",
                                                         subtitle), encoding="utf-8")  # fmt: skip
        print(f"wrote {args.phases_svg}")


if __name__ == "__main__":
    main()
