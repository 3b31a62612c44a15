"""engine-top's panels: pure functions from a ``LiveState`` to Rich renderables.

No I/O and no clock here: every age is ``state.now`` minus a time the state holds, so a
test (or a replay) renders the same screen from the same state. ``tui/app.py`` owns the
live loop and the keys and passes what they chose in a ``ViewOptions``.

Panels (``docs/engine-top.md`` explains how to read each one):

- header     model, TP/PP/DP, expected vs found processes, uptime, links, source
- processes  the tree: API servers, each engine core with its workers, the coordinator
- queues     each queue's depth now, with a sparkline of its recent samples
- steps      the scheduler's recent steps: the token budget as a decode/prefill bar
- requests   requests in flight (state, engine, tokens, KV blocks, age), then those just finished
- kv         each engine's KV cache: blocks used, cached (free, still a prefix hit), empty;
             the prefix-cache hit rate; which request holds which blocks
- experts    a mixture of experts: each worker's experts, the rows each took (the load of
             each expert-parallel rank), the time in the all-to-alls (--once shows it only
             for a model with experts)
- alerts     what a person should look at, with a hint of what it usually means
"""

from __future__ import annotations

import io
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from rich import box
from rich.console import Console, Group, RenderableType
from rich.layout import Layout
from rich.padding import Padding
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from tracing.instances import placement_text
from tracing.telemetry.events import (
    GAUGE_API_IN_FLIGHT,
    GAUGE_API_PENDING_OUTPUTS,
    GAUGE_API_WAITING_FOR_ENGINE,
    GAUGE_DP_RUNNING,
    GAUGE_DP_WAVE,
    GAUGE_DUMMY_STEPS,
    GAUGE_INPUT_QUEUE,
    GAUGE_KV_CACHED,
    GAUGE_KV_FREE,
    GAUGE_KV_TOTAL,
    GAUGE_KV_USED,
    GAUGE_MOE_A2A_MS,
    GAUGE_MOE_A2A_TOTAL_S,
    GAUGE_MOE_FIRST_EXPERT,
    GAUGE_MOE_FORWARD_TOTAL_S,
    GAUGE_MOE_LOCAL_EXPERTS,
    GAUGE_MOE_NUM_EXPERTS,
    GAUGE_MOE_STEP_ROWS,
    GAUGE_MQ_READER_PREFIX,
    GAUGE_MQ_WRITTEN,
    GAUGE_OUTPUT_QUEUE,
    GAUGE_PREEMPTED,
    GAUGE_PREFIX_HIT_RATE,
    GAUGE_RUNNING,
    GAUGE_WAITING,
    GAUGE_WAITING_FOR_FSM,
    GAUGE_WORKER_THREADS,
    GAUGE_WORKER_THREADS_MAX,
    StepRecord,
    moe_expert_gauge,
)
from tracing.telemetry.state import (
    FINISHED_KEEP_S,
    GAUGE_MQ_LAG,
    HEARTBEAT_STALE_S,
    IDLE_POLL_WAIT_S,
    INSTANCE_GONE,
    TERMINAL_REQUEST_STATES,
    LiveState,
    ProcessLive,
    RequestLive,
)

# ------------------------------------------------------------------------------ options

PANELS = ("processes", "queues", "steps", "scheduled", "requests", "kv", "experts", "alerts")
REQUEST_SORTS = ("age", "state", "engine", "progress", "blocks", "id")

# Characters of the budget bar: distinct shapes, so it reads without colour too.
DECODE_CHAR, PREFILL_CHAR, UNUSED_CHAR = "█", "▒", "·"
SPARK_CHARS = " ▁▂▃▄▅▆▇█"

_KIND_ORDER = {
    "frontend": 0,
    "headless": 0,
    "api_server": 1,
    "engine_core": 2,
    "worker": 3,
    "dp_coordinator": 4,
}
_DP_IN_ROLE = re.compile(r"_DP(\d+)")
_TRAILING_INT = re.compile(r"(\d+)$")


@dataclass
class ViewOptions:
    """What the keys chose. ``engine``: the DP engine the steps and requests panels show
    (None: all). ``expanded``: one panel of ``PANELS`` shown alone (None: all panels)."""

    engine: int | None = None
    request_sort: str = "age"
    expanded: str | None = None
    show_help: bool = False
    paused: bool = False
    refresh_s: float = 0.5
    notice: str | None = None  # one line under the header (link lost, instance gone ...)


# ------------------------------------------------------------------------------ formatting


def fmt_age(seconds: float | None) -> str:
    """``0.4s``, ``12s``, ``4m05s``, ``2h03m``; ``—`` for unknown."""
    if seconds is None:
        return "—"
    seconds = max(0.0, seconds)
    if seconds < 10:
        return f"{seconds:.1f}s"
    if seconds < 60:
        return f"{seconds:.0f}s"
    if seconds < 3600:
        return f"{int(seconds // 60)}m{int(seconds % 60):02d}s"
    return f"{int(seconds // 3600)}h{int(seconds % 3600 // 60):02d}m"


def fmt_bytes(n: int | None) -> str:
    """``3.0G``, ``512M``, ``64K`` (powers of 1024, as htop); ``—`` for unknown."""
    if n is None:
        return "—"
    for unit, size in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= size:
            v = n / size
            return f"{v:.1f}{unit}" if v < 10 else f"{v:.0f}{unit}"
    return f"{n}B"


def fmt_ms(ms: float) -> str:
    return f"{ms:.0f}" if ms >= 100 else f"{ms:.1f}"


def _known(n: int) -> str:
    return "—" if n is None or n < 0 else str(n)


def sparkline(values: Iterable[float], width: int = 24) -> str:
    """The last ``width`` samples as block characters, scaled to the largest of them (0 = blank)."""
    vals = list(values)[-width:]
    if not vals:
        return ""
    top = max(max(vals), 1e-9)
    steps = len(SPARK_CHARS) - 1
    out = []
    for v in vals:
        i = 0 if v <= 0 else max(1, min(steps, round(v / top * steps)))
        out.append(SPARK_CHARS[i])
    return "".join(out)


def _cells(tokens: int, budget: int, width: int) -> int:
    if tokens <= 0:
        return 0
    return max(1, round(tokens * width / budget))


def budget_bar(step: StepRecord, width: int = 24) -> Text:
    """The step's token budget as ``width`` cells: decode tokens ``█``, prefill tokens ``▒``,
    unused budget ``·``. Each kind that scheduled any token gets at least one cell."""
    if step.dummy:
        return Text("dummy".center(width, UNUSED_CHAR), style="dim italic")
    decode, prefill = max(0, step.num_decode_tokens), max(0, step.num_prefill_tokens)
    budget = max(step.token_budget, decode + prefill, 1)
    d, p = _cells(decode, budget, width), _cells(prefill, budget, width)
    while d + p > width:  # rounding up both can overflow by a cell: take it from the larger
        if d >= p:
            d -= 1
        else:
            p -= 1
    bar = Text()
    bar.append(DECODE_CHAR * d, style="green")
    bar.append(PREFILL_CHAR * p, style="blue")
    bar.append(UNUSED_CHAR * (width - d - p), style="grey42")
    return bar


def budget_legend() -> Text:
    return Text.assemble(
        (DECODE_CHAR, "green"),
        " decode  ",
        (PREFILL_CHAR, "blue"),
        " prefill  ",
        (UNUSED_CHAR, "grey42"),
        " unused",
    )


# ------------------------------------------------------------------------------ the tree


def dp_rank_of(proc: ProcessLive) -> int | None:
    """The DP rank of an engine core or worker: an engine core's ``rank`` (the manifest's),
    else read off the role name (``EngineCore_DP1``, ``Worker_DP1_PP0_TP0``; a worker's
    ``rank`` is its rank inside its engine, not its DP rank)."""
    if proc.kind == "engine_core" and proc.rank is not None:
        return proc.rank
    m = _DP_IN_ROLE.search(proc.role)
    return int(m.group(1)) if m else None


def _natural(role: str) -> tuple[Any, ...]:
    return tuple(int(x) if x.isdigit() else x for x in re.split(r"(\d+)", role))


def process_rows(state: LiveState) -> list[tuple[int, ProcessLive]]:
    """The processes in tree order, each with its depth: the frontend, API servers, each
    engine core followed by its workers (depth 1), the coordinator, then anything else."""
    procs = sorted(state.processes.values(), key=lambda p: (_KIND_ORDER.get(p.kind, 9), _natural(p.role)))
    workers: dict[int | None, list[ProcessLive]] = {}
    for p in procs:
        if p.kind == "worker":
            workers.setdefault(dp_rank_of(p), []).append(p)
    rows: list[tuple[int, ProcessLive]] = []
    placed: set[int | None] = set()
    for p in procs:
        if p.kind == "worker":
            continue
        rows.append((0, p))
        if p.kind == "engine_core":
            rank = dp_rank_of(p)
            placed.add(rank)
            rows.extend((1, w) for w in workers.get(rank, []))
    for rank, ws in workers.items():  # workers whose engine core is not (yet) known
        if rank not in placed:
            rows.extend((0, w) for w in ws)
    return rows


