"""The picture of one request wave under expert parallelism (``docs/pictures/ep-wave.svg``), from the real lockstep logic.

``glassbox serve --model engine/assets/moe_model -dp 2 --enable-expert-parallel``: two engine
cores, each with one worker holding two of the four experts, and the coordinator, played
forward by forward with no process, socket or model. Each engine is a stand-in that borrows the
real methods of ``EngineCoreProc`` (``_maybe_start_wave``, ``_on_wave``, ``_lockstep_turn``,
``_report_load`` and the backlog flush: the real ``StartWave`` / ``WaveComplete`` bytes), the
coordinator is a real ``DPCoordinator`` with ``engines_end_waves`` (its sockets lists), and the
engine cores' DP group is an all-reduce over the two stand-ins' answers at the same forward::

    .venv/bin/python -m engine.distributed.pictures     # writes every picture in docs/pictures/

What the picture adds to the dense ``dp-wave.svg``: a forward is not one engine's affair any
more. Every MoE layer sends each token's rows to the ranks holding its experts and back
(dispatch and combine, all-to-alls over every worker of every engine), so forward k of engine
0 completes only together with forward k of engine 1. A column here is one such forward of
both engines, and a turn in which one engine has started its forward while the other has not
yet is a wait in the all-to-all. Engine 1, with no request, runs dummy batches — they are what
engine 0's all-to-alls wait for. The wave ends when the engines' all-reduce at a sync forward
finds no work on any of them (every ``wave_sync_steps`` forwards: 4 here, 32 in the engine).

A test regenerates the picture and compares byte for byte (``tests/unit/core/test_wave_picture.py``).
"""

from __future__ import annotations

import types
from dataclasses import dataclass, field
from pathlib import Path

import torch

from engine.core.coordinator import DPCoordinator
from engine.core.coordinator_messages import DPWave, EngineToCoordinator, decode_as
from engine.core.engine_core_proc import EngineCoreProc
from engine.utils.svg import MARGIN, MUTED, TEXT, Canvas, write_svgs

FILE_NAME = "ep-wave.svg"
COMMAND = "python -m engine.distributed.pictures"
DP = 2
NUM_MOE_LAYERS = 4  # the bundled mixture of experts
MAX_TOKENS = 3  # one prefill forward, two decodes
ARRIVES_AT = 2  # the turn the request reaches EngineCore_DP0
SYNC_STEPS = 4  # forwards between the engines' all-reduces (32 in the engine)
TURNS = 7


@dataclass
class Column:
    """One turn of both busy loops: what each engine did, and what crossed to and from the coordinator."""

    did: list[str]  # per engine: idle, prefill, decode, decode (finished), dummy; "cont. " + one of them
    forward: int | None = None  # the forward both engines completed in this turn (their all-to-alls met)
    waiting: list[bool] = field(default_factory=list)  # per engine: its forward still waits at the turn's end
    synced: bool | None = None  # at a sync forward: whether any engine had work (None: no sync here)
    wave: list[tuple[int, bool]] = field(default_factory=list)  # per engine, after the turn
    to_coordinator: list[tuple[int, str]] = field(default_factory=list)
    from_coordinator: list[tuple[int, str]] = field(default_factory=list)
    coordinator: tuple[int, bool] = (0, False)


class _Socket:
    def __init__(self, outbox: list[bytes]) -> None:
        self.outbox = outbox

    def send(self, frame: bytes, flags: int = 0) -> None:
        self.outbox.append(frame)


class _Scheduler:
    def __init__(self) -> None:
        self.waiting: list[str] = []
        self.running: list[str] = []

    def has_requests(self) -> bool:
        return bool(self.waiting or self.running)

    has_unfinished_requests = has_requests


class _DPGroup:
    """The engine cores' DP group, in one process: ``allreduce`` sums the answers the driver
    collected from both engines at this forward (what gloo's all-reduce would return)."""

    def __init__(self) -> None:
        self.answers: list[int] = []

    def allreduce(self, tensors: list[torch.Tensor]) -> types.SimpleNamespace:
        tensors[0].fill_(sum(self.answers))
        return types.SimpleNamespace(wait=lambda: None)


