"""Load with faults: 1,000 streamed requests at concurrency 64, one client in five
leaving mid-stream. Afterwards every KV block is free, no request is left in the scheduler,
and the only requests that failed are the ones whose client left.

One server, bounded: short prompts and 8 tokens each (the tree's bookkeeping is what is
under test, not its speed); the whole test stops itself after its timeout.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import tempfile
import time
from pathlib import Path

import httpx
import pytest
from server_utils import start_server

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

REQUESTS = 1000
CONCURRENCY = 64
LEAVE_EVERY = 5  # one client in five leaves after its first chunk: 20 %
MAX_TOKENS = 8


def _vllm_metrics(url: str) -> dict[str, float]:
    values = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("vllm:"):
            name_labels, value = line.rsplit(" ", 1)
            name = name_labels.split("{")[0]
            values[name] = values.get(name, 0.0) + float(value)  # summed over labels (one engine)
    return values


async def _one(client: httpx.AsyncClient, model: str, i: int) -> str:
    """``left`` (client left on purpose), ``done`` (finished with [DONE]) or what went wrong."""
    body = {"model": model, "prompt": f"Request {i}: once upon a time", "max_tokens": MAX_TOKENS,
            "ignore_eos": True, "stream": True}  # fmt: skip
    leave = i % LEAVE_EVERY == 0
    chunks = 0
    try:
        async with client.stream("POST", "/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                return f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    return "done" if chunks else "empty stream"
                data = json.loads(line[len("data: ") :])
                if "error" in data:
                    return f"error event: {data['error']}"
                chunks += 1
                if leave:
                    return "left"  # leaving the block closes the connection mid-stream
        return "no [DONE]"
    except httpx.HTTPError as e:
        return f"{type(e).__name__}: {e}"


async def _load(url: str, model: str) -> list[str]:
    limits = httpx.Limits(max_connections=CONCURRENCY, max_keepalive_connections=CONCURRENCY)
    sem = asyncio.Semaphore(CONCURRENCY)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=120) as client:

        async def bounded(i: int) -> str:
            async with sem:
                return await _one(client, model, i)

        return await asyncio.gather(*(bounded(i) for i in range(REQUESTS)))


def test_1000_requests_with_20_percent_leaving_mid_stream_leave_the_engine_clean():
    base = Path(tempfile.mkdtemp(prefix="gbl", dir="/tmp"))
    server = start_server(base, "--max-model-len", "256", "--max-num-seqs", str(CONCURRENCY))
    try:
        model = httpx.get(server.base_url + "/v1/models", timeout=10).json()["data"][0]["id"]
        t0 = time.monotonic()
        outcomes = asyncio.run(_load(server.base_url, model))
        took = time.monotonic() - t0
        left = outcomes[::LEAVE_EVERY]
        stayed = [o for i, o in enumerate(outcomes) if i % LEAVE_EVERY]
        assert left.count("left") == len(left), sorted(set(left))
        failed = [o for o in stayed if o != "done"]
        assert not failed, f"{len(failed)} of {len(stayed)} full requests failed: {sorted(set(failed))[:5]}"
        # Aborts travel to the engine after the clients left: give them a moment, then the
        # engine must be idle with every KV block free.
        deadline = time.monotonic() + 15
        while True:
            m = _vllm_metrics(server.base_url)
            idle = (
                m["vllm:num_requests_running"],
                m["vllm:num_requests_waiting"],
                m["vllm:kv_cache_usage_perc"],
            )
            if idle == (0, 0, 0) or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert idle == (0, 0, 0), f"running, waiting, KV usage after the load: {idle}"
        assert m["vllm:request_success_total"] >= len(stayed)
        assert httpx.get(server.base_url + "/health", timeout=5).status_code == 200
        # ignore_eos: at the default temperature (1.0) an EOS may be drawn before the fourth token.
        r = httpx.post(server.base_url + "/v1/completions", timeout=30,
                       json={"model": model, "prompt": "Hi", "max_tokens": 4, "ignore_eos": True})  # fmt: skip
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4, r.text
        print(f"{REQUESTS} requests in {took:.1f} s")
    finally:
        server.kill_group()
        shutil.rmtree(base, ignore_errors=True)