# A process that stepped this recently is serving, not idle, though no stage is open now.
BUSY_WITHIN_S = 1.0


def _stage_text(state: LiveState, p: ProcessLive) -> Text:
    if p.state == "exited":  # a clean stop
        return Text("stopped with the instance" if p.exit_description == INSTANCE_GONE else
                    f"✓ {p.exit_description}", style="dim")  # fmt: skip
    if p.state == "dead":
        # Torn down with an instance that failed: gone, not cleanly, but not at fault either.
        t = Text(f"✗ {p.exit_description or 'exited'}", style="red" if p.torn_down else "bold red")
        if p.stage:
            t.append(f" (in {p.stage})", style="red")
        return t
    if not p.stage:
        if p.state != "running":
            return Text("—", style="dim")
        # No stage open at the moment of the last event, but busy: a worker or engine core
        # between steps (each step's stages last milliseconds), an API server with requests.
        stepping = p.last_step_at is not None and state.now - p.last_step_at < BUSY_WITHIN_S
        in_flight = int(p.gauges.get(GAUGE_API_IN_FLIGHT, 0))
        if stepping:
            return Text("serving (between steps)")
        if in_flight:
            return Text(f"serving {in_flight} request{'s' if in_flight != 1 else ''}")
        return Text("idle", style="dim")
    t = Text()
    if p.stage:
        t.append(p.stage)
        if p.stage_entered_at is not None:
            t.append(f" {fmt_age(state.now - p.stage_entered_at)}", style="cyan")
    return t


def _wait_text(state: LiveState, p: ProcessLive) -> Text | None:
    """The innermost bounded wait, for a row of its own under the process."""
    # Short waits are idle polls repeated by design (a worker between steps): not news.
    waits = [w for w in p.waits if w.timeout_s >= IDLE_POLL_WAIT_S]
    if not waits or p.gone:
        return None
    w = waits[-1]
    waited = fmt_age(state.now - w.started_at)
    # Wrapped, never cut: who is waited for is the news (it once read "… from Worke…").
    return Text(f"⏳ waiting for {w.what}: {waited} of {fmt_age(w.timeout_s)}", style="yellow",
                no_wrap=False, overflow="fold")  # fmt: skip


_STATE_STYLE = {
    "planned": "dim",
    "starting": "yellow",
    "running": "green",
    "stale": "bold yellow",
    "dead": "bold red",
    "exited": "dim",
}


# psutil words worth showing beside our state (a SIGSTOPped process, a zombie, a D-state hang).
_OS_STATES_SHOWN = ("stopped", "tracing-stop", "zombie", "disk-sleep")


def _state_text(p: ProcessLive, state_name: str, stale: bool) -> Text:
    t = Text(state_name + (" ⚠" if stale else ""), style=_STATE_STYLE.get(state_name, ""))
    if p.os_state in _OS_STATES_SHOWN and not p.gone:
        t.append(f" ({p.os_state})", style="bold yellow")
    return t


def _is_stale(state: LiveState, p: ProcessLive) -> bool:
    if p.state == "stale":
        return True
    return (
        p.state in ("starting", "running")
        and p.heartbeat_at is not None
        and state.now - p.heartbeat_at > HEARTBEAT_STALE_S
    )


def render_processes(
    state: LiveState, max_rows: int | None = None, wrap: bool = False, compact: bool = False
) -> RenderableType:
    """The tree, one row per process (``max_rows`` at most, None: all), and under a process
    in a bounded wait a line of its own, across the panel and wrapped, never cut (in the
    stage column it once read "⏳ waiting for execute_model from Worke…").
    ``wrap``: let a long stage or exit description wrap (``--once``) rather than be cut.
    ``compact`` (a narrow terminal): no RSS and thread columns."""
    rows = process_rows(state)
    if not rows:
        return Text("no process seen yet (no manifest, no telemetry)", style="dim")
    shown = rows if max_rows is None or len(rows) <= max_rows else rows[: max(1, max_rows - 1)]
    # Table rows (cells, style), with the lines that go between them (waits, "… N more").
    items: list[tuple[list[Any], str] | RenderableType] = []
    for depth, p in shown:
        stale = _is_stale(state, p)
        state_name = "stale" if stale else p.state
        hb_age = None if p.heartbeat_at is None or p.gone else state.now - p.heartbeat_at
        hb = Text(fmt_age(hb_age))
        if stale:
            hb.append("!", style="bold yellow")
            hb.stylize("bold yellow")
        step_age = Text(fmt_age(None if p.last_step_at is None else state.now - p.last_step_at))
        role = Text(("  └ " if depth else "") + p.role, style="bold" if p.kind == "engine_core" else "")
        row_style = "grey50" if stale or p.state == "planned" or p.gone else ""
        cells: list[Any] = [
            role,
            str(p.pid) if p.pid else "—",
            _state_text(p, state_name, stale),
            _stage_text(state, p),
            "—" if p.cpu_percent is None or p.gone else f"{p.cpu_percent:.0f}",
        ]
        if not compact:
            cells.append("—" if p.gone else fmt_bytes(p.rss_bytes))
            cells.append("—" if p.num_threads is None or p.gone else str(p.num_threads))
        items.append((cells + [hb, step_age], row_style))
        placed = placement_text(p.placement)
        if placed:  # a Ray actor: where Ray put it
            items.append((["", "", "", Text(f"placed as {placed}", style="dim")], ""))
        wait = _wait_text(state, p)
        if wait is not None:  # indented under its process, as a child of the tree
            items.append(Padding(wait, (0, 0, 0, 4 * depth + 4)))
    if len(shown) < len(rows):
        hidden: dict[str, int] = {}
        for _, p in rows[len(shown) :]:
            name = "stale" if _is_stale(state, p) else p.state
            hidden[name] = hidden.get(name, 0) + 1
        what = ", ".join(f"{n} {name}" for name, n in sorted(hidden.items()))
        bad = any(k in hidden for k in ("dead", "stale"))
        items.append(
            Text(f"… {len(rows) - len(shown)} more: {what} (e: expand)", style="bold red" if bad else "dim")
        )
    headers = ["role", "pid", "state", "stage · time in it", "CPU%"]
    headers += [] if compact else ["RSS", "thr"]
    headers += ["beat", "step"]  # heartbeat age; age of the last engine step / forward pass
    return _Fitted(lambda width: _process_tables(items, headers, width, wrap))


def _cells_width(cell: Any) -> int:
    return Text(cell).cell_len if isinstance(cell, str) else cell.cell_len


def _process_tables(items: list, headers: list[str], width: int, wrap: bool) -> RenderableType:
    """The processes' rows as tables with the same column widths (so that they line up), the
    lines between them (a wait) drawn across the whole ``width``."""
    stage = headers.index("stage · time in it")
    widths = [len(h) for h in headers]
    for item in items:
        if isinstance(item, tuple):
            for i, cell in enumerate(item[0]):
                if i != stage:
                    widths[i] = max(widths[i], _cells_width(cell))
    others = sum(w for i, w in enumerate(widths) if i != stage)
    # Between columns: the box's separator and padding 1 either side; 2 cells, not 3, when
    # that leaves the stage too little ("executor.execute_model 0.4s" is 27 cells).
    gap = 3 if width - 3 * (len(headers) - 1) - others >= 28 else 2
    widths[stage] = max(10, width - gap * (len(headers) - 1) - others)
    parts: list[RenderableType] = []
    table: Table | None = None
    for item in items:
        if not isinstance(item, tuple):
            table = None
            parts.append(item)
            continue
        if table is None:
            table = Table(box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False, show_header=not parts,
                          padding=(0, gap - 2, 0, 1))  # fmt: skip
            for i, (header, w) in enumerate(zip(headers, widths)):
                folds = i == stage and wrap
                table.add_column(header, width=w, no_wrap=not folds, overflow="fold" if folds else "ellipsis",
                                 justify="left" if i in (0, 2, stage) else "right")  # fmt: skip
            parts.append(table)
        cells, style = item
        table.add_row(*cells, style=style)
    return Group(*parts)


# ------------------------------------------------------------------------------ queues

# (gauge, label) in the order a request flows: into the API server, to the engine core,
# through the scheduler, back out. Labels are short (15 cells at most) so that they read
# whole in a queues panel half a 100-column screen wide; docs/engine-top.md explains each.
_API_QUEUES = (
    (GAUGE_API_IN_FLIGHT, "HTTP in flight"),
    (GAUGE_API_WAITING_FOR_ENGINE, "→ engine core"),
    (GAUGE_API_PENDING_OUTPUTS, "to stream"),
)
_ENGINE_QUEUES = (
    (GAUGE_INPUT_QUEUE, "input_queue"),
    (GAUGE_WAITING, "waiting"),  # the scheduler's WAITING queue
    # of those, the ones whose structured-output grammar compiles (WAITING_FOR_FSM); shown
    # once a request has waited so (_SHOWN_WHEN_USED)
    (GAUGE_WAITING_FOR_FSM, "waiting grammar"),
    (GAUGE_RUNNING, "running"),  # the scheduler's RUNNING list
    (GAUGE_OUTPUT_QUEUE, "output_queue"),
)
_MQ_LAG = "broadcast lag"
# Queues most runs never use: a row only once the series (or the gauge now) is non-zero.
_SHOWN_WHEN_USED = frozenset({GAUGE_WAITING_FOR_FSM})
# Gauges that are not queues: shown as their own rows (KV, DP wave) or not in this panel.
_NOT_QUEUES = ("kv.", "dp.", "worker.", "sched.preempted", "moe.")