class _Engine:
    """An engine core under expert parallelism, run by ``EngineCoreProc``'s own methods."""

    _maybe_start_wave = EngineCoreProc._maybe_start_wave
    _on_wave = EngineCoreProc._on_wave
    _lockstep_turn = EngineCoreProc._lockstep_turn
    _report_load = EngineCoreProc._report_load
    _flush_coordinator_backlog = EngineCoreProc._flush_coordinator_backlog
    _load = EngineCoreProc._load
    wave_sync_steps = SYNC_STEPS

    def __init__(self, rank: int, outbox: list[bytes], group: _DPGroup) -> None:
        self.data_parallel_rank = rank
        self.current_wave, self.engines_running = 0, False
        self.dp_group, self.wave_step = group, 0
        self.load_sent = None
        self._coordinator_backlog: list[bytes] = []
        self.coordinator_socket = _Socket(outbox)
        self.scheduler = _Scheduler()
        self.inbox: list[object] = []
        self.tokens = 0
        self.pending: str | None = None  # the forward it started and that has not completed yet
        self.stepped = False

    def _dummy_step(self) -> None:
        """The dummy batch ``_lockstep_turn`` runs: issued already, as this turn's forward."""

    def start_turn(self) -> str:
        """A turn of ``run_busy_loop`` up to its forward: inputs, load report, then a step, a
        dummy batch or nothing (idle); a forward started earlier and not completed: it waits."""
        if self.pending is not None:
            return "cont. " + self.pending
        if not self.inbox and not self.scheduler.has_requests() and not self.engines_running:
            return "idle"
        for item in self.inbox:
            if isinstance(item, DPWave):
                self._on_wave(item)
            else:  # a request: EngineCoreProc._handle_client_request's ADD
                self.scheduler.waiting.append(item)
                self._maybe_start_wave()
        self.inbox.clear()
        self._report_load()
        self.stepped = self.scheduler.has_requests()
        if self.stepped:
            self._maybe_start_wave()
            if self.scheduler.waiting:
                self.scheduler.running.append(self.scheduler.waiting.pop(0))
                self.tokens = 1
                self.pending = "prefill"
            else:
                self.tokens += 1
                self.pending = "decode"
                if self.tokens == MAX_TOKENS:
                    self.scheduler.running.clear()
                    self.pending = "decode (finished)"
        elif self.engines_running:
            self.pending = "dummy"
        else:
            return "idle"
        return self.pending

    def finish_turn(self) -> None:
        """The forward completed (every engine's met in the all-to-alls): the rest of the turn."""
        self._lockstep_turn(self.stepped)
        self.pending = None


def _describe(message) -> str:
    if isinstance(message, DPWave):
        return f"DPWave({message.wave}, {'running' if message.running else 'ended'})"
    name = type(message).__name__
    if name in ("StartWave", "WaveComplete"):
        return f"{name}({message.wave})"
    return f"EngineLoad({message.num_waiting}, {message.num_running})"


def run_scenario() -> list[Column]:
    """The turns of the scenario (module docstring), from the real lockstep methods."""
    outbox: list[bytes] = []
    group = _DPGroup()
    engines = [_Engine(k, outbox, group) for k in range(DP)]
    coordinator = object.__new__(DPCoordinator)
    coordinator.counts = [(0, 0)] * DP
    coordinator.current_wave, coordinator.engines_running = 0, False
    coordinator.wave_started, coordinator.dirty = (0, None), False
    coordinator.engines_end_waves = True
    sent: list[DPWave] = []
    coordinator._send_wave = sent.append
    coordinator._record_wave = types.MethodType(lambda self, wave: None, coordinator)
    columns, forwards = [], 0
    for n in range(1, TURNS + 1):
        if n == ARRIVES_AT:
            engines[0].inbox.append("request")
        column = Column(did=[e.start_turn() for e in engines])
        if all(e.pending is not None for e in engines):  # both forwards started: the all-to-alls meet
            forwards += 1
            column.forward = forwards
            group.answers = [int(e.scheduler.has_requests()) for e in engines]
            syncing = engines[0].wave_step + 1 == SYNC_STEPS
            for e in engines:
                e.finish_turn()
            if syncing:
                column.synced = bool(sum(group.answers))
        column.waiting = [e.pending is not None for e in engines]
        column.wave = [(e.current_wave, e.engines_running) for e in engines]
        for frame in outbox:  # the coordinator reads this turn's messages
            message = decode_as(EngineToCoordinator, frame)
            column.to_coordinator.append((message.engine_index, _describe(message)))
            coordinator.handle(message)
        outbox.clear()
        for wave in sent:  # its news reaches the engines at their next turn
            for e in engines:
                if wave.exclude_engine != e.data_parallel_rank:
                    e.inbox.append(wave)
                    column.from_coordinator.append((e.data_parallel_rank, _describe(wave)))
        sent.clear()
        column.coordinator = (coordinator.current_wave, coordinator.engines_running)
        columns.append(column)
    return columns


# ---------------------------------------------------------------------------- drawing

