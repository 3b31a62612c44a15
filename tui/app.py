"""engine-top's live loop: snapshot, render, read keys — and never crash or hang.

Three threads of control, none of which waits on the server:

- the collector (``tracing.telemetry.collector``) finds the instance, subscribes and folds
  events in its own thread; we only ask it for a ``snapshot()`` (a consistent copy) once
  per refresh;
- a key reader thread puts the terminal in cbreak mode (keys arrive one by one, unechoed;
  Ctrl-C still raises SIGINT) and waits on stdin with ``select`` so it can stop promptly;
- this loop: it waits for a key or the next refresh, whichever comes first, then redraws
  a Rich ``Live(screen=True)`` (the alternate screen, as htop uses).

The terminal is restored on every way out: ``q``, Ctrl-C, SIGTERM/SIGHUP (turned into
``SystemExit`` so the ``finally`` blocks run) and any exception.

While there is nothing to show, the screen says so and the collector keeps looking: "no
running instance" (searching), a numbered list when several run (choose), "waiting for
DIR" for a ``--run-dir`` that does not exist yet, and the last state with a red line when
the instance is gone.
"""

from __future__ import annotations

import contextlib
import os
import queue
import select
import signal
import sys
import termios
import threading
import time
import tty
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from rich.console import Console, RenderableType
from rich.live import Live

from tracing.telemetry.state import LiveState
from tui import source, views

REFRESH_STEPS = (0.1, 0.2, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0)
RESCAN_S = 1.0  # how often to retry opening the collector after it failed


# ------------------------------------------------------------------------------ keys


def parse_keys(data: bytes) -> list[str]:
    """Bytes read from a cbreak terminal → key names: single characters as themselves,
    ``tab``, ``esc``, ``enter``, ``ctrl-c``, ``up``/``down``/``left``/``right``; other
    escape sequences are dropped."""
    keys: list[str] = []
    text = data.decode("utf-8", errors="ignore")
    i = 0
    arrows = {"A": "up", "B": "down", "C": "right", "D": "left"}
    while i < len(text):
        ch = text[i]
        if ch == "\x1b":
            if i + 1 < len(text) and text[i + 1] in "[O":  # CSI / SS3 sequence
                j = i + 2
                while j < len(text) and not ("@" <= text[j] <= "~"):
                    j += 1
                if j < len(text) and text[j] in arrows:
                    keys.append(arrows[text[j]])
                i = j + 1
                continue
            keys.append("esc")
        elif ch == "\t":
            keys.append("tab")
        elif ch in "\r\n":
            keys.append("enter")
        elif ch == "\x03":
            keys.append("ctrl-c")
        elif ch.isprintable():
            keys.append(ch)
        i += 1
    return keys