def _series_key(role: str, gauge: str) -> str:
    return f"{role} {gauge}"


def mq_lag(gauges: dict[str, float]) -> float | None:
    """Broadcast-queue lag: messages written minus the slowest reader's position (None
    when this process publishes no broadcast-queue gauges)."""
    if GAUGE_MQ_LAG in gauges:  # derived by the collector
        return gauges[GAUGE_MQ_LAG]
    written = gauges.get(GAUGE_MQ_WRITTEN)
    readers = [v for k, v in gauges.items() if k.startswith(GAUGE_MQ_READER_PREFIX)]
    if written is None or not readers:
        return None
    return max(0.0, written - min(readers))


def _mq_lag_series(state: LiveState, role: str) -> list[float]:
    derived = state.queues.get(_series_key(role, GAUGE_MQ_LAG))
    if derived:
        return list(derived)
    written = list(state.queues.get(_series_key(role, GAUGE_MQ_WRITTEN), ()))
    readers = [list(v) for k, v in state.queues.items() if k.startswith(f"{role} {GAUGE_MQ_READER_PREFIX}")]
    if not written or not readers:
        return []
    n = min(len(written), *(len(r) for r in readers))  # align on the most recent sample
    return [max(0.0, written[-n + i] - min(r[-n + i] for r in readers)) for i in range(n)]


def queue_rows(state: LiveState) -> list[tuple[str, str, float | None, list[float]]]:
    """(process, queue label, depth now, recent samples), in flow order; series of
    ``state.queues`` that no known gauge names come last, under their own name."""
    rows: list[tuple[str, str, float | None, list[float]]] = []
    used: set[str] = set()
    for _, p in process_rows(state):
        if p.kind == "api_server":
            wanted = _API_QUEUES
        elif p.kind == "engine_core":
            wanted = _ENGINE_QUEUES
        else:
            wanted = ()
        for gauge, label in wanted:
            key = _series_key(p.role, gauge)
            series = list(state.queues.get(key, ()))
            used.add(key)
            now = p.gauges.get(gauge, series[-1] if series else None)
            if now is None and not series:
                continue
            if gauge in _SHOWN_WHEN_USED and not now and not any(series):
                continue
            rows.append((p.role, label, now, series))
        lag_series = _mq_lag_series(state, p.role)
        lag = mq_lag(p.gauges)
        if lag is None and lag_series:
            lag = lag_series[-1]
        if lag is not None:
            rows.append((p.role, _MQ_LAG, lag, lag_series))
        used.update(k for k in state.queues if k.startswith(f"{p.role} mq."))
        if p.kind == "engine_core" and GAUGE_KV_USED in p.gauges:
            # blocks held by requests (the pool's size is the steps panel's KV %)
            series = list(state.queues.get(_series_key(p.role, GAUGE_KV_USED), ()))
            rows.append((p.role, "KV blocks", p.gauges[GAUGE_KV_USED], series))
        if p.kind == "engine_core" and GAUGE_KV_CACHED in p.gauges:
            # free blocks that still hold a prefix: hits for a later request, evicted first
            series = list(state.queues.get(_series_key(p.role, GAUGE_KV_CACHED), ()))
            rows.append((p.role, "KV cached", p.gauges[GAUGE_KV_CACHED], series))
        if p.kind == "engine_core" and GAUGE_PREFIX_HIT_RATE in p.gauges:
            # prefix-cache hits / queries since start, in tokens (vLLM's counters), as a percentage
            series = [100 * v for v in state.queues.get(_series_key(p.role, GAUGE_PREFIX_HIT_RATE), ())]
            rows.append((p.role, "prefix hit %", 100 * p.gauges[GAUGE_PREFIX_HIT_RATE], series))
        if p.kind == "worker" and GAUGE_WORKER_THREADS in p.gauges:
            # A CPU worker's threads: fewer than its share while other processes take its CPUs.
            most = p.gauges.get(GAUGE_WORKER_THREADS_MAX)
            label = f"threads (of {int(most)})" if most else "CPU threads"
            series = list(state.queues.get(_series_key(p.role, GAUGE_WORKER_THREADS), ()))
            rows.append((p.role, label, p.gauges[GAUGE_WORKER_THREADS], series))
        moe = moe_rank(p)
        if moe is not None:
            # a mixture of experts: the rows this rank's experts took in the last forward, and
            # (expert parallelism) that forward's time inside the all-to-alls
            series = list(state.queues.get(_series_key(p.role, GAUGE_MOE_STEP_ROWS), ()))
            rows.append((p.role, f"expert rows ({moe.experts})", moe.last_rows, series))
            if moe.expert_parallel:
                series = list(state.queues.get(_series_key(p.role, GAUGE_MOE_A2A_MS), ()))
                rows.append((p.role, "all-to-all ms", moe.last_a2a_ms, series))
        if p.kind == "engine_core" and state.data_parallel_size > 1 and GAUGE_DP_WAVE in p.gauges:
            # the wave this engine is in (runs: every engine steps), and the dummy batches it ran
            running = "runs" if p.gauges.get(GAUGE_DP_RUNNING) else "over"
            series = list(state.queues.get(_series_key(p.role, GAUGE_DP_WAVE), ()))
            rows.append((p.role, f"DP wave ({running})", p.gauges[GAUGE_DP_WAVE], series))
            if GAUGE_DUMMY_STEPS in p.gauges:
                series = list(state.queues.get(_series_key(p.role, GAUGE_DUMMY_STEPS), ()))
                rows.append((p.role, "dummy steps", p.gauges[GAUGE_DUMMY_STEPS], series))
    for key, series in state.queues.items():
        if key in used:
            continue
        role, _, gauge = key.partition(" ")
        if gauge.startswith(_NOT_QUEUES) or role == "DPCoordinator":
            continue
        rows.append((role, gauge or key, series[-1] if series else None, list(series)))
    return rows


class _Fitted:
    """A renderable built for the width it is given when drawn (a panel's inside, a layout's
    region), so that a table can size its columns for the cells it really has."""

    def __init__(self, build: Any) -> None:
        self.build = build  # width in cells -> RenderableType

    def __rich_console__(self, console: Any, options: Any) -> Any:
        yield self.build(options.max_width)


def render_queues(
    state: LiveState, max_rows: int | None = None, spark_width: int = 24, width: int | None = None
) -> RenderableType:
    """One row per queue: process, label, depth now, sparkline of the recent samples (at most
    ``spark_width`` cells). ``width``: the cells the table may take (None: the width it is
    drawn in). The process names, the labels and the values keep their width; the sparkline
    takes what is left, and in a narrow panel the columns are one cell apart instead of three."""
    rows = queue_rows(state)
    if not rows:
        return Text("no queue gauges yet", style="dim")
    if width is None:
        return _Fitted(lambda w: render_queues(state, max_rows, spark_width, w))
    shown = rows if max_rows is None or len(rows) <= max_rows else rows[: max(1, max_rows - 1)]
    depths = ["—" if now is None else f"{now:.0f}" for _, _, now, _ in shown]
    proc_w = min(18, max(len("process"), *(len(role) for role, _, _, _ in shown)))
    label_w = max(len("queue"), *(len(label) for _, label, _, _ in shown))
    now_w = max(len("now"), *(len(d) for d in depths))
    room = width - proc_w - label_w - now_w
    pad = 1 if room - 9 >= min(spark_width, 8) else 0  # 3 cells between columns, else 1
    spark = max(0, min(spark_width, room - (9 if pad else 3)))
    label_w = min(label_w, max(8, label_w + room - (9 if pad else 3)))  # only a raw series name is this long
    table = Table(box=box.SIMPLE_HEAD, expand=True, pad_edge=False, show_edge=False, padding=(0, pad))
    table.add_column("process", no_wrap=True, style="dim", overflow="ellipsis", width=proc_w)
    table.add_column("queue", no_wrap=True, overflow="ellipsis", width=label_w)
    table.add_column("now", justify="right", no_wrap=True, width=now_w)
    table.add_column("recent", no_wrap=True, style="cyan", overflow="crop", ratio=1)
    last_role = None
    for (role, label, now, series), depth in zip(shown, depths):
        table.add_row(role if role != last_role else "", label, Text(depth, style="bold" if now else ""),
                      sparkline(series, spark))  # fmt: skip
        last_role = role
    if len(shown) < len(rows):  # a line of its own, so that it reads whole
        return Group(table, Text(f"… {len(rows) - len(shown)} more (e: expand)", style="dim"))
    return table


