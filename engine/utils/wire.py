"""What every process-boundary protocol shares: one error for a malformed message, typed
decoding that raises it, and the kind of an exception sent across a boundary.

Each boundary's messages live in their own module (``engine/core/messages.py`` between the
frontend and the engine core, ``engine/executor/messages.py`` between the engine core and
its workers, ...); this module only holds the check they all make. Protocol checks are real
checks: a message that does not decode into the expected type raises ``ProtocolError``
naming the boundary and what was wrong (an ``assert`` would vanish under ``python -O``).

An exception raised in another process arrives as a message (``WorkerError``,
``EngineDead``) carrying its ``ErrorKind``, decided where it was raised by its type, so the
receiver never matches a class name.
"""

from __future__ import annotations

import enum
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


class ErrorKind(enum.Enum):
    """What an exception from another process means to the one that receives it.

    ``CONFIG``: a ``ConfigError``, the user's setting: re-raised as one line naming the flag.
    ``VALUE``: a plain ``ValueError`` (not a subclass), the caller's bad input.
    ``OTHER``: anything else, a failure of the process that raised it.
    """

    CONFIG = "config"
    VALUE = "value"
    OTHER = "other"


def error_kind(e: BaseException) -> ErrorKind:
    """The ``ErrorKind`` of ``e``, by its type (where ``e`` was raised)."""
    from engine.config import ConfigError

    if isinstance(e, ConfigError):
        return ErrorKind.CONFIG
    if type(e) is ValueError:
        return ErrorKind.VALUE
    return ErrorKind.OTHER
