"""What every process-boundary protocol shares: one error for a malformed message, and
typed decoding that raises it.

Each boundary's messages live in their own module (``engine/core/messages.py`` between the
frontend and the engine core, ``engine/executor/messages.py`` between the engine core and
its workers, ...); this module only holds the check they all make. Protocol checks are real
checks: a message that does not decode into the expected type raises ``ProtocolError``
naming the boundary and what was wrong (an ``assert`` would vanish under ``python -O``).
"""

from __future__ import annotations

from typing import Any

import msgspec


class ProtocolError(RuntimeError):
    """A message at a process boundary did not match its protocol.

    Always a bug (a version mismatch or a corrupted frame), never a user error.
    """


def decode(decoder: msgspec.msgpack.Decoder, data: bytes | bytearray | memoryview, boundary: str) -> Any:
    """``decoder.decode(data)``, or ``ProtocolError`` naming ``boundary`` when it does not fit."""
    try:
        return decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise ProtocolError(f"malformed message on the {boundary} boundary: {e}") from None