# ------------------------------------------------------------------------------ steps


def engines_of(state: LiveState) -> list[int]:
    """Every DP engine index seen: in the steps, or as an engine-core process."""
    found = set(state.steps)
    for p in state.processes.values():
        if p.kind == "engine_core":
            rank = dp_rank_of(p)
            if rank is not None:
                found.add(rank)
    return sorted(found)


def recent_steps(state: LiveState, engine: int | None, n: int) -> list[StepRecord]:
    """The ``n`` latest steps of ``engine`` (all engines when None), newest first."""
    if engine is None:
        steps = [s for recs in state.steps.values() for s in recs]
        steps.sort(key=lambda s: (s.started_at, s.engine_index), reverse=True)
        return steps[:n]
    recs = list(state.steps.get(engine, ()))
    return recs[::-1][:n]


def render_steps(
    state: LiveState, engine: int | None, max_rows: int = 12, bar_width: int = 24, compact: bool = False
) -> RenderableType:
    """Newest step first. ``compact`` (a narrow panel) leaves out requests, the time split and
    the queue lengths after the step."""
    steps = recent_steps(state, engine, max_rows)
    if not steps:
        which = "any engine" if engine is None else f"engine DP{engine}"
        return Text(f"no scheduler step from {which} yet", style="dim")
    table = Table(box=box.SIMPLE_HEAD, expand=True, pad_edge=False, show_edge=False)
    if engine is None:
        table.add_column("DP", justify="right", no_wrap=True)
    table.add_column("step", justify="right", no_wrap=True)
    table.add_column("token budget", no_wrap=True)
    table.add_column("dec+pre/budget", justify="right", no_wrap=True)
    if not compact:
        table.add_column("reqs d/p", justify="right", no_wrap=True)
    table.add_column("KV", justify="right", no_wrap=True)
    table.add_column("preempt", justify="right", no_wrap=True)
    table.add_column("ms", justify="right", no_wrap=True)
    delayed = any(s.step_delay_ms for s in steps)
    if delayed:  # --step-delay-ms: the pause after the step, apart from its own time
        table.add_column("+delay", justify="right", no_wrap=True)
    # Structured outputs: requests sampled under a grammar / waiting for theirs to compile,
    # and the bitmask's time (shown only while a step in view had any).
    grammar = any(s.num_structured_reqs or s.num_waiting_for_fsm for s in steps)
    if grammar:
        table.add_column("grammar", justify="right", no_wrap=True)
    if not compact:
        table.add_column("sched/exec/upd", justify="right", no_wrap=True)
        table.add_column("run/wait", justify="right", no_wrap=True)
    for s in steps:
        tokens = f"{s.num_decode_tokens}+{s.num_prefill_tokens}/{s.token_budget}"
        reqs = f"{s.num_decode_reqs}/{s.num_prefill_reqs}"
        if s.num_chunked_prefills:
            reqs += f" ({s.num_chunked_prefills}c)"
        kv = Text(f"{s.kv_usage * 100:.0f}%", style="red" if s.kv_usage >= 0.9 else "")
        pre = Text(str(s.num_preempted), style="bold red" if s.num_preempted else "dim")
        cells: list[Any] = [str(s.engine_index)] if engine is None else []
        cells += [str(s.step_id), budget_bar(s, bar_width), "dummy" if s.dummy else tokens]
        cells += [] if compact else [reqs]
        cells += [kv, pre, fmt_ms(s.duration_ms)]
        if delayed:
            cells.append(Text(fmt_ms(s.step_delay_ms), style="dim"))
        if grammar:
            cells.append(grammar_cell(s, compact))
        if not compact:
            cells += [
                f"{fmt_ms(s.schedule_ms)}/{fmt_ms(s.execute_ms)}/{fmt_ms(s.update_ms)}",
                f"{s.num_running}/{s.num_waiting}",
            ]
        table.add_row(*cells, style="dim" if s.dummy else "")
    return table


def grammar_cell(step: StepRecord, compact: bool = False) -> Text:
    """``S/F``: S requests sampled under a grammar this step, F waited for theirs to compile;
    with room, `` · M`` the bitmask's milliseconds."""
    text = f"{step.num_structured_reqs}/{step.num_waiting_for_fsm}"
    if not compact and step.num_structured_reqs:
        text += f" · {fmt_ms(step.bitmask_ms)}"
    return Text(text, style="magenta" if step.num_structured_reqs else "dim")


def latest_step(state: LiveState, engine: int | None) -> StepRecord | None:
    """The newest real step of ``engine`` (any engine when None); None before the first."""
    steps = [s for s in recent_steps(state, engine, STEP_SEARCH) if not s.dummy]
    return steps[0] if steps else None


STEP_SEARCH = 16  # how far back latest_step looks past dummy batches


def render_scheduled(state: LiveState, engine: int | None, max_rows: int | None = None) -> RenderableType:
    """The latest step's ``SchedulerOutput``, request by request: who got how many tokens,
    from which computed count, and how many new KV blocks; then the finished ids it hands
    to the workers. A step that scheduled nothing says what it is for."""
    s = latest_step(state, engine)
    if s is None:
        which = "any engine" if engine is None else f"engine DP{engine}"
        return Text(f"no scheduler step from {which} yet", style="dim")
    rows = [("new", r) for r in s.scheduled_new_reqs]
    rows += [("resumed" if r.resumed else "cached", r) for r in s.scheduled_cached_reqs]
    parts: list[RenderableType] = []
    if rows:
        table = Table(box=box.SIMPLE_HEAD, expand=True, pad_edge=False, show_edge=False)
        for name, justify in (("request", "left"), ("as", "left"), ("tokens", "right"), ("kind", "left"),
                              ("computed", "right"), ("new blocks", "right")):  # fmt: skip
            table.add_column(name, justify=justify, no_wrap=True)  # type: ignore[arg-type]
        shown = rows if max_rows is None else rows[: max(1, max_rows)]
        for as_, r in shown:
            after = r.num_computed_tokens + r.num_scheduled_tokens
            kind = "pooling" if r.pooling else "prefill" if r.prefill else "decode"  # pooling: all prefill
            table.add_row(r.req_id, as_, str(r.num_scheduled_tokens), kind,
                          f"{r.num_computed_tokens} → {after}", str(r.num_new_blocks) if r.num_new_blocks else "·",
                          style="blue" if r.prefill else "green")  # fmt: skip
        parts.append(table)
        more = s.num_decode_reqs + s.num_prefill_reqs - len(shown)
        if more > 0:
            parts.append(Text(f"… {more} more scheduled", style="dim"))
    elif s.tokens_scheduled == 0:
        parts.append(Text(EMPTY_STEP_NOTE, style="dim"))
    if s.finished_req_ids:
        ids = ", ".join(s.finished_req_ids[:8]) + (" …" if len(s.finished_req_ids) > 8 else "")
        parts.append(Text(f"finished_req_ids (the workers forget them): {ids}", style="dim"))
    return Group(*parts)


# What a 0+0 step is, wherever one is explained (help, docs/engine-top.md, lesson 6).
EMPTY_STEP_NOTE = (
    "nothing scheduled (0+0): requests finished in the step before, and this step only hands their "
    "finished_req_ids to the workers, which drop their copies (vLLM does the same)"
)


# ------------------------------------------------------------------------------ requests


def _total_tokens(r: RequestLive) -> int:
    if r.num_prompt_tokens < 0:
        return -1
    return r.num_prompt_tokens + max(0, r.num_output_tokens)


def _sort_key(sort: str, now: float):
    def age(r: RequestLive) -> float:
        return now - (r.arrived_at if r.arrived_at is not None else now)

    keys = {
        "age": lambda r: -age(r),  # oldest first
        "state": lambda r: (r.state, -age(r)),
        "engine": lambda r: (r.engine_index, -age(r)),
        "progress": lambda r: (
            r.num_computed_tokens / _total_tokens(r)
            if _total_tokens(r) > 0 and r.num_computed_tokens >= 0
            else -1.0
        ),
        "blocks": lambda r: -r.num_blocks,
        "id": lambda r: _natural(r.request_id),
    }
    return keys.get(sort, keys["age"])


def visible_requests(
    state: LiveState, engine: int | None, sort: str
) -> tuple[list[RequestLive], list[RequestLive]]:
    """The requests of ``engine`` (all when None), in two parts: those in flight, sorted by
    ``sort``, and those finished or aborted in the last ``FINISHED_KEEP_S`` seconds, newest
    first — apart, so the finished never read as in flight (under load they outnumber the
    live ones and once filled an "in flight" panel while the API server said 16)."""
    reqs = [r for r in state.requests.values() if engine is None or r.engine_index == engine]
    live = sorted((r for r in reqs if r.state not in TERMINAL_REQUEST_STATES), key=_sort_key(sort, state.now))
    done = [r for r in reqs if r.state in TERMINAL_REQUEST_STATES]
    done.sort(key=lambda r: -(r.updated_at or 0.0))
    return live, done


