"""Messages of the data-parallel coordinator (``glassbox::DPCoordinator``): one module, typed.

Mirrors what vLLM's ``DPCoordinator`` (``vllm/v1/engine/coordinator.py``) carries for load
balancing::

    engine core k ──PUSH/PULL──▶ DPCoordinator   EngineLoad (k, waiting, running), on change
    DPCoordinator ──PUB/SUB────▶ every client    EngineLoads (all engines), ≤ 1 per 100 ms

Both sockets are ``ipc://`` paths in the run directory (``coordinator_addresses``): the
coordinator binds them, engines and clients connect. The client scores each engine
``waiting * 4 + running`` from the latest ``EngineLoads`` (corrected locally for what it sent
since) and sends each new request to the lowest. Waves (``START_DP_WAVE``) and dummy batches
are later work.
"""

from __future__ import annotations

from pathlib import Path

import msgspec

from engine.utils.wire import decode

BOUNDARY = "engine core ↔ DP coordinator ↔ client"

# The coordinator publishes the table at most this often while it changes (vLLM: 100 ms).
PUBLISH_INTERVAL_S = 0.1


class EngineLoad(msgspec.Struct, kw_only=True, array_like=True):
    """One engine core's request counts after a step or after taking new requests."""

    engine_index: int
    num_waiting: int
    num_running: int


class EngineLoads(msgspec.Struct, kw_only=True, array_like=True):
    """Every engine's latest counts, by engine index: ``counts[k] = (waiting, running)``.

    ``seq`` grows with each publish, so a client can tell a fresh table from one it has used.
    """

    seq: int
    counts: list[tuple[int, int]]


class CoordinatorSpawnPayload(msgspec.Struct, kw_only=True):
    """What the coordinator process needs: its two addresses and the number of engines."""

    input_address: str
    publish_address: str
    data_parallel_size: int
    publish_interval_s: float = PUBLISH_INTERVAL_S


def coordinator_addresses(run_dir: Path | str) -> tuple[str, str]:
    """(engines → coordinator, coordinator → clients) ``ipc://`` addresses in the run directory."""
    return f"ipc://{run_dir}/coord_in.sock", f"ipc://{run_dir}/coord_pub.sock"


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
