"""The ``--help`` layout of every glassbox subcommand: each option shows its default.

``DefaultsHelpFormatter`` appends ``(default: X)`` to an option's help unless the help
already says what the default is (it mentions "default", or uses ``%(default)s``). Options
whose default is None ("work it out", explained in the help) get nothing appended. The
description and epilog keep their line breaks (``RawDescriptionHelpFormatter``).
"""

from __future__ import annotations

import argparse


class DefaultsHelpFormatter(argparse.RawDescriptionHelpFormatter):
    """argparse's formatter, plus ``(default: X)`` for every option that has a default."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help
        if (
            text is argparse.SUPPRESS
            or not action.option_strings
            or action.default is None
            or action.default is argparse.SUPPRESS
            or isinstance(action, (argparse._HelpAction, argparse._VersionAction))
        ):
            return text
        text = text or ""
        if "%(default)" in text or "default" in text.lower():
            return text
        return f"{text} (default: %(default)s)" if text else "(default: %(default)s)"