_REASON_STATES = ("preempted", "aborted", "finished")
# A reason recorded as a Python repr by an older API server: "EngineDeadError('The engine died; ...".
_REPR_REASON = re.compile(r"^(\w+)\((['\"])(.*?)(\2\))?$")


def reason_words(reason: str | None) -> str | None:
    """A request's reason in plain words, one line: "engine died" for an ``EngineDeadError``
    (also one recorded as its repr, root cause and all), ``Type: message`` for another
    exception's repr, else the reason's first line."""
    if not reason or not reason.strip():
        return None
    if reason.startswith("EngineDeadError"):
        return "engine died"
    line = reason.strip().replace("\\n", "\n").splitlines()[0].strip()
    m = _REPR_REASON.match(line)
    if m:
        line = f"{m.group(1)}: {m.group(3)}".rstrip(": ") if m.group(3) else m.group(1)
    return line


def request_state(r: RequestLive) -> str:
    """The state column: the state, and for a preempted, aborted or finished request why
    ("aborted: engine died", "finished: length", "preempted: KV cache full")."""
    reason = reason_words(r.reason) if r.state in _REASON_STATES else None
    return f"{r.state}: {reason}" if reason else r.state


_REQUEST_STATE_STYLE = {
    "preempted": "bold yellow",
    "aborted": "red",
    "first_token": "green",
    "scheduled": "green",
}
_LONGEST_STATE_WORD = len("first_token")
REQUESTS_COMPACT_BELOW = 90  # a requests table narrower than this drops the out column


def _request_columns(
    rows: list[RequestLive], now: float, show_dp: bool, compact: bool, width: int | None
) -> list[tuple[str, str, int]]:
    """(key, header, width) of each column of the requests tables, so the in-flight and
    the finished tables line up and nothing but an id (from its end) or a reason is ever
    cut: the numbers keep their width, the state word keeps at least ``first_token``'s, and
    the request id gets what is left (at least 8 cells). ``width``: the table's width in
    cells (None: each column as wide as its content)."""
    fixed: list[tuple[str, str, list[str]]] = []
    if show_dp:
        fixed.append(("dp", "DP", [_known(r.engine_index) for r in rows]))
    fixed.append(("tokens", "computed" if compact else "computed/total", [_tokens(r) for r in rows]))
    if not compact:
        fixed.append(("out", "out", [_known(r.num_output_tokens) for r in rows]))
    fixed.append(("blocks", "KV" if compact else "blocks", [_known(r.num_blocks) for r in rows]))
    fixed.append(("age", "age", [_age(r, now) for r in rows]))
    widths = {key: max(len(header), *(len(c) for c in cells)) for key, header, cells in fixed}
    states = [request_state(r) for r in rows]
    s_need = max(len("state"), *(len(s) for s in states)) if states else len("state")
    s_min = min(s_need, max(len("state"), _LONGEST_STATE_WORD))
    q_need = max(len("request"), *(len(r.request_id) for r in rows)) if rows else len("request")
    if width is None:
        s, q = s_need, q_need
    else:
        gaps = (len(fixed) + 1) * _gap(compact)
        avail = width - sum(widths.values()) - gaps
        s, q = s_min, min(q_need, 8)
        rest = avail - s - q
        if rest < 0:
            q = max(4, q + rest)
        else:
            # a state's reason to 20 cells ("finished: length", "aborted: engine died"), a
            # distinguishable id, then the whole state, then the id
            for grow in ("s20", "q14", "s", "q"):
                if grow == "s20":
                    add = min(rest, max(0, min(s_need, 20) - s))
                    s += add
                elif grow == "q14":
                    add = min(rest, max(0, min(q_need, 14) - q))
                    q += add
                elif grow == "s":
                    add = min(rest, s_need - s)
                    s += add
                else:
                    add = rest
                    q += add
                rest -= add
    columns = [("request", "request", q), ("state", "state", s)]
    columns += [(key, header, widths[key]) for key, header, _ in fixed]
    return columns


def _gap(compact: bool) -> int:
    """Cells between two columns of a requests table: the box's separator, and padding 1 on
    either side unless compact."""
    return 1 if compact else 3


def _tokens(r: RequestLive) -> str:
    return f"{_known(r.num_computed_tokens)}/{_known(_total_tokens(r))}"


def _age(r: RequestLive, now: float) -> str:
    return fmt_age(None if r.arrived_at is None else now - r.arrived_at)


def _requests_table(
    rows: list[RequestLive], columns: list[tuple[str, str, int]], now: float, compact: bool, header: bool
) -> Table:
    # Both tables (in flight, finished) draw the same box so that their columns line up.
    table = Table(box=box.SIMPLE_HEAD, show_header=header, pad_edge=False, show_edge=False,
                  padding=(0, 0) if compact else (0, 1))  # fmt: skip
    for key, title, w in columns:
        right = key not in ("request", "state")
        table.add_column(
            title, width=w, no_wrap=True, overflow="ellipsis", justify="right" if right else "left"
        )
    for r in rows:
        done = r.state in TERMINAL_REQUEST_STATES
        values = {
            "request": r.request_id,
            "state": Text(request_state(r), style=_REQUEST_STATE_STYLE.get(r.state, "")),
            "dp": _known(r.engine_index),
            "tokens": _tokens(r),
            "out": _known(r.num_output_tokens),
            "blocks": _known(r.num_blocks),
            "age": _age(r, now),
        }
        table.add_row(*(values[key] for key, _, _ in columns), style="dim" if done else "")
    return table


def render_requests(
    state: LiveState,
    engine: int | None,
    sort: str,
    max_rows: int | None = None,
    compact: bool = False,
    width: int | None = None,
) -> RenderableType:
    """Requests of ``engine`` (all when None): those in flight sorted by ``sort``
    (``REQUEST_SORTS``), then, under a line of their own, those finished in the last
    ``FINISHED_KEEP_S`` seconds (newest first), in at most ``max_rows`` lines (None: all).
    ``compact`` (a narrow panel): no output-token column, shorter headers. ``width``: the
    cells the tables may take (None: as wide as their content). The DP column shows with
    more than one engine, when all are shown."""
    live, done = visible_requests(state, engine, sort)
    which = "" if engine is None else f" on engine DP{engine}"
    if not live and not done:
        return Text(f"no request in flight{which}", style="dim")
    live_shown, done_shown = live, done
    if max_rows is not None:
        budget = max(1, max_rows - (1 if done else 0))  # the finished part's title line
        if len(live) > budget:
            live_shown = live[: max(1, budget - 1)]
        left = max(0, budget - len(live_shown) - (1 if len(live_shown) < len(live) else 0))
        if not live:  # "no request in flight" takes a line (the finished table has the header)
            left = max(0, left - 1)
        done_shown = done[:left]  # the part's title says how many are not shown
    show_dp = engine is None and (
        state.data_parallel_size > 1 or any(r.engine_index > 0 for r in live + done)
    )
    columns = _request_columns(live_shown + done_shown, state.now, show_dp, compact, width)
    parts: list[RenderableType] = []
    if live:
        parts.append(_requests_table(live_shown, columns, state.now, compact, header=True))
        if len(live_shown) < len(live):
            parts.append(Text(f"… {len(live) - len(live_shown)} more in flight (e: expand)", style="dim"))
    else:
        parts.append(Text(f"no request in flight{which}", style="dim"))
    if done:
        title = Text(f"finished in the last {FINISHED_KEEP_S:g}s: {len(done)}", style="bold")
        if len(done_shown) < len(done):
            title.append(f" ({len(done) - len(done_shown)} not shown)", style="dim")
        parts.append(title)
        if done_shown:  # the column headers, unless the table in flight above has them
            header = not live_shown
            parts.append(_requests_table(done_shown, columns, state.now, compact, header=header))
    return Group(*parts)


# ------------------------------------------------------------------------------ alerts


def block_runs(block_ids: Sequence[int]) -> str:
    """Block ids as runs of consecutive ids, in table order: ``[1, 2, 3, 7, 9, 10]`` →
    ``"1-3 7 9-10"``."""
    runs: list[list[int]] = []
    for block_id in block_ids:
        if runs and block_id == runs[-1][1] + 1:
            runs[-1][1] = block_id
        else:
            runs.append([block_id, block_id])
    return " ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def kv_summary(p: ProcessLive) -> dict[str, float] | None:
    """An engine core's KV pool from its gauges: ``total`` usable blocks (the null block is
    not one), ``used`` (held by requests), ``cached`` (free, still holding a prefix: a hit for
    a later request, and the first evicted), ``empty`` (free, no prefix), ``hit_rate``
    (prefix-cache hits / queries since start, tokens), ``preemptions``. None before its
    first KV gauges."""
    g = p.gauges
    if GAUGE_KV_TOTAL not in g:
        return None
    free = g.get(GAUGE_KV_FREE, 0.0)
    cached = g.get(GAUGE_KV_CACHED, 0.0)
    return {
        "total": g[GAUGE_KV_TOTAL],
        "used": g.get(GAUGE_KV_USED, g[GAUGE_KV_TOTAL] - free),
        "cached": cached,
        "empty": max(0.0, free - cached),
        "hit_rate": g.get(GAUGE_PREFIX_HIT_RATE, 0.0),
        "preemptions": g.get(GAUGE_PREEMPTED, 0.0),
    }


