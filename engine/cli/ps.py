"""``glassbox ps``: the running Glassbox instances and the processes of each — one view.

The data comes from the instance collector, ``tracing/instances.py``: each run directory's
manifest (the *planned* tree — roles, ranks, the expected process count, A + DP + N plus 1
coordinator when DP > 1) and status files, matched against what psutil sees (state,
parent, uptime, RSS, threads, the ``glassbox::<role>`` title). That answers "is everything
up, and if not, which role is missing and why" without any live telemetry, even when a
process hangs. Processes under a listed pid whose title is not ``glassbox::...``
(multiprocessing's resource tracker, say) are *helpers*: shown apart and never counted.

This module only renders: ``render_table`` (Rich) and ``to_json`` (``--json``), and the
command line. engine-top is another view over the same collector. ``collect_instances``
and ``collect_instance`` here are the collector's, with the engine's topology supplying
the kind of a role the manifest does not describe. vLLM has no such command — its
processes are found with ``ps`` by their ``VLLM::EngineCore`` titles — so this one is ours.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from engine.cli.help_formatter import DefaultsHelpFormatter
from engine.distributed import topology
from engine.utils import run_dir as run_dirs
from tracing import instances as collector
from tracing.instances import COUNTED_KINDS, InstanceInfo, ProcessInfo  # noqa: F401 - re-exported

TITLE_PREFIX = topology.TITLE_PREFIX

DESCRIPTION = """List the running Glassbox instances (one per run directory) and, for each,
its process tree: role, pid, state, current lifecycle stage and time in it, uptime, RSS and
threads, and how each warm worker runs its model (device, dtype, compiled or eager,
attention backend, CPU threads now / its share). Compares the processes found with the count
the manifest expects and names the missing roles. Helper processes (e.g. multiprocessing's
resource tracker) are shown apart and not counted. --all also lists stale run directories
(creator and every process dead: a tree killed all at once) and, on a terminal, offers to
remove them; --clean removes them without asking. Their post-mortems are kept for
glassbox doctor --last."""


# ------------------------------------------------------------------------ data


def collect_instances(base: Path | None = None, include_stale: bool = False) -> list[InstanceInfo]:
    """Every instance under ``base`` (default: the engine's ``run_dir_base()``), oldest first;
    stale ones only with ``include_stale``. ``tracing.instances.collect_instances``, with
    role kinds the manifest leaves out read off the role name by the topology."""
    base = run_dirs.run_dir_base() if base is None else base
    return collector.collect_instances(base, include_stale=include_stale, kind_of=topology.kind_of)


def collect_instance(run_dir: Path) -> InstanceInfo:
    """One run directory matched against the live processes (``tracing.instances.collect_instance``)."""
    return collector.collect_instance(run_dir, kind_of=topology.kind_of)


# ------------------------------------------------------------------------ rendering


def to_json(instances: list[InstanceInfo]) -> dict[str, Any]:
    """The instances as plain JSON data (what ``--json`` prints)."""
    return {"instances": [collector.instance_to_dict(inst) for inst in instances]}


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 60:
        return f"{seconds:.1f}s"
    minutes, s = divmod(int(seconds), 60)
    if minutes < 60:
        return f"{minutes}m{s:02d}s"
    return f"{minutes // 60}h{minutes % 60:02d}m"


RUNS_AS_INDENT = "    "  # a worker's "runs as" phrases past the first line


def wrap_phrases(phrases: list[str], width: int, first_used: int = 0, indent: int = 0) -> list[str]:
    """``phrases`` joined by ", " in lines of at most ``width`` characters, broken only between
    phrases ("brgemm linears up to 128 rows" stays whole): the first line has ``first_used``
    characters before it, the others ``indent``; each line but the last ends with ",". A phrase
    longer than a line gets a line of its own.

    >>> wrap_phrases(["cpu bfloat16", "attention CPU_PAGED_CPP", "2 of 2 CPU threads"], 30, first_used=10)
    ['cpu bfloat16,', 'attention CPU_PAGED_CPP,', '2 of 2 CPU threads']
    """
    lines: list[list[str]] = [[]]
    used = first_used
    for i, phrase in enumerate(phrases):
        piece = phrase + ("," if i < len(phrases) - 1 else "")
        extra = len(piece) + (1 if lines[-1] else 0)
        if lines[-1] and used + extra > width:
            lines.append([])
            used, extra = indent, len(piece)
        lines[-1].append(piece)
        used += extra
    return [" ".join(line) for line in lines]


def _or_dash(value: object) -> str:
    return "-" if value is None else str(value)


def count_line(inst: InstanceInfo) -> str:
    """``processes: found F of expected E``, naming any row that is shown but not counted.

    For an offline ``LLM`` three rows are shown and two counted: ``processes: found 2 of
    expected 2 (not counted: LLM pid 4972, the owner — the process that created the engine)``.
    """
    line = f"processes: found {inst.found_process_count} of expected {_or_dash(inst.expected_process_count)}"
    owners = [p for p in inst.processes if p.is_owner]
    if owners:
        names = ", ".join(f"{p.role} pid {_or_dash(p.pid)}" for p in owners)
        line += f" (not counted: {names}, the owner — the process that created the engine)"
    return line


def render_table(instances: list[InstanceInfo], console) -> None:
    """Print each instance as a Rich table plus its found/expected line (``console``: a Rich Console)."""
    from rich.markup import escape
    from rich.table import Table

    for inst in instances:
        tag = " [red]stale: frontend gone[/red]" if inst.stale else ""
        console.print(
            f"[bold]{escape(str(inst.run_dir))}[/bold]  mode={inst.mode or '?'}  "
            f"frontend pid={_or_dash(inst.frontend_pid)}{tag}"
        )
        for problem in inst.problems:
            console.print(f"  [yellow]{escape(problem)}[/yellow]")
        table = Table(box=None, pad_edge=False, header_style="bold")
        for name in ("ROLE", "PID", "PPID", "STATE", "STAGE", "IN STAGE", "UPTIME", "RSS MiB", "THREADS"):
            table.add_column(
                name,
                no_wrap=True,
                justify="right" if name in ("PID", "PPID", "RSS MiB", "THREADS") else "left",
            )
        for p in inst.processes:
            state = p.state if p.alive else f"[red]{p.state}[/red]"
            if p.stage:
                stage = escape(p.stage)
                if p.pause:  # GLASSBOX_STARTUP_STAGE_DELAY_S: start-up in slow motion
                    stage += escape(f" (paused on purpose: {p.pause['env']}={p.pause['seconds']:g})")
            elif p.last_finished and p.alive:
                stage = f"[dim]idle, after {escape(p.last_finished)}[/dim]"
            else:
                stage = "-"
            role = (
                "  " * p.depth
                + escape(p.role or "?")
                + ("" if p.planned else " [yellow](unplanned)[/yellow]")
                + (" [dim](owner)[/dim]" if p.is_owner else "")
                + (
                    f" [dim]({escape(placed)})[/dim]"
                    if (placed := collector.placement_text(p.placement))
                    else ""
                )
            )
            rss = f"{p.rss_mib:.0f}" if p.rss_mib is not None else "-"
            table.add_row(role, _or_dash(p.pid), _or_dash(p.ppid), state, stage, _duration(p.time_in_stage_s),
                          _duration(p.uptime_s), rss, _or_dash(p.threads))  # fmt: skip
        console.print(table)
        for p in inst.processes:  # how each worker runs its model, once warm
            if p.alive and (parts := collector.runs_as_parts(p.runs_as)):
                head = f"{p.role or '?'} runs as: "
                first, *rest = wrap_phrases(
                    parts, console.width, first_used=len(head), indent=len(RUNS_AS_INDENT)
                )
                console.print(f"{escape(head)}[dim]{escape(first)}[/dim]", soft_wrap=True)
                for line in rest:
                    console.print(f"{RUNS_AS_INDENT}[dim]{escape(line)}[/dim]", soft_wrap=True)
        console.print(escape(count_line(inst)))
        if inst.missing:
            console.print(
                "[red]missing:[/red] " + ", ".join(f"{escape(r)} ({escape(why)})" for r, why in inst.missing)
            )
        if inst.extra:
            console.print(
                "[red]extra:[/red] "
                + ", ".join(
                    f"{escape(p.role or p.title or '?')} (pid {p.pid}, not in the plan)" for p in inst.extra
                )
            )
        if inst.helpers:
            helpers = Table(box=None, pad_edge=False, header_style="bold", title_justify="left",
                            title="helpers (not counted)")  # fmt: skip
            for name in ("PID", "PPID", "STATE", "UPTIME", "RSS MiB", "COMMAND"):
                # One line per helper: Ray's raylet alone has a command line of ~45 wrapped lines.
                helpers.add_column(name, no_wrap=True, overflow="ellipsis" if name == "COMMAND" else "fold")
            for h in inst.helpers:
                rss = f"{h.rss_mib:.0f}" if h.rss_mib is not None else "-"
                helpers.add_row(str(h.pid), _or_dash(h.ppid), h.state, _duration(h.uptime_s), rss,
                                escape(h.title or "?"))  # fmt: skip
            console.print(helpers)
        console.print()


# ------------------------------------------------------------------------ command


def add_subparser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "ps",
        help="List running Glassbox instances and their processes.",
        description=DESCRIPTION,
        formatter_class=DefaultsHelpFormatter,
    )
    p.add_argument("--all", action="store_true", help="Also show stale run directories (frontend gone).")
    p.add_argument("--json", action="store_true", help="Print the same data as JSON.")
    p.add_argument("--run-dir", metavar="DIR", help="Show only this run directory (stale or not).")
    p.add_argument(
        "--clean",
        action="store_true",
        help="Remove the stale run directories (creator and every process dead) without asking, keeping "
        "each one's post-mortem for glassbox doctor --last. With --all on a terminal, ps asks instead.",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from rich.console import Console

    if args.run_dir:
        run_dir = Path(args.run_dir)
        if not run_dir.is_dir():
            parser.error(f"--run-dir: {run_dir} is not a directory")
        instances = [collect_instance(run_dir)]
        hidden = 0
    else:
        everything = collect_instances(include_stale=True)
        instances = [i for i in everything if args.all or not i.stale]
        hidden = len(everything) - len(instances)
    if args.json:
        data = to_json(instances)
        if args.clean:  # removed without asking, as the flag says; listed under "cleaned"
            swept = run_dirs.sweep_stale_run_dirs(run_dirs.run_dir_base(), run_dirs.post_mortem_root())
            data["cleaned"] = [str(d) for d in swept]
        print(json.dumps(data, indent=2))
        return 0
    # Piped output keeps Rich's plain text but must not be squeezed to 80 columns.
    console = Console(file=sys.stdout, highlight=False, width=None if sys.stdout.isatty() else 200)
    if not instances:
        from engine.utils.run_dir import run_dir_base

        # Say where: a server started with another GLASSBOX_RUN_DIR_BASE lives elsewhere.
        console.print(f"no running glassbox instances under {run_dir_base()} (set GLASSBOX_RUN_DIR_BASE "
                      "to where the instance was started)", soft_wrap=True)  # fmt: skip
    else:
        render_table(instances, console)
    if hidden:
        console.print(
            f"[dim]({hidden} stale run director{'y' if hidden == 1 else 'ies'} hidden; --all shows them)[/dim]"
        )
    if args.all or args.clean:
        _offer_clean(console, clean=args.clean, nothing_running=not instances)
    return 0


def _offer_clean(console, *, clean: bool, nothing_running: bool = False) -> None:
    """List the stale run directories (``tracing.run_dir.is_stale``: creator and every process
    dead) and remove them: at once with ``clean``; else after a y/N question when stdin is a
    terminal; else (CI, a pipe) only say which flag does. With none, say so (``either`` after
    ``nothing_running``'s "no running glassbox instances")."""
    base = run_dirs.run_dir_base()
    stale = run_dirs.stale_run_dirs(base)
    if not stale:  # said apart: --all also looked for them, and found none
        console.print(f"no stale run directories under {base} either" if nothing_running
                      else f"no stale run directories under {base}", soft_wrap=True)  # fmt: skip
        return
    n = len(stale)
    words = f"{n} stale run director{'y' if n == 1 else 'ies'}"
    console.print(f"{words} (creator and every process dead):", soft_wrap=True)
    for d in stale:
        console.print(f"  {d}", soft_wrap=True, highlight=False, markup=False)
    if not clean:
        if not (sys.stdin is not None and sys.stdin.isatty()):
            console.print(
                "glassbox ps --all --clean removes them (keeping their post-mortems)", soft_wrap=True
            )
            return
        try:
            answer = input(
                f"remove {'it (keeping its' if n == 1 else 'them (keeping their'} post-mortem)? [y/N] "
            )
        except EOFError:
            answer = ""
        if answer.strip().lower() not in ("y", "yes"):
            return
    kept = run_dirs.post_mortem_root()
    removed = run_dirs.sweep_stale_run_dirs(base, kept)  # each checked again as it goes
    console.print(f"removed {len(removed)} of {n}; post-mortems kept in {kept} (glassbox doctor --last)",
                  soft_wrap=True)  # fmt: skip
