"""Record the data lessons 5 and 6 ship, from real servers on the bundled model.

    python scripts/record_lesson_data.py [scheduler] [step-trace]    # both by default

- ``scheduler`` → ``tutorials/data/06-scheduler/two-requests.telemetry``: ``glassbox serve
  --max-num-batched-tokens 16 --step-delay-ms 200 --telemetry-record FILE``, then request A
  (a 40-token prompt, 4 tokens out) and, the moment A's first token streams back, request B
  (a 24-token prompt, 4 tokens out). The step delay leaves B 200 ms to arrive before the
  step after A's first token, so the steps are the same every time: A's prompt in chunks of
  16, 16 and 8; then A's decodes first and B's prompt in what budget is left; then the empty
  step that hands the finished ids to the worker.
- ``step-trace`` → ``tutorials/data/05-one-engine-step/step-trace.jsonl``: ``glassbox serve
  --collect-detailed-traces all --trace-file FILE`` and one request (prompt "Return the", 2
  tokens out); the file keeps that request's trace and the step traces of the steps it ran
  in (``docs/pictures/one-step-threads.svg`` is drawn from it: ``python -m
  engine.distributed.pictures``).

Prompts are token ids (the completions API takes them), so their lengths are exact. Each
server runs in a temporary run-directory base and is stopped with SIGTERM, as Ctrl-C would,
so the recording is flushed and closed. Takes about a minute (two server starts).

The lessons quote these files' numbers (a step trace's times, the recording's request ids)
and their checks pin them: after recording again, run the lessons' test
(``pytest tests/e2e/test_tutorials.py -k "05 or 06"``), update the quoted numbers, and redraw
the pictures (``python -m engine.distributed.pictures``). The scheduler recording's steps are
the scheduler's arithmetic and come out the same.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
SCHEDULER_FILE = REPO / "tutorials" / "data" / "06-scheduler" / "two-requests.telemetry"
TRACE_FILE = REPO / "tutorials" / "data" / "05-one-engine-step" / "step-trace.jsonl"
SCHEDULER_FLAGS = ("--max-num-batched-tokens", "16", "--step-delay-ms", "200")
PROMPT_A = list(range(100, 140))  # 40 tokens
PROMPT_B = list(range(200, 224))  # 24 tokens
MODEL = "glassbox-tiny-llama"


def _serve(base: Path, *flags: str) -> tuple[subprocess.Popen, str]:
    """``glassbox serve --port 0 FLAGS`` under ``base``; (its process, its URL) once healthy."""
    env = {**os.environ, "GLASSBOX_RUN_DIR_BASE": str(base), "PYTHONPATH": str(REPO)}
    log = open(base / "server.log", "wb")  # noqa: SIM115 - the server's lifetime
    proc = subprocess.Popen([sys.executable, "-m", "engine.cli.main", "serve", "--port", "0", *flags],
                            stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO)  # fmt: skip
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited: {(base / 'server.log').read_text()[-2000:]}")
        for manifest in base.glob("glassbox-*/manifest.json"):
            try:
                port = json.loads(manifest.read_text()).get("port")
            except ValueError:
                continue
            if port:
                url = f"http://127.0.0.1:{port}"
                try:
                    if httpx.get(url + "/health", timeout=1).status_code == 200:
                        return proc, url
                except httpx.HTTPError:
                    pass
        time.sleep(0.1)
    proc.kill()
    raise SystemExit("the server did not become healthy in 180 s")


def _stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _stream(
    url: str, prompt: list[int] | str, max_tokens: int, first_token: threading.Event | None = None
) -> None:
    body = {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
    }  # exactly max_tokens out, whatever the tiny model predicts
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as reply:
        reply.raise_for_status()
        for line in reply.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]" and first_token is not None:
                first_token.set()


def record_scheduler(out: Path = SCHEDULER_FILE) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="gbrec", dir="/tmp") as tmp:
        proc, url = _serve(Path(tmp), *SCHEDULER_FLAGS, "--telemetry-record", str(out))
        try:
            first = threading.Event()
            a = threading.Thread(target=_stream, args=(url, PROMPT_A, 4, first))
            a.start()
            if not first.wait(60):
                raise SystemExit("request A never streamed its first token")
            _stream(url, PROMPT_B, 4)
            a.join()
            time.sleep(1.5)  # the empty step after the last finish, and a heartbeat or two
        finally:
            _stop(proc)
    print(f"wrote {out} ({out.stat().st_size} bytes)")


def record_step_trace(out: Path = TRACE_FILE) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="gbrec", dir="/tmp") as tmp:
        raw = Path(tmp) / "spans.jsonl"
        proc, url = _serve(Path(tmp), "--collect-detailed-traces", "all", "--trace-file", str(raw))
        try:
            _stream(url, "Return the", 2)
            time.sleep(1.0)
        finally:
            _stop(proc)
        spans = [json.loads(line) for line in raw.read_text().splitlines() if line.strip()]
    request = next(s for s in spans if s["name"] == "api_server.request")
    start, end = request["start_ns"], request["end_ns"]
    steps = {s["trace_id"] for s in spans if s["name"] == "engine_core.step"
             and start <= s["start_ns"] <= end}  # fmt: skip
    keep = [s for s in spans if s["trace_id"] == request["trace_id"] or s["trace_id"] in steps]
    keep.sort(key=lambda s: s["start_ns"])
    out.write_text("".join(json.dumps(s, sort_keys=True) + "\n" for s in keep))
    print(f"wrote {out} ({len(keep)} spans: the request's trace and {len(steps)} step traces)")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("what", nargs="*", choices=["scheduler", "step-trace", []], default=[])
    what = parser.parse_args(argv).what or ["scheduler", "step-trace"]
    if "scheduler" in what:
        record_scheduler()
    if "step-trace" in what:
        record_step_trace()


if __name__ == "__main__":
    main()
