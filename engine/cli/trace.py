"""``glassbox trace FILE``: read a JSON-lines span file and draw a trace as a waterfall.

The way to read a trace with no Jaeger at hand. ``--trace-file FILE`` (``serve``,
``generate``, ``LLM(trace_file=...)`` or ``GLASSBOX_TRACE_FILE``) makes every process of the
tree append each finished span to FILE as one JSON line (``tracing.exporters.span_to_dict``).
This command groups those lines by trace id and:

- ``--list`` (the default): one row per trace — its kind, root span, request id, start,
  duration, span count and the processes it crosses. Step traces (one per engine step) are
  summed up in one line unless ``--all``.
- ``--startup``: the latest start-up trace (or ``--trace-id``'s) as a waterfall: one lane
  per process and thread, each span a bar on a shared time axis, indented by nesting inside
  its lane, with its duration; the span with the most *own time* (its duration less the time
  its children cover, in any process) is marked as the slowest stage.
- ``--request ID``: the same for one request (``gen_ai.request.id``, or a trace-id prefix).
- ``--steps``: the engine steps that scheduled prompt tokens and each request's time to first
  token split into before the engine, waiting and prefill (``engine/cli/trace_steps.py``).
- ``--json``: the selected trace's span tree (or the list) as JSON.

The kind of a trace is read off its root span's level in the span catalogue
(``tracing.catalogue``): lifecycle → start-up (shutdown when the root is a shutdown stage),
step → step, request → request; a root that is not in the catalogue makes a request trace
when a span carries ``gen_ai.request.id``, else "other". No span name is hard-coded here,
so spans added to the catalogue later are drawn as they come.

The reader is lenient: a truncated last line (a process killed mid-write) and lines that
are not spans are counted and reported, never fatal. Spans whose parent is not in the file
(a caller's ``traceparent``, or a parent that never ended because its process died) become
roots of their trace.

vLLM has no counterpart (its traces go to an OTLP collector only); this is Glassbox's own.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.cli.help_formatter import DefaultsHelpFormatter
from tracing import catalogue

DESCRIPTION = """Read a JSON-lines span file (written by --trace-file or GLASSBOX_TRACE_FILE) and
show its traces: --list (the default) lists them; --startup draws the latest start-up, and
--request ID one request, as a waterfall — one lane per process and thread, spans as bars on
a shared time axis, the slowest stage marked. A truncated last line and lines that are not
spans are skipped and counted."""

EXIT_STATUS = """exit status:
  0    shown
  2    a bad flag, no such file, or no such trace (one line)"""

START_UP, SHUTDOWN, REQUEST, STEP, OTHER = "start-up", "shutdown", "request", "step", "other"
ATTR_REQUEST_ID = catalogue.ATTR_GEN_AI_REQUEST_ID

_LEVEL_STYLE = {catalogue.LIFECYCLE: "cyan", catalogue.STEP: "green", catalogue.REQUEST: "yellow"}


# ------------------------------------------------------------------------ data


@dataclass(eq=False)
class Span:
    """One span line of the file (the fields of ``tracing.exporters.span_to_dict``)."""

    name: str
    trace_id: str
    span_id: str
    parent_id: str | None
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    status: str
    status_description: str | None
    kind: str
    role: str | None
    pid: int | None
    rank: int | None
    thread: str | None
    # The spans this one points at in other traces (trace_id, span_id): a request's
    # request.prefill / request.decode link the engine_core.step spans that computed them.
    links: list[tuple[str, str]] = field(default_factory=list)
    children: list[Span] = field(default_factory=list)
    parent: Span | None = None

    @property
    def duration_ns(self) -> int:
        return max(0, self.end_ns - self.start_ns)

    @property
    def level(self) -> str | None:
        """The catalogue level (lifecycle / step / request), None for a name not in it."""
        spec = catalogue.SPANS.get(self.name)
        return spec.level if spec is not None else None

    @property
    def process(self) -> tuple[str, int | None]:
        return (self.role or "?", self.pid)

    @property
    def lane(self) -> tuple[str, int | None, str | None]:
        """(role, pid, thread): the row group the span is drawn in."""
        return (self.role or "?", self.pid, self.thread)

    def own_ns(self) -> int:
        """Duration less the union of the children's intervals (clipped to this span)."""
        spans = sorted((max(c.start_ns, self.start_ns), min(c.end_ns, self.end_ns)) for c in self.children)
        covered, cur_s, cur_e = 0, None, None
        for s, e in spans:
            if e <= s:
                continue
            if cur_e is None or s > cur_e:
                if cur_e is not None:
                    covered += cur_e - cur_s
                cur_s, cur_e = s, e
            else:
                cur_e = max(cur_e, e)
        if cur_e is not None:
            covered += cur_e - cur_s
        return max(0, self.duration_ns - covered)


