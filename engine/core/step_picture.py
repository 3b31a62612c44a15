"""One engine step on the engine core's three threads (``docs/pictures/one-step-threads.svg``).

Drawn from a real recorded trace, ``tutorials/data/05-one-engine-step/step-trace.jsonl``
(``python scripts/record_lesson_data.py step-trace``: ``glassbox serve
--collect-detailed-traces all --trace-file FILE`` and one 2-token request), so every bar is a
span the engine really emitted, at its real start and length::

    .venv/bin/python -m engine.distributed.pictures     # writes every picture in docs/pictures/

The window runs from the request's ``engine_core.input`` (the input thread) to the output
thread's ``engine_core.output_send`` of the first step, one lane per process and thread:

- ``EngineCoreInputThread``: the request read off its client's socket and decoded;
- ``MainThread``, the busy loop: the request waiting in ``input_queue``, then ``engine_core.step``
  and its phases (``scheduler.schedule``, ``executor.execute_model`` with its
  ``executor.broadcast``, ``scheduler.update_from_output``); the next step already begins
  before the output thread has sent this one's outputs;
- ``EngineCoreOutputThread``: the step's outputs taken off ``output_queue`` and pushed;
- the worker's ``MainThread``: ``worker.execute_model`` (the RPC read from the shared-memory
  broadcast queue), the forward and the sampler.

Arrows are the hand-offs between threads: the two in-process queues and the two shared-memory
queues. A test regenerates the picture and compares byte for byte
(``tests/unit/core/test_step_picture.py``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from engine.utils.svg import MARGIN, MUTED, TEXT, Canvas, text_width, write_svgs

REPO = Path(__file__).resolve().parents[2]
TRACE = REPO / "tutorials" / "data" / "05-one-engine-step" / "step-trace.jsonl"
FILE_NAME = "one-step-threads.svg"

# Lanes, top to bottom: (resource role prefix, thread name, title, what it does).
LANES = (
    ("EngineCore", "EngineCoreInputThread", "EngineCore_DP0 · input thread", "EngineCoreInputThread"),
    ("EngineCore", "MainThread", "EngineCore_DP0 · busy loop", "MainThread: step()"),
    ("EngineCore", "EngineCoreOutputThread", "EngineCore_DP0 · output thread", "EngineCoreOutputThread"),
    ("Worker", "MainThread", "Worker_DP0_PP0_TP0", "MainThread: forward, sampler"),
)
# Spans recorded after the fact carry no thread of their own: where they belong.
THREAD_OF = {"engine_core.input_queue": "MainThread"}
DRAWN = {
    "engine_core.input", "engine_core.input_queue", "engine_core.step", "scheduler.schedule",
    "executor.execute_model", "executor.broadcast", "scheduler.update_from_output", "engine_core.output_send",
    "worker.execute_model", "model_runner.forward", "model_runner.sample",
}  # fmt: skip
FILL = {
    "engine_core.input": ("#ddf4ff", "#0969da"),
    "engine_core.input_queue": ("#f6f8fa", "#8c959f"),
    "engine_core.step": ("#fff8c5", "#9a6700"),
    "scheduler.schedule": ("#ffebe9", "#cf222e"),
    "executor.execute_model": ("#fbefff", "#8250df"),
    "executor.broadcast": ("#dafbe1", "#1a7f37"),
    "scheduler.update_from_output": ("#ffebe9", "#cf222e"),
    "engine_core.output_send": ("#ddf4ff", "#0969da"),
    "worker.execute_model": ("#dafbe1", "#1a7f37"),
    "model_runner.forward": ("#fff1e5", "#bc4c00"),
    "model_runner.sample": ("#fff1e5", "#bc4c00"),
}
HANDOFF = "#57606a"

LABEL_W = 250  # the lanes' names
PLOT_W = 980  # the time axis
ROW_H, ROW_GAP = 20, 4  # one nesting level of a lane
LANE_PAD = 12
NOTE_H = 30  # under a lane: the labels of spans too short to hold theirs


@dataclass
class Span:
    name: str
    lane: int
    depth: int
    start_ms: float  # from the window's start
    end_ms: float
    step_id: int | None
    attributes: dict


def load(path: Path = TRACE) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _lane(span: dict) -> int | None:
    role = span["resource"].get("glassbox.role") or ""
    thread = span["attributes"].get("thread.name") or THREAD_OF.get(span["name"])
    for i, (prefix, lane_thread, _, _) in enumerate(LANES):
        if role.startswith(prefix) and thread == lane_thread:
            return i
    return None


def window(spans: list[dict]) -> tuple[int, int]:
    """(start, end) in Unix ns: the request's engine_core.input to ``TAIL_MS`` past the
    first step's output_send."""
    first = next(s for s in spans if s["name"] == "engine_core.input")
    step = next(s for s in spans if s["name"] == "engine_core.step")
    send = next(
        s for s in spans if s["name"] == "engine_core.output_send" and s["trace_id"] == step["trace_id"]
    )
    return first["start_ns"], send["end_ns"] + int(TAIL_MS * 1e6)


