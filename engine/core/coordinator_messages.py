"""Messages of the data-parallel coordinator (``glassbox::DPCoordinator``): one module, typed.

Mirrors what vLLM's ``DPCoordinator`` (``vllm/v1/engine/coordinator.py``) carries for load
balancing and request waves::

    engine core k ──PUSH/PULL──▶ DPCoordinator   EngineLoad (k, waiting, running), on change
                                                 StartWave (k, wave): k got a request while idle
                                                 WaveComplete (0, wave): the engines ended it (EP)
    DPCoordinator ──PUB/SUB────▶ every engine    DPWave (wave, running, exclude): START_DP_WAVE
                                                 (running) or wave complete (not running)
    DPCoordinator ──PUB/SUB────▶ every client    EngineLoads (all engines, wave), ≤ 1 per 100 ms

The sockets are ``ipc://`` paths in the run directory (``coordinator_addresses``): the
coordinator binds them, engines and clients connect. The client scores each engine
``waiting * 4 + running`` from the latest ``EngineLoads`` (corrected locally for what it sent
since) and sends each new request to the lowest.

**Request waves** (vLLM's ``DPEngineCoreProc``, with 0.33's engine-started waves): while any
engine has unfinished requests, every engine steps — an engine with nothing to do runs a
dummy batch — so the engines move in lockstep (what the collectives of expert parallelism
need). An idle engine that gets a request starts a wave (``StartWave``); the coordinator
tells every other engine (``DPWave`` running). When every engine reports no waiting and no
running requests, the coordinator ends the wave (``DPWave`` not running, with the next wave
number); an engine that still has requests then starts the next one.

With expert parallelism across engines the end is the engines' own decision, as in vLLM: every
``DP_WAVE_SYNC_STEPS`` steps of a wave they all-reduce "any work left?" over their DP group and,
when none has any, all stop after the same step; engine 0 says ``WaveComplete``. (The counts
the coordinator sees are a moment old: an engine it told to stop could still be needed by
another engine's next all-to-all.)
"""

from __future__ import annotations

from pathlib import Path

import msgspec

from engine.utils.wire import decode

BOUNDARY = "engine core ↔ DP coordinator ↔ client"

# The coordinator publishes the table at most this often while it changes (vLLM: 100 ms).
PUBLISH_INTERVAL_S = 0.1


class EngineLoad(msgspec.Struct, kw_only=True, array_like=True, tag="load"):
    """One engine core's request counts after a step or after taking new requests."""

    engine_index: int
    num_waiting: int
    num_running: int


class StartWave(msgspec.Struct, kw_only=True, array_like=True, tag="start_wave"):
    """Engine ``engine_index`` got a request while its engines were idle: start wave ``wave``
    (vLLM: ``EngineCoreOutputs(start_wave=...)`` to the coordinator). ``trace_headers``: the
    span of the request that started it (W3C): the wave's span joins that request's trace.
    ``num_waiting``, ``num_running``: the engine's load as it sends this (its ``EngineLoad``
    comes with it): the coordinator must not end the new wave on another engine's zero counts
    before this engine's own load has arrived."""

    engine_index: int
    wave: int
    trace_headers: dict[str, str] | None = None
    num_waiting: int = 0
    num_running: int = 0


class WaveComplete(msgspec.Struct, kw_only=True, array_like=True, tag="wave_complete"):
    """Expert parallelism across engines: the engines decided together (their DP group's
    all-reduce) that wave ``wave`` is complete; engine 0 tells the coordinator (vLLM:
    ``EngineCoreOutputs(wave_complete=...)``)."""

    engine_index: int
    wave: int


# What an engine core sends the coordinator.
EngineToCoordinator = EngineLoad | StartWave | WaveComplete


class DPWave(msgspec.Struct, kw_only=True, array_like=True):
    """The coordinator to every engine: wave ``wave`` runs (vLLM's ``START_DP_WAVE``; the
    engine that started it, ``exclude_engine``, knows already), or, with ``running`` false,
    the last wave is complete and ``wave`` is the next one's number."""

    wave: int
    running: bool
    exclude_engine: int | None = None


class EngineLoads(msgspec.Struct, kw_only=True, array_like=True):
    """Every engine's latest counts, by engine index: ``counts[k] = (waiting, running)``.

    ``seq`` grows with each publish, so a client can tell a fresh table from one it has used.
    ``current_wave`` and ``engines_running``: the wave state (running: every engine steps).
    """

    seq: int
    counts: list[tuple[int, int]]
    current_wave: int = 0
    engines_running: bool = False


class CoordinatorSpawnPayload(msgspec.Struct, kw_only=True):
    """What the coordinator process needs: its three addresses and the number of engines."""

    input_address: str
    publish_address: str
    data_parallel_size: int
    publish_interval_s: float = PUBLISH_INTERVAL_S
    wave_address: str | None = None
    # Expert parallelism across engines: the engines end each wave together (WaveComplete);
    # the coordinator never ends one on the counts (an engine told to stop early would leave
    # the others waiting in an all-to-all).
    engines_end_waves: bool = False
    # Where its spans go, as every other process's (--trace-file, --otlp-traces-endpoint).
    trace_file: str | None = None
    otlp_traces_endpoint: str | None = None
    # The spawner's trace context (W3C headers): dp_coordinator.init joins its start-up trace.
    trace_headers: dict[str, str] | None = None


def coordinator_addresses(run_dir: Path | str) -> tuple[str, str]:
    """(engines → coordinator, coordinator → clients) ``ipc://`` addresses in the run directory."""
    return f"ipc://{run_dir}/coord_in.sock", f"ipc://{run_dir}/coord_pub.sock"


def wave_address(run_dir: Path | str) -> str:
    """Coordinator → engines (``DPWave``) ``ipc://`` address in the run directory."""
    return f"ipc://{run_dir}/coord_wave.sock"


def score(num_waiting: int, num_running: int) -> int:
    """vLLM's DP load-balancing score: waiting requests weigh four times running ones."""
    return num_waiting * 4 + num_running


_encoder = msgspec.msgpack.Encoder()
_decoders: dict[type, msgspec.msgpack.Decoder] = {}


def encode(message: msgspec.Struct) -> bytes:
    return _encoder.encode(message)


def decode_as(message_type: type, data: bytes | memoryview):
    """Decode ``data`` as ``message_type``; ``ProtocolError`` when it does not fit."""
    decoder = _decoders.get(message_type)
    if decoder is None:
        decoder = _decoders[message_type] = msgspec.msgpack.Decoder(message_type)
    return decode(decoder, data, BOUNDARY)
