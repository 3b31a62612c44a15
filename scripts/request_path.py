"""Count the code one streamed completion runs, HTTP in to SSE out, across the whole tree.

    python scripts/request_path.py [--max-tokens 32] [--detail] [serve flags...]

What it does:

1. It writes a ``sitecustomize.py`` into a temporary directory and puts that directory first
   on ``PYTHONPATH``, so every process of the tree (API server, engine core, workers: each a
   fresh interpreter, started with spawn) loads it. It installs a ``sys.setprofile`` /
   ``threading.setprofile`` hook that notes, for each function of this repository's
   ``engine/``, ``tracing/`` and ``tui/`` packages, the thread it ran on, the 10 ms ticks (wall
   clock) in which it was called, and which of our functions called it. A coroutine's resume
   is not a call (only its first entry is). Each process writes what it saw to a JSON file
   twice a second.
2. It starts ``glassbox serve`` on the bundled model with the shipped defaults (plus any
   flags given), sends one streamed completion to warm up (compilation, first-touch), waits
   a second, then sends the measured one and notes the wall-clock window from the request
   to its ``data: [DONE]``.
3. It stops the server and counts the functions that ran in that window on the threads a
   request crosses (the API server's event loop, the engine core's input, main and output
   threads, the workers' main threads): those called in the window, and those that called
   one of ours in it, by its name or a module-level alias (a loop entered before the
   request, like the busy loop, calls ``step`` but is entered no more). A process's entry
   and its harness, below those loops, call nothing in the window and do not count. Threads that run on a clock whatever the
   request does (heartbeats, the telemetry publisher, the executor's worker monitor) are
   listed apart.

A function's **lines** are the non-blank, non-comment lines of its body without its
docstring (``ast``). What ran is told in four parts, by file:

- **the reference path**, what a reader follows to see vLLM's logic: every file but the three
  below. Its **observability or supervision** lines are those that name a span, tracer,
  stage, publisher, telemetry, heartbeat, liveness, watchdog, crash, root cause, flight
  recorder or observer (``GLASS_WORDS``): the glass's hooks in the reference code.
- **the glass's own modules** (``GLASS_MODULES``: ``tracing/``, ``engine/metrics/``, the step
  observers, request tracing, the process harness, supervision): all glass, plugged in.
- **the CPU rooms** (``engine/model/cpu/``, ``engine/worker/cpu/``): speed-ups behind interfaces.
- **the model's own math** (the rest of ``engine/model/``): the model, not the path.

The hook slows the tree several times over; the window is wall clock, so this counts what
ran, not how long it took. Prints a table by file; ``--detail`` lists every function.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("engine", "tracing", "tui")
GLASS_MODULES = (
    "tracing/",
    "engine/metrics/",
    "engine/core/step_observer.py",
    "engine/core/request_tracing.py",
    "engine/worker/step_telemetry.py",
    "engine/frontend/request_tracing.py",
    "engine/entrypoints/openai/http_telemetry.py",
    "engine/utils/process_harness.py",
    "engine/utils/supervisor.py",
    "engine/utils/processes.py",
)
# Lines of a reference-path function that do the glass's work.
GLASS_WORDS = re.compile(
    r"\b(span|spans|tracer|tracing|stage|publisher|telemetry|trace_context|traceparent|heartbeat|"
    r"liveness|check_alive|watchdog|crash|root_cause|flight|observer|observers)\b"
)
# The speed-ups behind interfaces, in rooms of their own.
CPU_ROOMS = ("engine/model/cpu/", "engine/worker/cpu/")
MODEL = "engine/model/"


def part(rel: str) -> str:
    """Which part of the code a file is: ``glass``, ``cpu``, ``model`` or ``reference``."""
    if rel.startswith(GLASS_MODULES):
        return "glass"
    if rel.startswith(CPU_ROOMS):
        return "cpu"
    if rel.startswith(MODEL):
        return "model"
    return "reference"


# Threads a request's messages cross; every other thread is background.
PATH_THREADS = re.compile(r"^(MainThread|EngineCoreInputThread|EngineCoreOutputThread)$")

SITECUSTOMIZE = """
import dis, json, os, sys, threading, time
_out = os.environ.get("REQUEST_PATH_OUT")
if _out:
    _roots = tuple(os.environ["REQUEST_PATH_ROOTS"].split(os.pathsep))
    _hits = {}  # entered afresh: (file, first line, qualname, thread) -> 10 ms ticks
    _callers = {}  # (caller's key, callee's file and first line) at a fresh entry -> ticks
    _resume_at = {}  # a generator or coroutine's code -> the offset of its first RESUME
    _GENERATOR_LIKE = 0x20 | 0x80 | 0x200  # CO_GENERATOR | CO_COROUTINE | CO_ASYNC_GENERATOR

    def _fresh(frame, code):
        # A coroutine is "called" again at every resume: only its first entry is a call.
        if not code.co_flags & _GENERATOR_LIKE:
            return True
        at = _resume_at.get(code)
        if at is None:
            at = _resume_at[code] = next(i.offset for i in dis.get_instructions(code) if i.opname == "RESUME")
        return frame.f_lasti <= at

    _named_cache = {}

    def _named(caller, code):
        # By its own name, or by a module-level alias (``from m import encode as _encode``).
        pair = (caller.f_code, code)
        named = _named_cache.get(pair)
        if named is None:
            names = caller.f_code.co_names
            named = code.co_name in names or any(
                getattr(caller.f_globals.get(n), "__code__", None) is code for n in names
            )
            _named_cache[pair] = named
        return named

    def _prof(frame, event, arg, _time=time.time, _thread=threading.current_thread):
        if event != "call":
            return
        code = frame.f_code
        if not code.co_filename.startswith(_roots) or not _fresh(frame, code):
            return
        tick = int(_time() * 100)
        thread = _thread().name
        key = (code.co_filename, code.co_firstlineno, code.co_qualname, thread)
        _hits.setdefault(key, set()).add(tick)
        caller = frame.f_back
        # The caller named it (a C event loop calling a callback leaves no frame between: the
        # frame below it is whatever Python frame ran the loop, which called nothing).
        if caller is not None and caller.f_code.co_filename.startswith(_roots) and _named(caller, code):
            c = caller.f_code
            edge = (c.co_filename, c.co_firstlineno, c.co_qualname, thread, code.co_filename, code.co_firstlineno)
            _callers.setdefault(edge, set()).add(tick)

    def _dump():
        path = os.path.join(_out, f"{os.getpid()}.json")
        try:
            with open(f"/proc/{os.getpid()}/cmdline", "rb") as f:
                title = f.read().split(b"\\0")[0].decode(errors="replace")
        except OSError:
            title = sys.argv[0]
        hits = [[*k, sorted(v)] for k, v in list(_hits.items())]
        callers = [[*k, sorted(v)] for k, v in list(_callers.items())]
        with open(path + ".tmp", "w") as f:
            json.dump({"pid": os.getpid(), "title": title, "hits": hits, "callers": callers}, f)
        os.replace(path + ".tmp", path)

    def _dumper():
        while True:
            time.sleep(0.5)
            try:
                _dump()
            except Exception:
                pass

    threading.setprofile(_prof)
    sys.setprofile(_prof)
    threading.Thread(target=_dumper, name="request_path_dumper", daemon=True).start()
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stream(url: str, max_tokens: int) -> int:
    body = {"prompt": "Once upon a time", "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    chunks = 0
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=300) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if line == "data: [DONE]":
                return chunks
            if line.startswith("data: "):
                chunks += 1
    raise RuntimeError("the stream ended without [DONE]")


