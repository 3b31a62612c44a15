"""What every sub-config shares: ``ConfigError`` and the small field checks.

vLLM's counterpart is ``vllm/config/utils.py`` (its ``config`` decorator and field helpers);
vLLM raises pydantic's ``ValidationError`` where Glassbox raises ``ConfigError``, whose one
line names the CLI flag, the value and what is allowed, so the CLI can print it and exit 2.
"""

from __future__ import annotations

from typing import Any


class ConfigError(ValueError):
    """A configuration value is not allowed.

    ``str(err)`` is one line: ``--flag: invalid value V (allowed: ...)``.
    """

    def __init__(self, flag: str, value: Any, allowed: str) -> None:
        self.flag = flag
        self.value = value
        self.allowed = allowed
        super().__init__(f"{flag}: invalid value {value!r} ({allowed})")

    @classmethod
    def from_message(cls, message: str, flag: str = "") -> ConfigError:
        """Rebuild an error from its one-line message, e.g. after it crossed a process
        boundary (a child found the bad setting during start-up)."""
        err = cls.__new__(cls)
        err.flag, err.value, err.allowed = flag, None, ""
        ValueError.__init__(err, message)
        return err


def check_positive_int(flag: str, value: Any, allow_none: bool = True) -> None:
    """Refuse ``value`` unless it is an ``int`` >= 1 (or ``None`` where ``allow_none``).

    Raises:
        ConfigError: (``flag``) anything else, ``bool`` included.
    """
    if value is None and allow_none:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(flag, value, "must be a positive integer")
