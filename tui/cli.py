"""``engine-top``: the command line (``main(argv) -> int``).

    engine-top                       attach to the one running instance (a list when several run)
    engine-top --run-dir DIR         attach to that instance
    engine-top --once                print one snapshot and exit (1: no instance found)
    engine-top --json                print one snapshot as JSON (LiveState.to_json()) and exit
    engine-top --replay FILE [--speed X]   play a recording (--telemetry-record)
    engine-top --replay FILE --at STEP     the recording as of engine step STEP (with --once /
                                           --json: that state; live: paused there, n/p step)

Errors are one line on stderr, prefixed ``engine-top:``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

from rich.console import Console

from tui import source, views

EPILOG = """\
keys: q quit · ? help · space pause · Tab/0-9/a pick DP engine · s sort requests ·
e expand next panel (Esc: back) · +/- refresh faster/slower · in a replay, n/→ next step,
p/← previous step (the replay stops there; r plays on).
exit status: 0 normal quit; 1 --once/--json found no instance (or could not read it);
2 bad flags. See docs/engine-top.md.
"""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="engine-top",
        description="A live view of a Glassbox instance: its process tree, queues, the token\n"
        "budget of each scheduler step, requests in flight and alerts.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--run-dir", type=Path, metavar="DIR",
                   help="attach to the instance of this run directory (default: the one running "
                        "instance; a list to pick from when several run)")  # fmt: skip
    p.add_argument("--once", action="store_true",
                   help="print one snapshot (to the terminal's width, no full screen) and exit; waits "
                        "at most ~2 s for the first heartbeats")  # fmt: skip
    p.add_argument("--json", action="store_true",
                   help="print one snapshot as JSON (LiveState.to_json()) and exit, for scripts and CI")  # fmt: skip
    p.add_argument("--replay", type=Path, metavar="FILE",
                   help="play a recording written by --telemetry-record instead of attaching")  # fmt: skip
    p.add_argument("--speed", type=float, metavar="X",
                   help="replay speed factor (with --replay): 1 real time (the default), 10 ten times "
                        "faster, 0 as fast as possible; with --once the default is 0 (print the end)")  # fmt: skip
    p.add_argument("--at", type=int, metavar="STEP",
                   help="with --replay: the recording as of engine step STEP (its step record and the "
                        "request events it published); with --once / --json print that state, live "
                        "start paused there (n / p: next / previous step)")  # fmt: skip
    p.add_argument("--refresh", type=float, default=0.5, metavar="SECONDS",
                   help="seconds between screen refreshes (default 0.5, i.e. 2 Hz; +/- change it live)")  # fmt: skip
    return p


def _error(message: str) -> int:
    print(f"engine-top: {message}", file=sys.stderr)
    return 1


def _once(args: argparse.Namespace) -> int:
    if args.at is not None:
        if not args.replay.is_file():
            return _error(f"no recording at {args.replay}")
        try:
            state = source.replay_at(args.replay, args.at)
        except (ValueError, OSError, source.SourceError) as e:
            return _error(str(e))
        return _print(state, args)
    if args.replay is not None:
        # one snapshot of a recording: its end, played as fast as possible unless --speed says
        speed = 0.0 if args.speed is None else args.speed
        opener = lambda: source.open_replay(args.replay, speed)  # noqa: E731
    else:
        run_dir = args.run_dir
        if run_dir is None:
            instances = source.find_instances()
            if not instances:
                base = source.run_dirs.run_dir_base()
                return _error(
                    f"no running Glassbox instance found in {base} (start one, or pass --run-dir DIR)"
                )
            if len(instances) > 1:
                listing = "; ".join(f"{i.run_dir} ({i.describe()})" for i in instances)
                return _error(f"{len(instances)} instances run, choose one with --run-dir: {listing}")
            run_dir = instances[0].run_dir
        elif not run_dir.is_dir():
            return _error(f"no Glassbox instance at {run_dir} (no such directory)")
        opener = lambda: source.open_live(run_dir)  # noqa: E731
    try:
        collector = opener()
    except source.SourceError as e:
        return _error(str(e))
    try:
        state = source.first_snapshot(collector, wait_s=10.0 if args.replay is not None else 2.0)
    except Exception as e:
        return _error(f"cannot read the instance: {e}")
    finally:
        source.close(collector)
    return _print(state, args)


def _print(state, args: argparse.Namespace) -> int:
    if args.json:
        try:
            data = state.to_json()
        except NotImplementedError:
            return _error("--json needs LiveState.to_json(), which this version's collector does not provide")
        print(json.dumps(data, indent=2, default=str))
        return 0
    width = shutil.get_terminal_size((120, 40)).columns
    Console(width=width).print(views.render_once(state, views.ViewOptions(refresh_s=args.refresh), width))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.speed is not None and args.replay is None:
        parser.error("--speed needs --replay FILE")
    if args.speed is not None and args.speed < 0:
        parser.error(f"--speed must be >= 0 (0: as fast as possible), got {args.speed:g}")
    if not args.refresh > 0:
        parser.error(f"--refresh must be > 0 seconds, got {args.refresh:g}")
    if args.replay is not None and args.run_dir is not None:
        parser.error("--replay and --run-dir exclude each other")
    if args.at is not None and args.replay is None:
        parser.error("--at needs --replay FILE")
    if args.once or args.json or not sys.stdout.isatty():  # no terminal to draw on: one snapshot
        return _once(args)

    from tui.app import App, run  # the live screen: termios, threads

    if args.replay is not None and not args.replay.is_file():
        return _error(f"no recording at {args.replay}")
    app = App(
        pinned=args.run_dir,
        replay=args.replay,
        speed=1.0 if args.speed is None else args.speed,
        refresh_s=args.refresh,
    )
    if args.at is not None:
        try:
            app.seek(args.at)
        except (ValueError, OSError, source.SourceError) as e:
            return _error(str(e))
    return run(app)


if __name__ == "__main__":
    sys.exit(main())