@dataclass(eq=False)
class Trace:
    """The spans of one trace id, linked into a tree."""

    trace_id: str
    spans: list[Span]  # by start time
    roots: list[Span]  # spans whose parent is not in the file, by start time

    @property
    def root(self) -> Span:
        """The earliest root (the longest, on a tie)."""
        return min(self.roots, key=lambda s: (s.start_ns, -s.duration_ns))

    @property
    def start_ns(self) -> int:
        return min(s.start_ns for s in self.spans)

    @property
    def end_ns(self) -> int:
        return max(s.end_ns for s in self.spans)

    @property
    def duration_ns(self) -> int:
        return max(0, self.end_ns - self.start_ns)

    @property
    def request_id(self) -> str | None:
        """``gen_ai.request.id`` of the root, else of the first span that has one."""
        for s in [self.root, *self.spans]:
            value = s.attributes.get(ATTR_REQUEST_ID)
            if value is not None:
                return str(value)
        return None

    @property
    def kind(self) -> str:
        """start-up / shutdown / request / step / other, by the root's catalogue level."""
        root = self.root
        level = root.level
        if level == catalogue.LIFECYCLE:
            return SHUTDOWN if "shutdown" in root.name else START_UP
        if level == catalogue.REQUEST:
            return REQUEST
        if level == catalogue.STEP:
            return STEP
        return REQUEST if self.request_id is not None else OTHER

    @property
    def processes(self) -> list[str]:
        """Role names of the processes with a span in the trace, in order of first span."""
        seen: dict[tuple[str, int | None], None] = {}
        for s in self.spans:
            seen.setdefault(s.process, None)
        return [role for role, _ in seen]

    @property
    def remote_parent(self) -> str | None:
        """The parent span id of the root when that parent is not in the file (a caller's)."""
        return self.root.parent_id

    def slowest(self) -> Span:
        """The span with the most own time (ties: the earlier). Spans that only frame the
        whole trace from the API server's side (``api_server.request``, ``llm_request``:
        their work happens in other processes' spans, not their children) are passed over
        when anything else is there."""
        from tracing import catalogue

        framing = {catalogue.API_SERVER_REQUEST, catalogue.LLM_REQUEST}
        candidates = [s for s in self.spans if s.name not in framing] or self.spans
        return max(candidates, key=lambda s: (s.own_ns(), -s.start_ns))


@dataclass
class SpanFile:
    """What ``load`` read: the traces, and what it could not read."""

    path: str
    traces: list[Trace]  # by start time
    num_spans: int
    skipped_lines: int = 0  # lines that are not spans (bad JSON, missing fields)
    truncated_last_line: bool = False  # the file ends inside a line
    duplicate_spans: int = 0