def kv_holders(state: LiveState, engine: int | None) -> list[RequestLive]:
    """The requests in flight of ``engine`` (all when None) that hold KV blocks, by their
    first block (the order a person reads a block map in)."""
    live, _ = visible_requests(state, engine, "age")
    holders = [r for r in live if r.block_ids]
    holders.sort(key=lambda r: (r.engine_index, r.block_ids[0]))
    return holders


def render_kv(state: LiveState, engine: int | None, max_rows: int | None = None) -> RenderableType:
    """Per engine core, one line of its pool (used · cached · empty of total, the prefix
    hit rate, preemptions), then which request holds which blocks (ids as runs, ``1-3 7``),
    from the engine's latest snapshot (once a second)."""
    lines: list[RenderableType] = []
    for _, p in process_rows(state):
        if p.kind != "engine_core" or (engine is not None and dp_rank_of(p) != engine):
            continue
        kv = kv_summary(p)
        if kv is None:
            continue
        lines.append(Text.assemble(
            (f"{p.role}  ", "dim"),
            (f"{kv['used']:.0f} used", "bold"), " · ",
            (f"{kv['cached']:.0f} cached", "cyan"), " · ",
            f"{kv['empty']:.0f} empty of {kv['total']:.0f} blocks · ",
            f"prefix hits {100 * kv['hit_rate']:.1f}% · preemptions {kv['preemptions']:.0f}",
        ))  # fmt: skip
    if not lines:
        return Text("no KV gauges yet", style="dim")
    holders = kv_holders(state, engine)
    if not holders:
        return Group(*lines, Text("no request holds a block", style="dim"))
    shown = holders if max_rows is None or len(holders) <= max_rows else holders[: max(1, max_rows - 1)]
    table = Table(box=box.SIMPLE_HEAD, expand=True, pad_edge=False, show_edge=False)
    table.add_column("request", no_wrap=True, overflow="ellipsis", max_width=40)
    if state.data_parallel_size > 1:
        table.add_column("DP", justify="right", no_wrap=True)
    table.add_column("state", no_wrap=True)
    table.add_column("blocks", justify="right", no_wrap=True)
    table.add_column("block ids", overflow="fold", ratio=1)
    for r in shown:
        cells = [r.request_id] + ([str(r.engine_index)] if state.data_parallel_size > 1 else [])
        table.add_row(*cells, request_state(r), str(len(r.block_ids)), block_runs(r.block_ids))
    parts: list[RenderableType] = [*lines, table]
    if len(shown) < len(holders):
        parts.append(Text(f"… {len(holders) - len(shown)} more (e: expand)", style="dim"))
    return Group(*parts)


# ------------------------------------------------------------------------------ experts


@dataclass
class MoERank:
    """One worker's share of a mixture of experts, from its gauges (``GAUGE_MOE_*``).

    ``expert_rows``: (expert id, rows it took since start, all layers), this rank's experts;
    ``last_rows``: rows in the last forward; ``last_a2a_ms``: that forward's time inside
    expert-parallel all-to-alls; ``a2a_share``: all-to-all time / forward time since start."""

    role: str
    first: int
    local: int
    num_experts: int
    expert_rows: list[tuple[int, float]]
    last_rows: float
    last_a2a_ms: float
    a2a_share: float

    @property
    def experts(self) -> str:
        """``0-1 of 4``, ``2 of 4``, or ``all 4``."""
        if self.local >= self.num_experts:
            return f"all {self.num_experts}"
        ids = str(self.first) if self.local == 1 else f"{self.first}-{self.first + self.local - 1}"
        return f"{ids} of {self.num_experts}"

    @property
    def expert_parallel(self) -> bool:
        return self.local < self.num_experts

    @property
    def total_rows(self) -> float:
        return sum(n for _, n in self.expert_rows)


def moe_rank(p: ProcessLive) -> MoERank | None:
    """``p``'s ``MoERank``, or None (not a worker of a mixture of experts)."""
    g = p.gauges
    if p.kind != "worker" or GAUGE_MOE_NUM_EXPERTS not in g:
        return None
    first, local = int(g.get(GAUGE_MOE_FIRST_EXPERT, 0)), int(g.get(GAUGE_MOE_LOCAL_EXPERTS, 0))
    rows = [(e, g.get(moe_expert_gauge(e), 0.0)) for e in range(first, first + local)]
    forward_s = g.get(GAUGE_MOE_FORWARD_TOTAL_S, 0.0)
    share = g.get(GAUGE_MOE_A2A_TOTAL_S, 0.0) / forward_s if forward_s > 0 else 0.0
    return MoERank(p.role, first, local, int(g[GAUGE_MOE_NUM_EXPERTS]), rows, g.get(GAUGE_MOE_STEP_ROWS, 0.0),
                   g.get(GAUGE_MOE_A2A_MS, 0.0), share)  # fmt: skip


def moe_ranks(state: LiveState, engine: int | None = None) -> list[MoERank]:
    """Every worker's ``MoERank`` (of DP engine ``engine`` only, when given), in tree order."""
    return [
        r
        for _, p in process_rows(state)
        if (engine is None or dp_rank_of(p) == engine) and (r := moe_rank(p)) is not None
    ]


def render_experts(
    state: LiveState, engine: int | None, max_rows: int | None = None, width: int | None = None
) -> RenderableType:
    """One row per worker of a mixture of experts: its experts, each one's share of the rows
    its rank took since start, the rank's share of every rank's rows (a bar of five cells: with
    expert parallelism, the load of each rank), the rows of the last forward, and the time
    inside the all-to-alls (the last forward's, and its share of forward time since start).
    ``width``: the cells the table may take (None: the width it is drawn in); below 80 the
    columns are one cell apart instead of three, so that every cell reads whole."""
    ranks = moe_ranks(state, engine)
    if not ranks:
        return Text("no experts: the model is dense (or no worker has reported yet)", style="dim")
    if width is None:
        return _Fitted(lambda w: render_experts(state, engine, max_rows, w))
    everyone = sum(r.total_rows for r in moe_ranks(state)) or 1.0
    shown = ranks if max_rows is None or len(ranks) <= max_rows else ranks[: max(1, max_rows - 1)]
    per_experts = [
        "  ".join(f"e{e} {100 * n / (r.total_rows or 1.0):.0f}%" for e, n in r.expert_rows) for r in shown
    ]
    pad = 1 if width >= 80 else 0
    table = Table(box=box.SIMPLE_HEAD, expand=False, pad_edge=False, show_edge=False, padding=(0, pad))
    table.add_column("worker", no_wrap=True, style="dim")
    table.add_column("experts", no_wrap=True)
    table.add_column("rows by expert", no_wrap=True)
    table.add_column("rank's load", no_wrap=True)
    table.add_column("rows", justify="right", no_wrap=True)
    table.add_column("all-to-all", justify="right", no_wrap=True)
    for r, per_expert in zip(shown, per_experts):
        share = r.total_rows / everyone
        bar = "█" * round(5 * share) + "·" * (5 - round(5 * share))
        a2a = f"{fmt_ms(r.last_a2a_ms)} · {100 * r.a2a_share:.0f}%" if r.expert_parallel else "—"
        table.add_row(r.role, r.experts, per_expert, f"{bar} {100 * share:3.0f}%", f"{r.last_rows:.0f}", a2a)
    if len(shown) < len(ranks):
        return Group(table, Text(f"… {len(ranks) - len(shown)} more (e: expand)", style="dim"))
    return table


def render_alerts(state: LiveState, max_rows: int | None = None) -> RenderableType:
    if not state.alerts:
        return Text("✓ no alerts", style="green")
    order = {"error": 0, "warning": 1}
    alerts = sorted(state.alerts, key=lambda a: order.get(a.severity, 2))
    shown = alerts if max_rows is None or len(alerts) <= max_rows else alerts[: max(1, max_rows - 1)]
    lines: list[RenderableType] = []
    for a in shown:
        style = "bold red" if a.severity == "error" else "bold yellow"
        line = Text.assemble(("✗ ERROR " if a.severity == "error" else "⚠ WARN  ", style))
        if a.role:
            line.append(f"{a.role}: ", style="bold")
        line.append(a.message)
        lines.append(line)
        if a.hint:
            lines.append(Text(f"    hint: {a.hint}", style="italic"))
    if len(shown) < len(alerts):
        lines.append(Text(f"… {len(alerts) - len(shown)} more (e: expand)", style="dim"))
    return Group(*lines)


# ------------------------------------------------------------------------------ header