class KeyReader:
    """Reads keys from a terminal in a thread while active (a context manager).

    On enter: saves the terminal's attributes and switches to cbreak; on exit (however it
    is left): stops the thread and restores them. Without a terminal on stdin it reads
    nothing and touches nothing.
    """

    def __init__(self, stream: Any = None) -> None:
        self.stream = stream if stream is not None else sys.stdin
        self.keys: queue.Queue[str] = queue.Queue()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._saved: list[Any] | None = None
        self._fd: int | None = None

    def __enter__(self) -> KeyReader:
        try:
            fd = self.stream.fileno()
            is_tty = os.isatty(fd)
        except (AttributeError, OSError, ValueError):
            return self
        if not is_tty:
            return self
        self._fd = fd
        self._saved = termios.tcgetattr(fd)
        tty.setcbreak(fd)
        self._thread = threading.Thread(target=self._run, name="engine-top-keys", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.restore()

    def restore(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=1.0)
            self._thread = None
        if self._saved is not None and self._fd is not None:
            with contextlib.suppress(termios.error, OSError):
                termios.tcsetattr(self._fd, termios.TCSADRAIN, self._saved)
            self._saved = None

    def _run(self) -> None:
        assert self._fd is not None
        while not self._stop.is_set():
            try:
                ready, _, _ = select.select([self._fd], [], [], 0.1)
                if not ready:
                    continue
                data = os.read(self._fd, 64)
            except (OSError, ValueError):
                return
            if not data:  # EOF: the terminal went away
                self.keys.put("eof")
                return
            for key in parse_keys(data):
                self.keys.put(key)


@contextlib.contextmanager
def exit_on_signals() -> Iterator[None]:
    """SIGTERM and SIGHUP raise ``SystemExit(128 + signal)`` in the main thread, so every
    ``finally`` (terminal restore, alternate screen, collector close) runs."""

    def handler(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    saved = {}
    for sig in (signal.SIGTERM, signal.SIGHUP):
        try:
            saved[sig] = signal.signal(sig, handler)
        except (ValueError, OSError):  # not the main thread
            pass
    try:
        yield
    finally:
        for sig, old in saved.items():
            signal.signal(sig, old)


# ------------------------------------------------------------------------------ the app


class App:
    """The state behind the screen: one collector, its snapshots, and what the keys chose.

    The collector does the finding: with no ``--run-dir`` it watches the one running
    instance, says "searching" while there is none and "choose" (with ``candidates``) while
    several run; we then show a numbered list and, on a digit, watch the chosen one. A
    ``--run-dir`` that does not exist yet reads "waiting"; an instance that went away reads
    "gone" (last state kept). ``handle_key`` only changes state, so it is testable without
    a terminal.
    """

    def __init__(
        self,
        *,
        pinned: Path | None = None,
        replay: Path | None = None,
        speed: float = 1.0,
        refresh_s: float = 0.5,
        base: Path | None = None,
        open_live: Callable[[Path | None, Path | None], Any] = source.open_live,
        open_replay: Callable[[Path, float], Any] = source.open_replay,
        replay_at: Callable[[Path, int], LiveState] = source.replay_at,
    ) -> None:
        self.pinned, self.replay, self.speed, self.base = pinned, replay, speed, base
        self.opts = views.ViewOptions(refresh_s=refresh_s)
        self._open_live, self._open_replay, self._replay_at = open_live, open_replay, replay_at
        # A replay stepped by hand (n / p, --at): the state as of this step; None: playing.
        self.at_step: int | None = None
        self.collector: Any = None
        self.state: LiveState | None = None
        self.error: str | None = None  # why there is no collector (retried every RESCAN_S)
        self.quit = False
        self._next_open = 0.0

    # -------------------------------------------------------------- data

    def _open(self) -> None:
        now = time.monotonic()
        if now < self._next_open:
            return
        self._next_open = now + RESCAN_S
        try:
            if self.replay is not None:
                self.collector = self._open_replay(self.replay, self.speed)
            else:
                self.collector = self._open_live(self.pinned, self.base)
            self.error = None
        except Exception as e:  # SourceError, or a collector bug: show it, retry later
            self.collector, self.error = None, str(e)

    def choose(self, run_dir: Path) -> None:
        """Watch ``run_dir`` from now on (picked from the list)."""
        source.close(self.collector)
        self.collector, self.state, self.pinned, self._next_open = None, None, run_dir, 0.0
        self._open()

    def seek(self, step: int) -> None:
        """Show the replay as of engine step ``step`` (``collector.replay_at``) and stop playing
        there. Raises ``ValueError`` when the recording has no such step."""
        assert self.replay is not None, "seek needs a replay"
        self.state = self._replay_at(self.replay, step)
        self.at_step = self.state.replay_step
        self.opts.notice = None

    def step_by(self, delta: int) -> None:
        """The next (+1) or previous (-1) step of the replay; from playing, the step on screen."""
        if self.at_step is None:
            shown = [s.step_id for recs in (self.state.steps.values() if self.state else ()) for s in recs]
            current = max(shown) if shown else 0
            steps = source.recording_steps(self.replay) if self.replay else []
        else:
            current, steps = self.at_step, self.state.replay_steps if self.state else []
        later = [s for s in steps if s > current] if delta > 0 else [s for s in steps if s < current]
        if not later:
            if self.at_step is None and steps:
                self.seek(current if current in steps else steps[-1])
            self.opts.notice = (
                "the last step of the recording" if delta > 0 else "the first step of the recording"
            )
            return
        self.seek(later[0] if delta > 0 else later[-1])

    def poll(self) -> None:
        """Take a fresh snapshot (unless paused, or a replay stepped by hand); (re)open the
        collector when there is none."""
        if self.at_step is not None:
            return
        if self.collector is None:
            self._open()
        if self.collector is None or (self.opts.paused and self.state is not None):
            return
        try:
            self.state = self.collector.snapshot()
            self.opts.notice = None
        except Exception as e:  # keep the last state on screen
            self.opts.notice = f"snapshot failed: {e} — last state shown"

    def close(self) -> None:
        source.close(self.collector)
        self.collector = None

    # -------------------------------------------------------------- keys

    def handle_key(self, key: str) -> None:
        opts = self.opts
        choosing = self.state is not None and self.state.status == "choose"
        if key in ("q", "Q", "ctrl-c", "eof"):
            self.quit = True
        elif choosing and key.isdigit():
            candidates = self.state.candidates if self.state else []
            i = int(key) - 1
            if 0 <= i < len(candidates):
                self.choose(Path(candidates[i]))
        elif key in ("?", "h"):
            opts.show_help = not opts.show_help
        elif key == "esc":
            opts.show_help, opts.expanded = False, None
        elif self.replay is not None and key in ("n", "right", "p", "left"):
            try:
                self.step_by(+1 if key in ("n", "right") else -1)
            except (ValueError, OSError) as e:
                opts.notice = f"cannot step the replay: {e}"
        elif self.replay is not None and key == "r" and self.at_step is not None:
            self.at_step = None  # play on: the collector's state again
        elif key == " ":
            opts.paused = not opts.paused
        elif key == "tab":
            engines = views.engines_of(self.state) if self.state else []
            cycle: list[int | None] = [None, *engines]
            opts.engine = cycle[(cycle.index(opts.engine) + 1) % len(cycle)] if opts.engine in cycle else None
        elif key.isdigit():
            opts.engine = int(key)
        elif key == "a":
            opts.engine = None
        elif key == "s":
            sorts = views.REQUEST_SORTS
            opts.request_sort = sorts[(sorts.index(opts.request_sort) + 1) % len(sorts)]
        elif key == "e":
            panels: list[str | None] = [*views.PANELS, None]
            opts.expanded = panels[(panels.index(opts.expanded) + 1) % len(panels)]
            opts.show_help = False
        elif key in ("+", "="):
            faster = [r for r in REFRESH_STEPS if r < opts.refresh_s]
            opts.refresh_s = faster[-1] if faster else REFRESH_STEPS[0]
        elif key in ("-", "_"):
            slower = [r for r in REFRESH_STEPS if r > opts.refresh_s]
            opts.refresh_s = slower[0] if slower else REFRESH_STEPS[-1]

    # -------------------------------------------------------------- rendering

    def render(self, width: int, height: int) -> RenderableType:
        state = self.state
        if self.opts.show_help and (state is None or state.status in ("searching", "waiting", "choose")):
            return views.render_help()
        if state is None:
            if self.error:
                return views.render_waiting(self.error, f"retrying every {RESCAN_S:g}s; q quits")
            return views.render_waiting("starting the telemetry collector…")
        if state.status == "choose":
            return views.render_picker([(c, _describe(c)) for c in state.candidates[:9]])
        if state.status in ("searching", "waiting"):
            return views.render_waiting(state.message or "looking for a Glassbox instance…", "q quits")
        return views.render_screen(state, self.opts, width, height)


def _describe(run_dir: str) -> str:
    try:
        return source.describe_run_dir(run_dir)
    except Exception:
        return "?"


def run(app: App, console: Console | None = None) -> int:
    """Run the live screen until ``q``, Ctrl-C or a signal. Returns the exit status."""
    console = console or Console()
    status = 0
    try:
        with (
            exit_on_signals(),
            KeyReader() as keys,
            Live(
                console=console, screen=True, auto_refresh=False, redirect_stdout=False, redirect_stderr=False
            ) as live,
        ):
            next_draw = 0.0
            while not app.quit:
                now = time.monotonic()
                if now >= next_draw:
                    app.poll()
                    next_draw = now + app.opts.refresh_s
                size = console.size
                try:
                    screen = app.render(size.width, size.height)
                except Exception as e:  # a view that cannot draw this state must not end the session
                    screen = views.render_waiting(
                        f"engine-top cannot draw this state: {e!r}", "a bug; q quits"
                    )
                live.update(screen, refresh=True)
                try:
                    key = keys.keys.get(timeout=max(0.0, next_draw - time.monotonic()))
                except queue.Empty:
                    continue
                app.handle_key(key)
                while not keys.keys.empty():  # a burst of keys: apply all, then draw once
                    app.handle_key(keys.keys.get_nowait())
    except KeyboardInterrupt:
        status = 0
    except SystemExit as e:
        status = e.code if isinstance(e.code, int) else 1
    finally:
        app.close()
    return status