def _int_or_none(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _parse_span(data: Any) -> Span | None:
    if not isinstance(data, dict):
        return None
    name, trace_id, span_id = data.get("name"), data.get("trace_id"), data.get("span_id")
    start, end = _int_or_none(data.get("start_ns")), _int_or_none(data.get("end_ns"))
    if not (isinstance(name, str) and isinstance(trace_id, str) and isinstance(span_id, str)):
        return None
    if start is None or end is None:
        return None
    parent = data.get("parent_span_id")
    attributes = data.get("attributes") if isinstance(data.get("attributes"), dict) else {}
    resource = data.get("resource") if isinstance(data.get("resource"), dict) else {}
    # The thread: a top-level "thread" field, the resource's, or the OTel semconv attribute.
    thread = data.get("thread") or resource.get("thread") or attributes.get("thread.name")
    # The resource's OpenTelemetry keys (glassbox.role, ...); files written before they were
    # used there have the bare role / pid / rank.
    role = resource.get(catalogue.ATTR_ROLE) or resource.get("role") or attributes.get(catalogue.ATTR_ROLE)
    pid = resource.get(catalogue.ATTR_PID, resource.get("pid"))
    rank = resource.get(catalogue.ATTR_RANK, resource.get("rank"))
    return Span(
        name=name,
        trace_id=trace_id.lower(),
        span_id=span_id.lower(),
        parent_id=parent.lower() if isinstance(parent, str) and parent else None,
        start_ns=start,
        end_ns=max(end, start),
        attributes=attributes,
        status=str(data.get("status") or "UNSET"),
        status_description=data.get("status_description"),
        kind=str(data.get("kind") or "INTERNAL"),
        role=str(role) if role is not None else None,
        pid=_int_or_none(pid),
        rank=_int_or_none(rank),
        thread=str(thread) if thread else None,
        links=_parse_links(data.get("links")),
    )


def _parse_links(value: Any) -> list[tuple[str, str]]:
    links = []
    for link in value if isinstance(value, list) else []:
        if (
            isinstance(link, dict)
            and isinstance(link.get("trace_id"), str)
            and isinstance(link.get("span_id"), str)
        ):
            links.append((link["trace_id"].lower(), link["span_id"].lower()))
    return links


def load(path: str | Path) -> SpanFile:
    """Read the JSON-lines span file at ``path`` into traces.

    Raises:
        OSError: the file cannot be read (missing, a directory, no permission).
    """
    raw = Path(path).read_bytes()
    text = raw.decode("utf-8", errors="replace")
    lines = text.split("\n")
    ends_inside_a_line = bool(lines) and lines[-1] != ""
    result = SpanFile(path=str(path), traces=[], num_spans=0)
    by_trace: dict[str, dict[str, Span]] = {}
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            span = _parse_span(json.loads(line))
        except ValueError:
            span = None
        if span is None:
            if ends_inside_a_line and i == len(lines) - 1:
                result.truncated_last_line = True
            else:
                result.skipped_lines += 1
            continue
        spans = by_trace.setdefault(span.trace_id, {})
        if span.span_id in spans:
            result.duplicate_spans += 1
            continue
        spans[span.span_id] = span
        result.num_spans += 1
    for trace_id, spans in by_trace.items():
        roots = []
        for span in spans.values():
            parent = spans.get(span.parent_id) if span.parent_id else None
            if parent is None or parent is span:
                roots.append(span)
            else:
                span.parent = parent
                parent.children.append(span)
        ordered = sorted(spans.values(), key=lambda s: (s.start_ns, -s.duration_ns))
        for span in ordered:
            span.children.sort(key=lambda s: (s.start_ns, -s.duration_ns))
        roots.sort(key=lambda s: (s.start_ns, -s.duration_ns))
        result.traces.append(Trace(trace_id, ordered, roots))
    result.traces.sort(key=lambda t: t.start_ns)
    return result


# ------------------------------------------------------------------------ selection


class TraceNotFound(LookupError):
    """No trace (or more than one) matches what was asked for; the message says which."""


def _by_trace_id(traces: list[Trace], prefix: str) -> list[Trace]:
    prefix = prefix.lower()
    return [t for t in traces if t.trace_id.startswith(prefix)]


def select(
    span_file: SpanFile,
    *,
    startup: bool = False,
    request: str | None = None,
    trace_id: str | None = None,
) -> Trace:
    """The trace to draw: the latest start-up, a request's, or the one ``trace_id`` names.

    Raises:
        TraceNotFound: nothing matches, or a trace-id prefix matches several traces.
    """
    traces = span_file.traces
    where = f"in {span_file.path}"
    if request is not None:
        matches = [t for t in traces if any(str(s.attributes.get(ATTR_REQUEST_ID)) == request for s in t.spans
                                            if ATTR_REQUEST_ID in s.attributes)]  # fmt: skip
        if not matches:
            matches = _by_trace_id(traces, request)
            if len(matches) > 1:
                raise TraceNotFound(
                    f"--request {request}: trace id prefix matches {len(matches)} traces {where}"
                )
        if not matches:
            raise TraceNotFound(f"--request {request}: no trace with that request id or trace id {where}")
        return matches[-1]  # a request id seen in several runs appended to one file: the latest
    candidates = traces
    if trace_id is not None:
        candidates = _by_trace_id(traces, trace_id)
        if not candidates:
            raise TraceNotFound(f"--trace-id {trace_id}: no such trace {where}")
    if startup:
        startups = [t for t in candidates if t.kind == START_UP]
        if not startups:
            what = f"trace {trace_id} is not a start-up trace" if trace_id else "no start-up trace"
            raise TraceNotFound(f"--startup: {what} {where} (--list shows what it holds)")
        return startups[-1]
    if len(candidates) > 1:
        raise TraceNotFound(
            f"--trace-id {trace_id}: matches {len(candidates)} traces {where}; give more digits"
        )
    if not candidates:
        raise TraceNotFound(f"no traces {where}")
    return candidates[0]


# ------------------------------------------------------------------------ JSON


def _span_json(span: Span, t0: int) -> dict[str, Any]:
    return {
        "name": span.name,
        "span_id": span.span_id,
        "parent_span_id": span.parent_id,
        "level": span.level,
        "role": span.role,
        "pid": span.pid,
        "rank": span.rank,
        "thread": span.thread,
        "start_ns": span.start_ns,
        "end_ns": span.end_ns,
        "offset_ms": round((span.start_ns - t0) / 1e6, 3),
        "duration_ms": round(span.duration_ns / 1e6, 3),
        "own_ms": round(span.own_ns() / 1e6, 3),
        "status": span.status,
        "attributes": span.attributes,
        "links": [{"trace_id": t, "span_id": i} for t, i in span.links],
        "children": [_span_json(c, t0) for c in span.children],
    }


def trace_summary(trace: Trace) -> dict[str, Any]:
    """One trace's row of ``--list`` as JSON data."""
    return {
        "trace_id": trace.trace_id,
        "kind": trace.kind,
        "root": trace.root.name,
        "request_id": trace.request_id,
        "start_ns": trace.start_ns,
        "duration_ms": round(trace.duration_ns / 1e6, 3),
        "num_spans": len(trace.spans),
        "processes": trace.processes,
    }


def linked_traces(trace: Trace, span_file: SpanFile | None) -> list[tuple[Span, str, Trace | None]]:
    """``(span, linked trace id, that trace or None when not in the file)`` for each link of
    each of ``trace``'s spans, in span start order: a request's step traces."""
    by_id = {t.trace_id: t for t in span_file.traces} if span_file is not None else {}
    return [(s, t, by_id.get(t)) for s in trace.spans for t, _ in s.links]


def trace_to_json(trace: Trace, span_file: SpanFile | None = None) -> dict[str, Any]:
    """The trace's span tree (``--json`` with ``--startup``, ``--request`` or ``--trace-id``),
    and the traces its spans link to (``linked_traces``; root and duration when in the file)."""
    slowest = trace.slowest()
    return {
        **trace_summary(trace),
        "remote_parent_span_id": trace.remote_parent,
        "slowest": {
            "name": slowest.name,
            "span_id": slowest.span_id,
            "role": slowest.role,
            "own_ms": round(slowest.own_ns() / 1e6, 3),
        },
        "linked_traces": [
            {
                "from": span.name,
                "trace_id": trace_id,
                "kind": linked.kind if linked is not None else None,
                "root": linked.root.name if linked is not None else None,
                "duration_ms": round(linked.duration_ns / 1e6, 3) if linked is not None else None,
            }
            for span, trace_id, linked in linked_traces(trace, span_file)
        ],
        "spans": [_span_json(r, trace.start_ns) for r in trace.roots],
    }


def file_to_json(span_file: SpanFile) -> dict[str, Any]:
    """``--list --json``: every trace, and what could not be read."""
    return {
        "file": span_file.path,
        "num_spans": span_file.num_spans,
        "skipped_lines": span_file.skipped_lines,
        "truncated_last_line": span_file.truncated_last_line,
        "traces": [trace_summary(t) for t in span_file.traces],
    }


# ------------------------------------------------------------------------ rendering


def fmt_duration(ns: float) -> str:
    """A duration in at most 8 characters: ``740 µs``, ``7.22 ms``, ``388.6 ms``, ``2.24 s``."""
    ms = ns / 1e6
    if ms < 1:
        return f"{ms * 1000:.0f} µs"
    if ms < 10:
        return f"{ms:.2f} ms"
    if ms < 1000:
        return f"{ms:.1f} ms"
    if ms < 600_000:
        return f"{ms / 1000:.2f} s"
    return f"{ms / 60_000:.1f} min"


def _clock(ns: int) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ns / 1e9)) + f".{ns // 1_000_000 % 1000:03d}"