def _links_summary(state: LiveState) -> Text:
    counts: dict[str, int] = {}
    for p in state.processes.values():
        if p.state == "planned" or p.gone:
            continue
        counts[p.link] = counts.get(p.link, 0) + 1
    if not counts:
        return Text("no link yet", style="yellow")
    styles = {"live": "green", "connecting": "yellow", "stale": "bold yellow", "lost": "bold red"}
    t = Text()
    for link in ("live", "connecting", "stale", "lost"):
        if link in counts:
            if t:
                t.append(" · ")
            t.append(f"{counts[link]} {link}", style=styles[link])
    return t


def events_text(state: LiveState) -> Text:
    """The header's telemetry count: ``events 5,795 · sampled out 33,013 · lost 12``, as
    the publishers' ``Dropped`` reports split what was not received. Sampled out: left out
    on purpose (steps above 50/s, step stages above 10/s per name ...; dim, not a fault).
    Lost: not sent for real (refused by a full socket: a subscriber reading too slowly, or
    failed; red)."""
    t = Text(f"events {state.events_received:,}", style="dim")
    if state.events_sampled:
        t.append(f" · sampled out {state.events_sampled:,}", style="dim")
    if state.events_lost:
        t.append(f" · lost {state.events_lost:,}", style="bold red")
    return t


def _header_row(left: Text, right: Text, width: int, keep: str = "right") -> Text:
    """One header line, ``left`` flush left and ``right`` flush right in ``width`` cells. When
    both do not fit, the one that is not ``keep`` is cut (with an ellipsis), or dropped when
    fewer than 8 of its cells would be left. Each line fits on its own: one long line never
    cuts another (a shared grid column once cut "API servers=2" on a line with room to spare)."""
    left, right = left.copy(), right.copy()
    gap = 2
    if left.cell_len + gap + right.cell_len > width:
        cut, other = (left, right) if keep == "right" else (right, left)
        room = width - gap - other.cell_len
        if room < 8:
            cut.truncate(0)
            other.truncate(width, overflow="ellipsis")
        else:
            cut.truncate(room, overflow="ellipsis")
    line = left
    if right.cell_len:
        line.append(" " * max(gap, width - left.cell_len - right.cell_len))
        line.append_text(right)
    line.no_wrap = True
    return line


def _header_rows(state: LiveState, opts: ViewOptions) -> list[tuple[Text, Text, str]]:
    """The header's lines: (left, right, which of them to keep whole when both do not fit)."""
    title = Text("engine-top", style="bold magenta")
    title.append(f"  {state.model or 'model ?'}", style="bold")
    shape = (
        f"  TP={state.tensor_parallel_size} PP={state.pipeline_parallel_size} DP={state.data_parallel_size}"
    )
    if state.api_server_count:
        shape += f"  API servers={state.api_server_count}"
    title.append(shape)
    right = Text()
    if opts.paused:
        right.append(" PAUSED (still collecting) ", style="bold black on yellow")
        right.append(" ")
    src_style = "bold cyan" if state.source == "replay" else "bold green"
    right.append(state.source.upper(), style=src_style)
    if state.replay_step is not None:
        right.append(f" at step {state.replay_step}", style=src_style)
        if state.replay_steps:
            right.append(f" of {state.replay_steps[0]}..{state.replay_steps[-1]}", style="dim")
    right.append(f"  refresh {opts.refresh_s:g}s", style="dim")
    rows = [(title, right, "right")]

    count = Text("processes ")
    expected = state.expected_count
    if expected is None:
        count.append(f"{state.found_count} found / ? expected", style="yellow")
    else:
        ok = state.found_count == expected
        count.append(f"{state.found_count}/{expected} found", style="bold green" if ok else "bold red")
        if not ok:
            diff = expected - state.found_count
            count.append(f" ({diff} missing)" if diff > 0 else f" ({-diff} unplanned)", style="red")
    count.append("   uptime ")
    count.append(fmt_age(None if state.started_at is None else state.now - state.started_at))
    count.append("   links ")
    count.append_text(_links_summary(state))
    rows.append((count, events_text(state), "left"))

    focus = "all engines" if opts.engine is None else f"engine DP{opts.engine} shown"
    where = state.mode or "?"
    if state.host and state.port:
        where += f" on {state.host}:{state.port}"
    where += f" · run dir {state.run_dir or '—'}"
    # the run dir whole; what is shown is also in the panels' titles
    rows.append((Text(where, style="dim"), Text(f"{focus} · sort {opts.request_sort}", style="dim"), "left"))
    # Span exporters' health, summed over the processes' last heartbeats: a tracer that
    # sends nothing is red here ("otlp 12 dropped, last error 3s ago: ...").
    totals: dict[str, list] = {}  # name → [exported, dropped, queued, last_error_at, last_error]
    for proc in state.processes.values():
        for ex in proc.exporters:
            t = totals.setdefault(ex.name, [0, 0, 0, None, None])
            t[0], t[1], t[2] = t[0] + ex.exported, t[1] + ex.dropped, t[2] + ex.queued
            if ex.last_error_at is not None and (t[3] is None or ex.last_error_at > t[3]):
                t[3], t[4] = ex.last_error_at, ex.last_error
    if totals:
        traces = Text("traces ")
        for i, (name, (sent, dropped, queued, error_at, error)) in enumerate(sorted(totals.items())):
            if i:
                traces.append(" · ", style="dim")
            bad = bool(dropped) or (error_at is not None and sent == 0)
            text = f"{name} {sent} {'sent' if name == 'otlp' else 'written'}, {dropped} dropped"
            if queued:
                text += f", {queued} queued"
            if error_at is not None:
                text += f", last error {fmt_age(state.now - error_at)} ago"
                if error:
                    text += f": {error}"
            traces.append(text, style="bold red" if bad else ("yellow" if error_at is not None else "green"))
        rows.append((traces, Text(), "left"))
    rows += [(line, Text(), "left") for line in _header_lines(state, opts)]
    return rows


def render_header(state: LiveState, opts: ViewOptions) -> RenderableType:
    """Model and shape, source; processes found/expected, uptime, links, events; where it
    runs; span exporters' health (when tracing); the instance gone, a replay's progress, the
    app's notice. One line each, laid out for the width it is drawn in."""
    rows = _header_rows(state, opts)
    return _Fitted(lambda w: Group(*(_header_row(left, right, w, keep) for left, right, keep in rows)))


def _header_lines(state: LiveState, opts: ViewOptions) -> list[Text]:
    """Lines under the header: the instance gone, a replay's progress, the app's notice."""
    lines = []
    if state.status == "gone":
        ended = [p for p in state.processes.values() if p.state != "planned"]
        if ended and all(p.state == "exited" for p in ended):  # a clean stop: nothing went wrong
            lines.append(Text(f"✓ {state.message or 'the instance is gone'}: it stopped cleanly — last state shown",
                              style="green"))  # fmt: skip
        else:
            lines.append(
                Text(f"✗ {state.message or 'the instance is gone'} — last state shown", style="bold red")
            )
    elif state.status in ("replaying", "replay_done") and state.message:
        lines.append(Text(state.message, style="cyan"))
    if opts.notice:
        lines.append(Text(opts.notice, style="bold red"))
    return lines


# ------------------------------------------------------------------------------ help


KEYS: Sequence[tuple[str, str]] = (
    ("q, Ctrl-C", "quit (exit status 0)"),
    ("?", "show / hide this help"),
    ("space", "pause the display (collection goes on; the header says PAUSED)"),
    ("Tab", "next DP engine for the steps and requests panels (… → all → DP0 → DP1 …)"),
    ("0-9", "show DP engine 0-9 in the steps and requests panels"),
    ("a", "show all DP engines again"),
    ("s", "cycle the requests panel's sort: " + " → ".join(REQUEST_SORTS)),
    ("e", "expand the next panel to the whole screen: " + " → ".join(PANELS) + " → all panels"),
    ("Esc", "back to all panels (and close this help)"),
    ("+ / -", "refresh faster / slower (0.1 s to 10 s)"),
    ("n / →, p / ←", "a replay: the next / previous engine step (the replay stops there)"),
    ("r", "a replay stopped at a step: play on"),
)


def render_help() -> RenderableType:
    table = Table(box=box.SIMPLE, show_header=False, pad_edge=False)
    table.add_column(style="bold cyan", no_wrap=True)
    table.add_column()
    for key, what in KEYS:
        table.add_row(key, what)
    legend = Text.assemble("token budget bar: ", budget_legend())
    note = Text(
        "A stale heartbeat (⚠, greyed) means the process stopped answering; a fresh heartbeat with a "
        "growing 'last step' means it is alive but its busy loop stopped (see docs/engine-top.md). "
        "A 0+0 step after requests finish: " + EMPTY_STEP_NOTE.split(": ", 1)[1] + ". '+delay': the "
        "--step-delay-ms pause after a step, not part of its ms. 'grammar' S/F · M: S requests sampled under a "
        "structured-output grammar, F waiting for theirs to compile, M the bitmask's ms.",
        style="dim",
    )
    return Panel(Group(table, legend, note), title="engine-top keys", border_style="cyan")