def _wait_healthy(url: str, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited ({proc.returncode}) before it was healthy")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise SystemExit(f"the server was not healthy within {timeout:.0f} s")


def _functions(path: Path) -> dict[int, tuple[str, list[str]]]:
    """First line (the ``def``, or its first decorator: ``co_firstlineno``) -> (name, body lines)."""
    source = path.read_text()
    lines = source.splitlines()
    out: dict[int, tuple[str, list[str]]] = {}
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        body = node.body
        if (
            body
            and isinstance(body[0], ast.Expr)
            and isinstance(getattr(body[0], "value", None), ast.Constant)
        ):
            body = body[1:]  # the docstring
        kept: list[str] = []
        if body:
            for text in lines[body[0].lineno - 1 : node.end_lineno]:
                stripped = text.strip()
                if stripped and not stripped.startswith("#"):
                    kept.append(stripped)
        first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
        out[first] = (node.name, kept)
    return out


def count(out_dir: Path, window: tuple[float, float]) -> dict:
    """What ran within ``window`` (wall-clock seconds), by file and function."""
    lo, hi = int(window[0] * 100), int(window[1] * 100) + 1
    ran: dict[tuple[str, int], set[str]] = defaultdict(set)  # (file, first line) -> threads
    for dump in out_dir.glob("*.json"):
        data = json.loads(dump.read_text())
        for filename, first, _qualname, thread, ticks in data["hits"]:
            if any(lo <= t <= hi for t in ticks):
                ran[(filename, first)].add(thread)
        for filename, first, _qualname, thread, _callee_file, _callee_first, ticks in data["callers"]:
            if any(lo <= t <= hi for t in ticks):
                ran[(filename, first)].add(thread)  # a loop calling what the request runs
    parsed: dict[str, dict[int, tuple[str, list[str]]]] = {}
    rows = []
    for (filename, first), threads in ran.items():
        rel = os.path.relpath(filename, REPO)
        if rel not in parsed:
            parsed[rel] = _functions(REPO / rel)
        name, body = parsed[rel].get(first, (None, []))
        if name is None:
            continue  # a lambda, a comprehension, a module body
        on_path = any(PATH_THREADS.match(t) for t in threads)
        glass = sum(1 for line in body if GLASS_WORDS.search(line))
        if rel.startswith(GLASS_MODULES):
            glass = len(body)
        rows.append({"file": rel, "function": name, "line": first, "lines": len(body), "glass": glass,
                     "on_path": on_path, "threads": sorted(threads)})  # fmt: skip
    return {"rows": sorted(rows, key=lambda r: (r["file"], r["line"]))}


def report(result: dict, detail: bool) -> None:
    ran = [r for r in result["rows"] if r["on_path"]]
    background = [r for r in result["rows"] if not r["on_path"]]
    by_file: dict[str, list[dict]] = defaultdict(list)
    for r in ran:
        by_file[r["file"]].append(r)
    print(f"{'file':58} {'functions':>9} {'lines':>6} {'glass':>6}  part")
    for f, rs in sorted(by_file.items(), key=lambda item: (part(item[0]), item[0])):
        lines, glass = sum(r["lines"] for r in rs), sum(r["glass"] for r in rs)
        print(f"{f:58} {len(rs):>9} {lines:>6} {glass:>6}  {part(f)}")
        if detail:
            for r in rs:
                print(
                    f"    {r['function']:54} {'':>9} {r['lines']:>6} {r['glass']:>6}  {','.join(r['threads'])}"
                )
    print()
    for name, what in [
        ("reference", "the reference path (what a reader follows)"),
        ("glass", "the glass's own modules (harness, observers, tracing, telemetry, metrics, supervision)"),
        ("cpu", "the CPU rooms (engine/model/cpu/, engine/worker/cpu/)"),
        ("model", "the model's own math (engine/model/)"),
    ]:
        rs = [r for r in ran if part(r["file"]) == name]
        files = len({r["file"] for r in rs})
        lines, glass = sum(r["lines"] for r in rs), sum(r["glass"] for r in rs)
        extra = f", {glass} of them observability or supervision" if name == "reference" else ""
        print(f"{what}: {files} files, {len(rs)} functions, {lines} lines{extra}")
    threads = ", ".join(sorted({t for r in background for t in r["threads"]}))
    print(f"background threads in the same window ({threads}): {len(background)} functions, "
          f"{sum(r['lines'] for r in background)} lines")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--max-tokens", type=int, default=32, help="tokens of the measured completion")
    ap.add_argument("--detail", action="store_true", help="list every function")
    ap.add_argument("--json", help="also write the rows to this file")
    args, serve_flags = ap.parse_known_args(argv)
    with tempfile.TemporaryDirectory(prefix="gbpath", dir="/tmp") as tmp:
        tmp_path = Path(tmp)
        (tmp_path / "site").mkdir()
        (tmp_path / "site" / "sitecustomize.py").write_text(SITECUSTOMIZE)
        (tmp_path / "out").mkdir()
        port = _free_port()
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(
                [str(tmp_path / "site"), str(REPO), os.environ.get("PYTHONPATH", "")]
            ),
            "REQUEST_PATH_OUT": str(tmp_path / "out"),
            "REQUEST_PATH_ROOTS": os.pathsep.join(str(REPO / p) + os.sep for p in PACKAGES),
            "GLASSBOX_RUN_DIR_BASE": str(tmp_path / "runs"),
        }
        cmd = [sys.executable, "-m", "engine.cli.main", "serve", "--port", str(port), *serve_flags]
        with open(tmp_path / "server.log", "wb") as log:
            proc = subprocess.Popen(
                cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        url = f"http://127.0.0.1:{port}"
        try:
            _wait_healthy(url, proc, timeout=600)
            _stream(url, args.max_tokens)  # warm-up
            time.sleep(1.0)
            t0 = time.time()
            chunks = _stream(url, args.max_tokens)
            t1 = time.time()
            time.sleep(1.5)  # every process writes its hits twice a second
        except BaseException:
            sys.stderr.write((tmp_path / "server.log").read_text(errors="replace")[-3000:])
            raise
        finally:
            try:
                os.killpg(proc.pid, signal.SIGINT)
                proc.wait(60)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                os.killpg(proc.pid, signal.SIGKILL)
        print(f"one streamed completion of {chunks} chunks, {t1 - t0:.2f} s under the hook\n")
        result = count(tmp_path / "out", (t0, t1))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    report(result, args.detail)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