def _skipped_note(span_file: SpanFile) -> str | None:
    parts = []
    if span_file.skipped_lines:
        n = span_file.skipped_lines
        parts.append(f"{n} line{'s' if n != 1 else ''} not understood")
    if span_file.truncated_last_line:
        parts.append("the last line is truncated")
    if span_file.duplicate_spans:
        parts.append(f"{span_file.duplicate_spans} duplicate spans")
    return "skipped: " + ", ".join(parts) if parts else None


def render_list(span_file: SpanFile, console, *, show_all: bool = False) -> None:
    """``--list``: one row per trace (step traces summed up in one line unless ``show_all``)."""
    from rich.markup import escape
    from rich.table import Table

    traces = span_file.traces
    shown = traces if show_all else [t for t in traces if t.kind != STEP]
    steps = [t for t in traces if t.kind == STEP]
    console.print(
        f"[bold]{escape(span_file.path)}[/bold]: {span_file.num_spans} spans in {len(traces)} traces"
    )
    if shown:
        # Narrow (an 80-column terminal): the start time goes under the trace id, the
        # request id under the root, one process a line.
        narrow = console.width < 120
        table = Table(box=None, pad_edge=False, header_style="bold")
        table.add_column("TRACE", no_wrap=True)
        table.add_column("KIND", no_wrap=True)
        table.add_column("ROOT", overflow="fold")
        if not narrow:
            table.add_column("REQUEST", overflow="fold")
            table.add_column("STARTED", no_wrap=True)
        table.add_column("TOOK", justify="right", no_wrap=True)
        table.add_column("SPANS", justify="right", no_wrap=True)
        table.add_column("PROCESSES", overflow="fold")
        for t in shown:
            started = _clock(t.start_ns)[11:]
            took, n = fmt_duration(t.duration_ns), str(len(t.spans))
            if narrow:
                root = escape(t.root.name) + (f"\nrequest {escape(t.request_id)}" if t.request_id else "")
                procs = escape("\n".join(t.processes))
                table.add_row(f"{t.trace_id[:8]}\n[dim]{started[:8]}[/dim]", t.kind, root, took, n, procs)
            else:
                procs = escape(", ".join(t.processes))
                table.add_row(t.trace_id[:8], t.kind, escape(t.root.name), escape(t.request_id or "-"),
                              started, took, n, procs)  # fmt: skip
        console.print(table)
    if steps and not show_all:
        durations = sorted(t.duration_ns for t in steps)
        console.print(
            f"[dim]+ {len(steps)} step trace{'s' if len(steps) != 1 else ''} (one per engine step), "
            f"{fmt_duration(durations[0])} to {fmt_duration(durations[-1])} each; --all lists them[/dim]"
        )
    if not traces:
        console.print("no spans in this file")
    if note := _skipped_note(span_file):
        console.print(f"[yellow]{escape(note)}[/yellow]")
    if traces:
        console.print("[dim]draw one: --startup, --request ID or --trace-id PREFIX[/dim]", overflow="fold")