CELL_W, CELL_H, GAP = 124, 46, 8
A2A_H = 64  # the all-to-all band between the two engines
LANE_GAP = 70
LABEL_W = 170
STYLE = {  # what an engine did -> fill, stroke, label
    "prefill": ("#fff8c5", "#9a6700", "prefill"),
    "decode": ("#dafbe1", "#1a7f37", "decode"),
    "decode (finished)": ("#dafbe1", "#1a7f37", "decode, done"),
    "dummy": ("#eaeef2", "#6e7781", "dummy batch"),
    "idle": ("#ffffff", "#d0d7de", "idle: waits"),
}
WAIT = "#bc4c00"  # a forward that waits in the all-to-all for the other engine
A2A = "#0969da"
COORD = "#bf3989"


def draw(columns: list[Column]) -> str:
    svg = Canvas()
    svg.text(MARGIN, MARGIN + 14, "glassbox serve -dp 2 --enable-expert-parallel: one request, one wave",
             size=15, mono=True, bold=True)  # fmt: skip
    svg.text(MARGIN, MARGIN + 34, f"one request (max_tokens={MAX_TOKENS}) reaches EngineCore_DP0; each column is "
             "one turn of both busy loops; every forward's MoE layers meet in all-to-alls over both engines' "
             "workers", size=12.5, colour=MUTED)  # fmt: skip
    top = MARGIN + 78
    x0 = MARGIN + LABEL_W
    y_dp0, y_a2a = top, top + CELL_H
    y_dp1 = y_a2a + A2A_H
    y_coord = y_dp1 + CELL_H + LANE_GAP
    lanes = {0: y_dp0, 1: y_dp1}
    svg.text(MARGIN, y_dp0 + CELL_H / 2 + 5, "EngineCore_DP0", size=13, mono=True, bold=True)
    svg.text(MARGIN, y_dp0 + CELL_H / 2 + 20, "worker: experts 0-1", size=11, colour=MUTED)
    svg.text(MARGIN, y_dp1 + CELL_H / 2 + 5, "EngineCore_DP1", size=13, mono=True, bold=True)
    svg.text(MARGIN, y_dp1 + CELL_H / 2 + 20, "worker: experts 2-3", size=11, colour=MUTED)
    svg.text(MARGIN, y_a2a + A2A_H / 2 + 5, "MoE all-to-alls", size=12, bold=True, colour=A2A)
    svg.text(MARGIN, y_coord + CELL_H / 2 + 5, "DPCoordinator", size=13, mono=True, bold=True)
    for i in range(len(columns)):
        svg.text(x0 + i * (CELL_W + GAP) + CELL_W / 2, top - 12, f"turn {i + 1}", size=11.5, anchor="middle",
                 colour=MUTED)  # fmt: skip
    for i, column in enumerate(columns):
        x = x0 + i * (CELL_W + GAP)
        for k, did in enumerate(column.did):
            kind = did.removeprefix("cont. ")
            fill, stroke, label = STYLE[kind]
            label = f"{label}, cont." if did != kind else label
            y = lanes[k]
            waits = column.waiting[k]
            svg.rect(x, y, CELL_W, CELL_H, fill=fill, stroke=WAIT if waits else stroke, rx=6,
                     width=2.2 if waits else 1.4, dashed=kind == "dummy")  # fmt: skip
            svg.text(x + CELL_W / 2, y + 19, label, size=12, anchor="middle", bold=kind != "idle",
                     colour=TEXT if kind != "idle" else MUTED)  # fmt: skip
            wave, running = column.wave[k]
            second = "waits in all-to-all" if waits else f"wave {wave}{', running' if running else ''}"
            svg.text(x + CELL_W / 2, y + 36, second, size=11, anchor="middle", bold=waits,
                     colour=WAIT if waits else MUTED)  # fmt: skip
        if column.forward is not None:  # one line per MoE layer: both workers in its all-to-alls
            for layer in range(NUM_MOE_LAYERS):  # both ways: dispatch down and combine back
                lx = x + CELL_W * (layer + 1) / (NUM_MOE_LAYERS + 1)
                svg.path([(lx, y_a2a + 6), (lx, y_dp1 - 6)], A2A, width=1.6, start=True)
            svg.text(x + CELL_W / 2, y_a2a + A2A_H / 2 + 4, f"forward {column.forward}", size=11,
                     anchor="middle", bold=True, colour=A2A, chip=True)  # fmt: skip
        elif any(column.waiting):
            svg.text(x + CELL_W / 2, y_a2a + A2A_H / 2 + 4, "a rank is missing", size=11, anchor="middle",
                     bold=True, colour=WAIT)  # fmt: skip
        if column.synced is not None:
            words = "all-reduce: work left" if column.synced else "all-reduce: no work: wave ends"
            svg.text(
                x + CELL_W / 2, y_dp1 + CELL_H + 16, words, size=10.5, anchor="middle", bold=True, colour=A2A
            )
    # The coordinator: the wave as a band over the turns it runs (it never ends one itself here).
    running = [i for i, c in enumerate(columns) if c.coordinator[1]]
    if running:
        a, b = running[0], running[-1]
        bx = x0 + a * (CELL_W + GAP)
        svg.rect(bx, y_coord, (b - a + 1) * (CELL_W + GAP) - GAP, CELL_H, fill="#ffeff7", stroke=COORD, rx=6,
                 width=1.5)  # fmt: skip
        svg.text(bx + 10, y_coord + 19, f"wave {columns[a].coordinator[0]} runs: every engine steps", size=12,
                 bold=True, colour=COORD)  # fmt: skip
        svg.text(bx + 10, y_coord + 36, "the engines end it together (WaveComplete from engine 0)", size=11,
                 colour=COORD)  # fmt: skip
    for i, column in enumerate(columns):
        if i not in running:
            x = x0 + i * (CELL_W + GAP)
            svg.text(x + CELL_W / 2, y_coord + 28, f"wave {column.coordinator[0]}, idle", size=11,
                     anchor="middle", colour=MUTED)  # fmt: skip
    # The coordinator's messages, each labelled by its lane.
    for i, column in enumerate(columns):
        x = x0 + i * (CELL_W + GAP)
        for n, (k, text) in enumerate(m for m in column.to_coordinator if not m[1].startswith("EngineLoad")):
            ax = x - GAP / 2  # down the gap before this turn, through no box
            svg.path([(ax, lanes[k] + CELL_H), (ax, y_coord)], COORD, width=1.4, dashed=True)
            svg.text(ax + 5, y_coord - 8 - 14 * n, text, size=10.5, bold=True, colour=COORD, chip=True)
        for k, text in column.from_coordinator:
            nx = x + CELL_W + GAP / 2
            svg.path([(nx, y_coord), (nx + GAP / 2 + CELL_W * 0.15, lanes[k] + CELL_H)], COORD, width=2)
            svg.text(nx + 8, y_coord - 24, text, size=10.5, bold=True, colour=COORD, chip=True)
    # The legend.
    y = svg.max_y + 26
    for did in ("prefill", "decode", "dummy", "waits", "idle"):
        fill, stroke, _ = STYLE["prefill" if did == "waits" else did]
        svg.rect(MARGIN, y - 11, 26, 14, fill=fill, stroke=WAIT if did == "waits" else stroke, rx=3,
                 width=2.2 if did == "waits" else 1.2, dashed=did == "dummy")  # fmt: skip
        words = {"prefill": "a step that prefills the request", "decode": "a step that decodes one token",
                 "dummy": "a dummy batch: no request here, but the other engine's all-to-alls need this engine's "
                          "workers — the reason DP engines move in lockstep",
                 "waits": "a forward that waits in its first all-to-all: the other engine has not started its own",
                 "idle": "idle: the busy loop waits for input (no request, no running wave)"}[did]  # fmt: skip
        svg.text(MARGIN + 36, y, words, size=12, colour=TEXT)
        y += 20
    svg.path([(MARGIN, y - 4), (MARGIN + 26, y - 4)], A2A, width=2, start=True)
    svg.text(MARGIN + 36, y, f"one of the {NUM_MOE_LAYERS} MoE layers' dispatch + combine: both engines' "
             "workers meet there in every forward", size=12, colour=TEXT)  # fmt: skip
    y += 20
    svg.path([(MARGIN, y - 4), (MARGIN + 26, y - 4)], COORD, width=2)
    svg.text(MARGIN + 36, y, "the coordinator's ZMQ: StartWave and WaveComplete (PUSH → PULL), DPWave (PUB → SUB); "
             f"the all-reduce: the engine cores' gloo group, every {SYNC_STEPS} forwards here (32 in the engine)",
             size=12, colour=TEXT)  # fmt: skip
    return svg.render(
        "One request wave under expert parallelism: two engines, one request, dummy batches in the all-to-alls",
        "EngineCore_DP0 gets a request and starts wave 0; its first forward waits in the all-to-all until "
        "EngineCore_DP1, told by the coordinator, runs its first dummy batch; from then every forward of both "
        "engines meets in each MoE layer's all-to-alls, until the engines' all-reduce finds no work left and "
        "both leave the wave after the same forward.",
        f"`{COMMAND}` from the real lockstep logic (engine/core/ep_wave_picture.py)",
    )


def render_all() -> dict[str, str]:
    return {FILE_NAME: draw(run_scenario())}


def write_pictures(out_dir: Path) -> list[Path]:
    return write_svgs(render_all(), out_dir)