def layout(spans: list[dict]) -> tuple[list[Span], float]:
    """The spans drawn (clipped to the window) with their lane and nesting depth, and the
    window's length in ms."""
    start, end = window(spans)
    by_id = {s["span_id"]: s for s in spans}
    # a step's phases carry its id; the worker's spans and the broadcast are in its trace
    steps = {
        s["trace_id"]: s["attributes"].get("glassbox.step.id")
        for s in spans
        if s["name"] == "engine_core.step"
    }
    out = []
    for s in spans:
        lane = _lane(s)
        if s["name"] not in DRAWN or lane is None or s["start_ns"] > end:
            continue
        depth, parent = 0, by_id.get(s["parent_span_id"])
        while parent is not None and _lane(parent) == lane and parent["name"] in DRAWN:
            depth, parent = depth + 1, by_id.get(parent["parent_span_id"])
        step_id = steps.get(s["trace_id"])
        if step_id is not None and step_id > 1 and s["name"] != "engine_core.step":
            continue  # of the next step, only its bar
        out.append(Span(s["name"], lane, depth, (s["start_ns"] - start) / 1e6, (min(s["end_ns"], end) - start) / 1e6,
                        step_id, s["attributes"]))  # fmt: skip
    return out, (end - start) / 1e6


TAIL_MS = 2.0  # past the output thread's send: the next step under way


def _label(s: Span) -> str:
    if s.step_id is not None and s.step_id > 1:
        return f"step {s.step_id} …"
    ms = s.end_ms - s.start_ms
    return f"{s.name}  {ms:.1f} ms" if ms >= 1 else f"{s.name}  {ms * 1000:.0f} µs"