def _lane_order(trace: Trace) -> list[tuple[str, int | None, str | None]]:
    """Lanes grouped by process (processes by first span), threads by first span within."""
    first_process: dict[tuple[str, int | None], int] = {}
    first_lane: dict[tuple[str, int | None, str | None], int] = {}
    for s in trace.spans:
        first_process.setdefault(s.process, s.start_ns)
        first_lane.setdefault(s.lane, s.start_ns)
    return sorted(first_lane, key=lambda lane: (first_process[lane[:2]], first_lane[lane]))


def _lane_rows(trace: Trace, lane) -> list[tuple[Span, int]]:
    """The lane's spans in tree order, each with its depth among its own lane's ancestors."""
    mine = [s for s in trace.spans if s.lane == lane]
    rows: list[tuple[Span, int]] = []

    def walk(span: Span, depth: int) -> None:
        rows.append((span, depth))
        for child in span.children:
            if child.lane == lane:
                walk(child, depth + 1)

    for s in mine:
        if s.parent is None or s.parent.lane != lane:
            walk(s, 0)
    # A span whose same-lane parent chain passes through another lane is still walked above;
    # anything not reached (it cannot happen with a tree) is appended so nothing is lost.
    seen = {id(s) for s, _ in rows}
    rows += [(s, 0) for s in mine if id(s) not in seen]
    return rows