def footer(opts: ViewOptions) -> Text:
    t = Text(style="dim")
    for key, what in (("q", "quit"), ("?", "help"), ("space", "pause"), ("Tab/0-9", "engine"),
                      ("s", "sort"), ("e", "expand"), ("+/-", "refresh")):  # fmt: skip
        t.append(f" {key}", style="bold")
        t.append(f" {what} ")
    return t


# ------------------------------------------------------------------------------ screens


def _panel(body: RenderableType, title: str, subtitle: str | None = None) -> Panel:
    return Panel(body, title=f"[bold]{title}[/]", title_align="left", subtitle=subtitle,
                 subtitle_align="right", box=box.ROUNDED, padding=(0, 1))  # fmt: skip


def _engine_label(opts: ViewOptions) -> str:
    return "all engines" if opts.engine is None else f"DP{opts.engine}"


# Width of the steps table without its bar (cells, with padding and the panel's border):
# all columns, and the compact set (no requests, no time split, no run/wait).
_STEPS_FIXED, _STEPS_FIXED_COMPACT = 97, 58
_DELAY_COLUMN = 9  # "+delay" and its padding


def panel(
    name: str,
    state: LiveState,
    opts: ViewOptions,
    rows: int | None = None,
    width: int = 120,
    wrap: bool = False,
) -> Panel:
    """One named panel (``PANELS``), about ``width`` cells wide, with ``rows`` table rows at
    most (None: all). ``wrap``: long cells wrap instead of being cut (``--once``)."""
    if name == "processes":
        return _panel(render_processes(state, rows, wrap, compact=width < 100), "processes")
    if name == "queues":
        return _panel(render_queues(state, rows), "queues", "depth now · recent samples")
    if name == "steps":
        # the +delay column (--step-delay-ms), when a step shown has one, takes its cells from the bar
        extra = (
            _DELAY_COLUMN if any(s.step_delay_ms for s in recent_steps(state, opts.engine, rows or 12)) else 0
        )
        compact = width - _STEPS_FIXED - extra < 12
        bar_width = max(10, min(40, width - extra - (_STEPS_FIXED_COMPACT if compact else _STEPS_FIXED)))
        return _panel(
            render_steps(state, opts.engine, rows or 12, bar_width, compact),
            f"scheduler steps · {_engine_label(opts)}",
            budget_legend().markup,
        )
    if name == "scheduled":
        s = latest_step(state, opts.engine)
        title = "scheduled" if s is None else f"step {s.step_id}: SchedulerOutput"
        if s is not None and opts.engine is None and len(state.steps) > 1:
            title += f" · DP{s.engine_index}"
        return _panel(render_scheduled(state, opts.engine, rows), title, "num_scheduled_tokens per request")
    if name == "requests":
        live, done = visible_requests(state, opts.engine, opts.request_sort)
        body = render_requests(state, opts.engine, opts.request_sort, rows, compact=width < REQUESTS_COMPACT_BELOW,
                               width=width - 4)  # fmt: skip
        title = f"requests · {len(live)} in flight"  # as the API server's "HTTP in flight" counts
        if done:
            title += f", {len(done)} finished"
        if opts.engine is not None:
            title += f" · DP{opts.engine}"
        return _panel(body, title, f"sort: {opts.request_sort}")
    if name == "kv":
        return _panel(render_kv(state, opts.engine, rows), f"KV cache · {_engine_label(opts)}",
                      "cached: free, still a prefix hit")  # fmt: skip
    if name == "experts":
        return _panel(render_experts(state, opts.engine, rows), f"experts · {_engine_label(opts)}",
                      "all-to-all: last forward · share of forward time")  # fmt: skip
    if name == "alerts":
        n = len(state.alerts)
        return _panel(render_alerts(state, rows), f"alerts ({n})" if n else "alerts")
    raise ValueError(f"no panel {name!r}")


def render_once(state: LiveState, opts: ViewOptions | None = None, width: int = 120) -> RenderableType:
    """Every panel stacked, full length (the 8 latest steps): what ``engine-top --once`` prints."""
    opts = opts or ViewOptions()
    parts: list[RenderableType] = [_panel(render_header(state, opts), "glassbox")]
    parts += [
        panel(name, state, opts, rows=8 if name == "steps" else None, width=width, wrap=True)
        for name in PANELS
        if name != "experts" or moe_ranks(state)  # a dense model has no experts panel
    ]
    return Group(*parts)


def _height(renderable: RenderableType, width: int) -> int:
    """The lines ``renderable`` takes drawn ``width`` cells wide (rendered in memory)."""
    console = Console(width=width, file=io.StringIO(), color_system=None, force_terminal=False)
    return len(console.render_lines(renderable, console.options, pad=False))


def _fitted_processes(state: LiveState, opts: ViewOptions, width: int, most: int) -> tuple[Panel, int]:
    """The processes panel for a ``width``-wide screen, at most ``most`` lines high, and its
    height: measured, as a wait line under a process wraps (and a Ray actor's placement takes
    a line). Rows that do not fit give way to the "… N more" line."""
    full = panel("processes", state, opts, width=width)
    height = _height(full, width)
    if height <= most:
        return full, height
    rows = max(1, most - 4)  # 4: the borders, the header and its rule
    while True:
        cut = panel("processes", state, opts, rows=rows, width=width)
        if rows == 1 or _height(cut, width) <= most:
            return cut, most
        rows -= 1


def render_screen(state: LiveState, opts: ViewOptions, width: int = 120, height: int = 40) -> RenderableType:
    """The full-screen view of the live loop, laid out for a ``width`` × ``height`` terminal.

    Wide (≥ 160 cells): processes; steps beside queues; requests beside alerts. Narrower:
    processes; steps across the width; queues beside requests; alerts as a strip. ``e``
    shows one panel alone, ``?`` the help, in the body.
    """
    layout = Layout()
    header = _panel(render_header(state, opts), "glassbox")
    header_h = 2 + len(_header_rows(state, opts))  # the panel's borders and one row a line
    layout.split_column(Layout(header, name="header", size=header_h), Layout(name="body"),
                        Layout(footer(opts), name="footer", size=1))  # fmt: skip
    body = layout["body"]
    body_h = max(3, height - header_h - 1)
    if opts.show_help:
        body.update(render_help())
        return layout
    if opts.expanded:
        body.update(panel(opts.expanded, state, opts, rows=max(1, body_h - 4), width=width))
        return layout
    n_alerts = len(state.alerts)
    procs_panel, proc_h = _fitted_processes(state, opts, width, max(6, body_h * 2 // 5))
    procs = Layout(procs_panel, size=proc_h)
    if width >= 160:
        rest = body_h - proc_h
        mid_h = max(6, rest * 3 // 5)
        low_h = max(4, rest - mid_h)
        mid, low = Layout(name="mid", size=mid_h), Layout(name="low", size=low_h)
        body.split_column(procs, mid, low)
        mid.split_row(
            Layout(panel("steps", state, opts, rows=mid_h - 4, width=width * 2 // 3), ratio=2),
            Layout(panel("queues", state, opts, rows=mid_h - 4, width=width // 3), ratio=1),
        )
        low.split_row(
            Layout(panel("requests", state, opts, rows=low_h - 4, width=width * 3 // 5), ratio=3),
            Layout(
                panel("alerts", state, opts, rows=max(1, (low_h - 2) // 2), width=width * 2 // 5), ratio=2
            ),
        )
        return layout
    alerts_h = 3 if not n_alerts else min(2 * n_alerts, 6) + 2
    rest = body_h - proc_h - alerts_h
    mid_h = max(5, rest // 2)
    low_h = max(4, rest - mid_h)
    low = Layout(name="low", size=low_h)
    body.split_column(
        procs,
        Layout(panel("steps", state, opts, rows=mid_h - 4, width=width), size=mid_h),
        low,
        Layout(panel("alerts", state, opts, rows=max(1, (alerts_h - 2) // 2), width=width), size=alerts_h),
    )
    low.split_row(
        Layout(panel("queues", state, opts, rows=low_h - 4, width=width // 2), ratio=1),
        Layout(panel("requests", state, opts, rows=low_h - 4, width=width // 2), ratio=1),
    )
    return layout


def render_waiting(message: str, detail: str | None = None) -> RenderableType:
    """The screen while there is nothing to attach to (no instance yet, or it is gone)."""
    body = Text(message, style="bold yellow")
    if detail:
        body.append("\n" + detail, style="dim")
    return Panel(body, title="[bold magenta]engine-top[/]", border_style="yellow", padding=(1, 2))


def render_picker(instances: Sequence[tuple[str, str]]) -> RenderableType:
    """The list to pick an instance from: (run dir, description) pairs, numbered from 1."""
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False)
    table.add_column("#", justify="right", style="bold cyan")
    table.add_column("run directory")
    table.add_column("instance")
    for i, (path, what) in enumerate(instances, 1):
        table.add_row(str(i), path, what)
    hint = Text("press 1-9 to attach, q to quit (or pass --run-dir DIR)", style="dim")
    return Panel(Group(Text("several Glassbox instances run; pick one:", style="bold"), table, hint),
                 title="[bold magenta]engine-top[/]", border_style="cyan")  # fmt: skip