def draw(spans: list[dict]) -> str:
    drawn, total_ms = layout(spans)
    scale = PLOT_W / total_ms
    x0 = MARGIN + LABEL_W
    c = Canvas()
    c.text(
        MARGIN,
        MARGIN + 14,
        "One engine step on the engine core's three threads (and its worker)",
        size=16,
        bold=True,
    )
    c.text(MARGIN, MARGIN + 34, "a real trace: the first step of a 2-token request, bundled model, compiled step "
           "(tutorials/data/05-one-engine-step/step-trace.jsonl)", size=12, colour=MUTED)  # fmt: skip
    y = MARGIN + 56
    lane_top: dict[int, float] = {}
    gaps: list[float] = []  # the middle of the gap under each lane
    for i, (_, _, title, what) in enumerate(LANES):
        mine = sorted((s for s in drawn if s.lane == i), key=lambda s: (s.depth, s.start_ms))
        depths = max((s.depth for s in mine), default=0) + 1
        # where each span goes: its bar, and its label inside it or on a note line under the lane
        placed, note_ends = [], []  # (span, x, w, note line or None); each note line's right end
        for s in mine:
            bx, bw = x0 + s.start_ms * scale, max(3.0, (s.end_ms - s.start_ms) * scale)
            label = _label(s)
            if text_width(label, 11, True) + 10 <= bw:
                placed.append((s, bx, bw, None))
                continue
            left = bx + bw / 2 - 2
            line = next((n for n, e in enumerate(note_ends) if e < left - 6), len(note_ends))
            if line == len(note_ends):
                note_ends.append(0.0)
            note_ends[line] = left + text_width(label, 10.5, True)
            placed.append((s, bx, bw, line))
        h = LANE_PAD * 2 + depths * (ROW_H + ROW_GAP) + len(note_ends) * 14 + 4
        c.rect(
            MARGIN,
            y,
            LABEL_W + PLOT_W + 10,
            h,
            fill="#ffffff" if i % 2 else "#f6f8fa",
            stroke="#d0d7de",
            width=1,
        )
        c.text(MARGIN + 10, y + 24, title, size=12.5, bold=True, mono=True)
        c.text(MARGIN + 10, y + 42, what, size=11.5, mono=True, colour=MUTED)
        lane_top[i] = y + LANE_PAD
        notes_y = lane_top[i] + depths * (ROW_H + ROW_GAP) + 10
        for s, bx, bw, line in placed:
            by = lane_top[i] + s.depth * (ROW_H + ROW_GAP)
            fill, stroke = FILL[s.name]
            later = s.step_id is not None and s.step_id > 1
            c.rect(bx, by, bw, ROW_H, fill="#ffffff" if later else fill, stroke=stroke, rx=3, dashed=later)
            if line is None:
                c.text(bx + 5, by + 14, _label(s), size=11, mono=True, colour=MUTED if later else TEXT)
                continue
            ny = notes_y + line * 14
            c.path([(bx + bw / 2, by + ROW_H), (bx + bw / 2, ny - 9)], stroke, width=1, end=False)
            c.text(bx + bw / 2 - 2, ny, _label(s), size=10.5, mono=True)
        y += h + 26
        gaps.append(y - 13)

    def at(name: str, which: str, step: int | None = 1) -> tuple[float, float, float]:
        """x of a span's start or end, and its bar's top and bottom."""
        s = next(s for s in drawn if s.name == name and s.step_id == step)
        top = lane_top[s.lane] + s.depth * (ROW_H + ROW_GAP)
        return x0 + (s.start_ms if which == "start" else s.end_ms) * scale, top, top + ROW_H

    def handoff(
        a: tuple[float, float], b: tuple[float, float], gap: float, label: str, left: bool = False
    ) -> None:
        c.path([a, (a[0], gap), (b[0], gap), b], HANDOFF, width=1.4)
        x = min(a[0], b[0]) - 8 if left else max(a[0], b[0]) + 8
        c.text(x, gap + 4, label, size=10.5, colour=HANDOFF, chip=True, anchor="end" if left else "start")

    x, _, bottom = at("engine_core.input", "end", None)
    bx, top, _ = at("engine_core.input_queue", "start", None)
    handoff((x, bottom), (bx, top), gaps[0], "input_queue: put by the input thread, got by the busy loop")
    x, _, bottom = at("executor.broadcast", "start")
    bx, top, _ = at("worker.execute_model", "start")
    handoff(
        (x + 4, bottom),
        (bx, top),
        gaps[2],
        "shared-memory broadcast queue (MessageQueue): the SchedulerOutput",
    )
    x, top, _ = at("worker.execute_model", "end")
    bx, _, bottom = at("executor.execute_model", "end")
    handoff((x, top), (bx, bottom), gaps[1], "its response queue: the sampled tokens", left=True)
    x, _, bottom = at("scheduler.update_from_output", "end")
    bx, top, _ = at("engine_core.output_send", "start")
    handoff((x, bottom), (bx, top), gaps[1] + 14, "output_queue")
    # the time axis
    y -= 10
    c.path([(x0, y + 4), (x0 + PLOT_W, y + 4)], MUTED, width=1, end=False)
    for k in range(int(total_ms // 5) + 1):
        tx = x0 + 5 * k * scale
        c.path([(tx, y), (tx, y + 8)], MUTED, width=1, end=False)
        c.text(tx, y + 22, f"{5 * k} ms", size=11, anchor="middle", colour=MUTED)
    c.text(MARGIN, y + 44, "Bars: spans at their recorded start and length (a short one's name and time under its "
           "lane); dashed: the next step, already under way.", size=11.5, colour=MUTED)  # fmt: skip
    c.text(MARGIN, y + 62, "Arrows: hand-offs between threads and processes. The busy loop never waits for the "
           "output thread: it schedules the next step while this one's tokens are sent.", size=11.5, colour=MUTED)  # fmt: skip
    return c.render(
        "One engine step on the engine core's three threads",
        "A timeline from a recorded trace: the input thread decodes a request, the busy loop schedules, "
        "broadcasts to the worker, which runs the forward and the sampler, updates from its output, and the "
        "output thread sends the tokens while the next step starts.",
        "python -m engine.distributed.pictures (engine/core/step_picture.py)",
    )


def render() -> dict[str, str]:
    return {FILE_NAME: draw(load())}


def write_pictures(out_dir: Path) -> list[Path]:
    return write_svgs(render(), out_dir)