def _lane_title(lane) -> str:
    role, _pid, thread = lane
    return f"{role} / {thread}" if thread else role


def _axis(width: int, total_ns: int) -> tuple[str, str]:
    """Two lines for the bar area: tick labels and a ruler."""
    labels = [" "] * width
    marks = [(0, "0"), (width // 2, fmt_duration(total_ns / 2)), (width, fmt_duration(total_ns))]
    for pos, text in marks:
        start = min(max(0, pos - len(text) // 2), width - len(text)) if pos else 0
        if pos == width:
            start = width - len(text)
        if start < 0 or any(c != " " for c in labels[max(0, start - 1) : start + len(text) + 1]):
            continue
        labels[start : start + len(text)] = text
    ruler = ["─"] * width
    for pos in (0, width // 4, width // 2, 3 * width // 4, width - 1):
        if 0 <= pos < width:
            ruler[pos] = "┬"
    return "".join(labels), "".join(ruler)


def _bar(span: Span, t0: int, total_ns: int, width: int) -> tuple[int, int, str]:
    """(first column, length, glyphs) of the span's bar in a bar area ``width`` wide."""
    scale = width / total_ns if total_ns > 0 else 0.0
    a = (span.start_ns - t0) * scale
    b = (span.end_ns - t0) * scale
    first = min(int(a), width - 1)
    if b - a < 0.5:
        return first, 1, "▏"  # shorter than half a column: a tick where it happened
    last = min(max(first + 1, round(b)), width)
    return first, last - first, "█" * (last - first)


def render_waterfall(
    trace: Trace,
    console,
    *,
    bar_width: int | None = None,
    span_file: SpanFile | None = None,
) -> None:
    """Draw ``trace`` on ``console`` (a Rich Console): header, time axis, one lane per
    process and thread, and a footer naming the slowest stage.

    Each row: the span name (indented by nesting within its lane), its bar on the shared
    time axis, its duration; ``◀`` marks the span with the most own time. ``bar_width``:
    columns of the bar area (default: what the console width leaves).
    """
    from rich.markup import escape
    from rich.text import Text

    width = console.width
    t0, total = trace.start_ns, trace.duration_ns
    slowest = trace.slowest()
    lanes = _lane_order(trace)
    rows = {lane: _lane_rows(trace, lane) for lane in lanes}
    wide = width >= 100
    marker = " ◀ slowest" if wide else " ◀"
    dur_w = 9  # a space, then at most 8 characters
    longest = max((len(s.name) + 2 * (d + 1) for lane in lanes for s, d in rows[lane]), default=10)
    name_w = max(16, min(longest + 1, 48 if wide else int(width * 0.45)))
    if bar_width is None:
        bar_width = max(10, width - name_w - 1 - dur_w - len(marker))

    # Header.
    root = trace.root
    title = Text()
    title.append(f"{trace.kind} trace", style="bold")
    title.append(f" · {root.name}")
    if trace.kind == REQUEST and trace.request_id is not None:
        title.append(f" · request {trace.request_id}")
    title.append(f" · {fmt_duration(total)}", style="bold")
    n_proc = len(trace.processes)
    n_spans = len(trace.spans)
    title.append(
        f" · {n_spans} span{'s' if n_spans != 1 else ''} in {n_proc} process{'es' if n_proc != 1 else ''}",
        style="dim",
    )
    console.print(title)
    sub = f"trace {trace.trace_id} · started {_clock(t0)}"
    if trace.remote_parent:
        sub += f" · continues the caller's span {trace.remote_parent} (not in this file)"
    console.print(Text(sub, style="dim"))
    if trace.kind == REQUEST:
        details = [
            f"{k}={f'{v:.4g}' if isinstance(v, float) else v}"
            for k, v in root.attributes.items()
            if k.startswith("gen_ai.") and k != ATTR_REQUEST_ID
        ]
        if details:
            console.print(Text(" · ".join(details), style="dim"))
    console.print()

    # Time axis.
    labels, ruler = _axis(bar_width, total)
    pad = " " * (name_w + 1)
    console.print(Text(pad + labels, style="dim"), no_wrap=True, overflow="ignore", crop=False)
    console.print(Text(pad + ruler, style="dim"), no_wrap=True, overflow="ignore", crop=False)

    # Lanes.
    for lane in lanes:
        header = Text()
        header.append(_lane_title(lane), style="bold")
        if lane[1] is not None:
            header.append(f"  pid {lane[1]}", style="dim")
        outer = {
            s.parent.lane for s, d in rows[lane] if d == 0 and s.parent is not None and s.parent.lane != lane
        }
        if outer:
            header.append("  under " + ", ".join(sorted(_lane_title(o) for o in outer)), style="dim")
        console.print(header, no_wrap=True, overflow="ellipsis")
        for span, depth in rows[lane]:
            is_slowest = span is slowest
            failed = span.status == "ERROR"
            label = "  " * (depth + 1) + ("✗ " if failed else "") + span.name
            if len(label) > name_w:
                label = label[: name_w - 1] + "…"
            style = "bold red" if is_slowest else ("magenta" if failed else "")
            line = Text()
            line.append(label.ljust(name_w), style=style)
            line.append(" ")
            first, length, glyphs = _bar(span, t0, total, bar_width)
            bar_style = (
                "bold red" if is_slowest else ("magenta" if failed else _LEVEL_STYLE.get(span.level, "blue"))
            )
            line.append(" " * first)
            line.append(glyphs, style=bar_style)
            line.append(" " * (bar_width - first - length))
            line.append(fmt_duration(span.duration_ns).rjust(dur_w), style=style)
            if is_slowest:
                line.append(marker, style="bold red")
            console.print(line, no_wrap=True, overflow="ignore", crop=False)

    # Footer.
    console.print()
    own = slowest.own_ns()
    share = f", {100 * own / total:.0f}% of the trace" if total > 0 else ""
    what = "stage" if trace.kind in (START_UP, SHUTDOWN) else "span"
    console.print(
        f"[bold red]◀ slowest {what}:[/bold red] [bold]{escape(slowest.name)}[/bold] "
        f"({fmt_duration(own)} of its own time{share}) on {escape(_lane_title(slowest.lane))}"
    )
    console.print(
        "[dim]own time: the duration less the time its children cover, in any process. "
        "Each span sits in the lane of the process (and thread) that ran it, indented under "
        "its parent there.[/dim]"
    )
    links = linked_traces(trace, span_file)
    if links:
        console.print(
            "[bold]linked traces[/bold] (span links, e.g. to the engine steps that computed a request):"
        )
        for span in dict.fromkeys(s for s, _, _ in links):
            mine = [(t, linked) for s, t, linked in links if s is span]
            each = ", ".join(
                f"{t[:8]} ({fmt_duration(linked.duration_ns)})"
                if linked is not None
                else f"{t[:8]} (not in this file)"
                for t, linked in mine
            )
            kinds = {linked.kind for _, linked in mine if linked is not None}
            what = f"{kinds.pop()} trace" if len(kinds) == 1 else "trace"
            console.print(
                f"  {escape(span.name)} → {len(mine)} {what}{'s' if len(mine) != 1 else ''}: {each}"
            )
        console.print("[dim]draw one: --trace-id PREFIX[/dim]")
    errors = [s for s in trace.spans if s.status == "ERROR"]
    if errors:
        console.print(f"[magenta]✗ {len(errors)} span(s) ended with an error:[/magenta]")
        for s in errors:
            why = f": {s.status_description}" if s.status_description else ""
            console.print(f"  {escape(s.name)} on {escape(_lane_title(s.lane))}{escape(why)}")
    if span_file is not None and (note := _skipped_note(span_file)):
        console.print(f"[yellow]{escape(note)}[/yellow]")


# ------------------------------------------------------------------------ command


def add_subparser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "trace",
        help="Draw a start-up or request trace from a --trace-file as a terminal waterfall.",
        description=DESCRIPTION,
        epilog=EXIT_STATUS,
        formatter_class=DefaultsHelpFormatter,
    )
    p.add_argument(
        "file", metavar="FILE", help="JSON-lines span file (from --trace-file / GLASSBOX_TRACE_FILE)."
    )
    what = p.add_mutually_exclusive_group()
    what.add_argument("--list", action="store_true", help="List the traces in FILE (what runs with no flag).")
    what.add_argument(
        "--startup",
        action="store_true",
        help="Draw the latest start-up trace (or --trace-id's) as a waterfall.",
    )
    what.add_argument(
        "--steps",
        action="store_true",
        help="List the engine steps that scheduled prompt tokens (--all: every step) and split each "
        "request's time to first token into before the engine, waiting and prefill.",
    )
    what.add_argument(
        "--request",
        metavar="ID",
        default=None,
        help="Draw one request's trace: its gen_ai.request.id, or a trace id prefix (default: none).",
    )
    p.add_argument(
        "--trace-id",
        metavar="PREFIX",
        default=None,
        help="Draw the trace whose id starts with PREFIX; with --startup, pick that start-up (default: none).",
    )
    p.add_argument(
        "--json", action="store_true", help="Print the selected trace's span tree (or the list) as JSON."
    )
    p.add_argument(
        "--width",
        type=int,
        default=None,
        metavar="COLUMNS",
        help="Columns of the bar area (default: what the terminal width leaves).",
    )
    p.add_argument(
        "--all", action="store_true", help="With --list, list every step trace too; with --steps, every step."
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from rich.console import Console

    if args.width is not None and args.width < 10:
        parser.error(f"--width: {args.width} is too narrow (at least 10)")
    path = Path(args.file)
    try:
        span_file = load(path)
    except FileNotFoundError:
        parser.error(f"{path}: no such file")
    except IsADirectoryError:
        parser.error(f"{path}: is a directory, not a span file")
    except OSError as e:
        parser.error(f"{path}: {e.strerror or e}")

    console = Console(file=sys.stdout, highlight=False)
    if args.steps:
        from engine.cli.trace_steps import render_steps

        render_steps([s for t in span_file.traces for s in t.spans], console, show_all=args.all)
        return 0
    drawing = args.startup or args.request is not None or (args.trace_id is not None and not args.list)
    if not drawing:
        if args.json:
            print(json.dumps(file_to_json(span_file), indent=2))
        else:
            render_list(span_file, console, show_all=args.all)
        return 0
    try:
        trace = select(span_file, startup=args.startup, request=args.request, trace_id=args.trace_id)
    except TraceNotFound as e:
        parser.error(str(e))
    if args.json:
        print(json.dumps(trace_to_json(trace, span_file), indent=2, default=str))
    else:
        render_waterfall(trace, console, bar_width=args.width, span_file=span_file)
    return 0
