"""Structured outputs under load: what a JSON schema on every request costs.

One ``glassbox serve`` (the bundled model by default) serves the same load twice over, in
turns, repeated ``--repeats`` times so that a neighbour's load on the machine falls on both
sides alike: chat requests at concurrency 16 each with ``response_format`` a JSON schema (four
schemas in rotation, ``--max-tokens`` at most: a reply ends when its document is complete),
then the same requests without a constraint, each asking for exactly as many tokens as its
constrained twin produced (``ignore_eos``). The two runs move the same tokens through the same
number of requests; what differs is the constraint: the grammar compile, the bitmask, its
application to the logits, the grammar's advance. It prints:

1. each schema's grammar compile time (``glassbox:structured_output_compile_seconds`` from
   ``/metrics``, one request per schema before the load, then one more: the backend keeps
   compiled grammars, so a repeated schema costs a copy);
2. output tok/s of each run, and the constrained / unconstrained ratio of their medians
   (target ≥ 0.8);
3. the bitmask's share of step time: over the engine's recorded steps (``--telemetry-record``,
   live telemetry's step records) that sampled under a grammar, the sum of ``bitmask_ms``
   over the sum of ``duration_ms``.

    .venv/bin/python benchmarks/structured_outputs.py
    .venv/bin/python benchmarks/structured_outputs.py --num-requests 2 --concurrency 2 --max-tokens 8 --repeats 1
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]
from vs_vllm import cpu_model  # noqa: E402

from engine.config import DEFAULT_MODEL  # noqa: E402
from tracing.telemetry.events import StepRecord, read_recording  # noqa: E402

SCHEMAS = {
    "person (string, integer, number, enum, array)": {
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "age": {"type": "integer", "minimum": 0},
            "score": {"type": "number"},
            "color": {"enum": ["red", "green", "blue"]},
            "tags": {"type": "array", "items": {"type": "string"}},
        },
        "required": ["name", "age", "score", "color", "tags"],
    },
    "order (nested objects, array of objects)": {
        "type": "object",
        "properties": {
            "customer": {
                "type": "object",
                "properties": {"id": {"type": "integer"}, "email": {"type": "string"}},
                "required": ["id", "email"],
            },
            "lines": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {"sku": {"type": "string"}, "qty": {"type": "integer"}},
                    "required": ["sku", "qty"],
                },
            },
            "paid": {"type": "boolean"},
        },
        "required": ["customer", "lines", "paid"],
    },
    "strict flat (additionalProperties false)": {
        "type": "object",
        "properties": {"title": {"type": "string"}, "year": {"type": "integer"}},
        "required": ["title", "year"],
        "additionalProperties": False,
    },
    "event (pattern, enum, boolean)": {
        "type": "object",
        "properties": {
            "date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
            "kind": {"enum": ["meeting", "call", "trip"]},
            "done": {"type": "boolean"},
        },
        "required": ["date", "kind", "done"],
    },
}
PROMPTS = ["Describe a person as JSON.", "Write an order.", "Name a book.", "Plan the week."]


def start_server(base: Path, model: str, record: Path) -> tuple[subprocess.Popen, str]:
    env = {**os.environ, "GLASSBOX_RUN_DIR_BASE": str(base)}
    proc = subprocess.Popen([sys.executable, "-m", "engine.cli.main", "serve", model, "--port", "0",
                             "--max-model-len", "1024", "--uvicorn-log-level", "warning",
                             "--telemetry-record", str(record)],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit("the server exited during start-up")
        manifests = [json.loads(p.read_text()) for p in base.glob("glassbox-*/manifest.json")]
        if manifests and "port" in manifests[0]:
            url = f"http://127.0.0.1:{manifests[0]['port']}"
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    return proc, url
            except httpx.HTTPError:
                pass
        time.sleep(0.1)
    proc.kill()
    raise SystemExit("the server did not become healthy in 300 s")


def compile_seconds(url: str) -> tuple[float, float]:
    """(sum, count) of the grammar compile-time histogram."""
    values = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("glassbox:structured_output_compile_seconds_"):
            name, value = line.split("{")[0], line.rsplit(" ", 1)[1]
            values[name] = float(value)
    return values["glassbox:structured_output_compile_seconds_sum"], values[
        "glassbox:structured_output_compile_seconds_count"
    ]


def body(i: int, max_tokens: int, constrained: bool) -> dict:
    """Request ``i``: a chat prompt, at most ``max_tokens`` (exactly, unconstrained), a schema."""
    request = {
        "messages": [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "seed": i,
    }
    if constrained:
        name, schema = list(SCHEMAS.items())[i % len(SCHEMAS)]
        request["response_format"] = {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}
    return request


async def run_load(url: str, max_tokens: list[int], concurrency: int, constrained: bool):
    """(output tok/s, each request's output tokens, (Unix start, end)) of one run of
    ``len(max_tokens)`` requests; every constrained reply that finished must parse."""
    limit = asyncio.Semaphore(concurrency)
    tokens = [0] * len(max_tokens)
    async with httpx.AsyncClient(timeout=600) as client:

        async def one(i: int) -> None:
            async with limit:
                r = await client.post(url + "/v1/chat/completions", json=body(i, max_tokens[i], constrained))
                r.raise_for_status()
                reply = r.json()
                tokens[i] = reply["usage"]["completion_tokens"]
                if constrained and reply["choices"][0]["finish_reason"] == "stop":
                    json.loads(reply["choices"][0]["message"]["content"])

        start_unix, start = time.time(), time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(len(max_tokens))))
        wall = time.perf_counter() - start
    return sum(tokens) / wall, tokens, (start_unix, time.time())


STEP_PARTS = ("duration_ms", "schedule_ms", "bitmask_ms", "execute_ms", "update_ms", "tokens_scheduled")


def step_means(record: Path, windows: list[tuple[float, float]], structured_only: bool) -> tuple[int, dict]:
    """(recorded steps inside ``windows``, each ``STEP_PARTS`` figure's mean over them); with
    ``structured_only`` only the steps that sampled under a grammar."""
    sums = dict.fromkeys(STEP_PARTS, 0.0)
    steps = 0
    with open(record, "rb") as f:
        for event in read_recording(f):
            if (
                not isinstance(event, StepRecord)
                or event.dummy
                or (structured_only and not event.num_structured_reqs)
            ):
                continue
            if any(start <= event.started_at <= end for start, end in windows):
                for name in STEP_PARTS:
                    sums[name] += getattr(event, name)
                steps += 1
    return steps, {name: total / steps if steps else 0.0 for name, total in sums.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=DEFAULT_MODEL, help="model directory (default: the bundled model)")
    parser.add_argument("--num-requests", type=int, default=64, help="requests per run")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=128, help="output tokens asked per request")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each kind, in turns")
    args = parser.parse_args()

    base = Path(tempfile.mkdtemp(prefix="gbso", dir="/tmp"))
    record = base / "telemetry.rec"
    proc, url = start_server(base, args.model, record)
    try:
        print(f"CPU: {cpu_model()}; {os.cpu_count()} logical CPUs; load average before: "
              f"{' '.join(f'{v:.2f}' for v in os.getloadavg())} (a shared machine: other work runs beside this)")  # fmt: skip
        # The first structured request also builds the backend (llguidance's tokenizer, the
        # token table): timed apart, with a regex.
        before_sum, _ = compile_seconds(url)
        warm = {**body(0, 1, False), "structured_outputs": {"regex": "[a-z]+"}}
        httpx.post(url + "/v1/chat/completions", json=warm, timeout=120).raise_for_status()
        print(f"first structured request (builds the backend) + its regex: "
              f"{1e3 * (compile_seconds(url)[0] - before_sum):.1f} ms")  # fmt: skip
        print("grammar compile time per schema (ms): the first request, and again (the backend's cache)")
        for i, (name, schema) in enumerate(SCHEMAS.items()):
            times = []
            for _ in range(2):
                before_sum, before_count = compile_seconds(url)
                request = {**body(i, 1, False), "response_format": {"type": "json_schema",
                           "json_schema": {"name": "s", "schema": schema}}}  # fmt: skip
                httpx.post(url + "/v1/chat/completions", json=request, timeout=120).raise_for_status()
                after_sum, after_count = compile_seconds(url)
                assert after_count == before_count + 1, (before_count, after_count)
                times.append(1e3 * (after_sum - before_sum))
            print(f"  {times[0]:8.2f} {times[1]:8.3f}  {name}")

        results: dict[bool, list[float]] = {False: [], True: []}
        tokens: dict[bool, int] = {False: 0, True: 0}
        windows: dict[bool, list[tuple[float, float]]] = {False: [], True: []}
        for _ in range(args.repeats):
            asked = [args.max_tokens] * args.num_requests
            for constrained in (True, False):
                tok_s, got, window = asyncio.run(run_load(url, asked, args.concurrency, constrained))
                results[constrained].append(tok_s)
                tokens[constrained] += sum(got)
                windows[constrained].append(window)
                asked = got  # the unconstrained twin of each request asks for what it produced
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()

    print(f"\nconcurrency {args.concurrency}, {args.num_requests} requests per run, at most {args.max_tokens} tokens "
          "each (an unconstrained request asks for as many as its constrained twin produced)")  # fmt: skip
    print(f"{'run':<14}{'output tok/s (each run)':<34}{'median':>8}{'tokens/request':>16}")
    num_runs = args.repeats * args.num_requests
    for constrained, label in ((True, "JSON schema"), (False, "unconstrained")):
        runs = " ".join(f"{v:7.1f}" for v in results[constrained])
        print(f"{label:<14}{runs:<34}{statistics.median(results[constrained]):8.1f}"
              f"{tokens[constrained] / num_runs:16.1f}")  # fmt: skip
    ratio = statistics.median(results[True]) / statistics.median(results[False])
    print(f"ratio (schema / unconstrained): {ratio:.2f} (target ≥ 0.80)")
    print(f"\nrecorded engine steps (means, ms): {'steps':>6} {'step':>6} {'sched':>6} {'bitmask':>8} {'exec':>6} "
          f"{'update':>7} {'tokens':>7}")  # fmt: skip
    for constrained, label in ((False, "unconstrained"), (True, "JSON schema")):
        steps, mean = step_means(record, windows[constrained], structured_only=constrained)
        print(f"  {label:<32} {steps:>6} {mean['duration_ms']:6.2f} {mean['schedule_ms']:6.2f} "
              f"{mean['bitmask_ms']:8.2f} {mean['execute_ms']:6.2f} {mean['update_ms']:7.2f} "
              f"{mean['tokens_scheduled']:7.1f}")  # fmt: skip
        if constrained and mean["duration_ms"]:
            print(f"bitmask share of step time: {100 * mean['bitmask_ms'] / mean['duration_ms']:.1f}% "
                  f"(of the recorded steps that sampled under a grammar)")  # fmt: skip
    print(f"load average after: {' '.join(f'{v:.2f}' for v in os.getloadavg())}")


if __name__ == "__main__":
    main()
