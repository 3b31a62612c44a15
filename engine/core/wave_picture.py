"""The picture of one data-parallel request wave (``docs/pictures/dp-wave.svg``), from the real wave logic.

Two engine cores and the coordinator of ``glassbox serve -dp 2`` are played turn by turn,
with no process, socket or model: each engine is a stand-in that borrows the real methods of
``EngineCoreProc`` (``_maybe_start_wave``, ``_on_wave``, ``_report_load`` and the backlog
flush, so the real ``StartWave`` / ``EngineLoad`` bytes are encoded), and the coordinator is a
real ``DPCoordinator`` (``handle``, ``start_wave``, ``record``) whose sockets are replaced by
lists. So the picture cannot show a wave start, a dummy batch or a wave end that the code
would not produce::

    .venv/bin/python -m engine.distributed.pictures     # writes every picture in docs/pictures/

The scenario: both engines idle, wave 0; at the second turn one request (``max_tokens=4``: one prefill step,
three decode steps) arrives at ``EngineCore_DP0`` (the balancer's tie goes to the lower
rank). Each column is one turn of every busy loop (``EngineCoreProc.run_busy_loop``: inputs,
then the load report, then a step, a dummy batch or, idle, a wait for input); a message sent
in one turn is read in the next. The real loop's times differ (a dummy batch is followed by
a 20 ms pause, ``GLASSBOX_DP_DUMMY_STEP_INTERVAL_S``); the order of events does not.

A test regenerates the picture and compares byte for byte (``tests/unit/core/test_wave_picture.py``).
"""

from __future__ import annotations

import types
from dataclasses import dataclass, field
from pathlib import Path

from engine.core.coordinator import DPCoordinator
from engine.core.coordinator_messages import DPWave, EngineToCoordinator, decode_as
from engine.core.engine_core_proc import EngineCoreProc
from engine.utils.svg import MARGIN, MUTED, TEXT, Canvas, write_svgs

FILE_NAME = "dp-wave.svg"
COMMAND = "python -m engine.distributed.pictures"
DP = 2
REQUEST_ENGINE = 0  # where the one request lands
MAX_TOKENS = 4
ARRIVES_AT = 2  # the turn the request arrives at
TURNS = 7


@dataclass
class Turn:
    """What each engine did in one turn, and the messages of that turn."""

    did: list[str]  # per engine: "idle", "prefill", "decode", "decode (finished)", "dummy"
    wave: list[tuple[int, bool]]  # per engine: (current_wave, engines_running) after the turn
    to_coordinator: list[tuple[int, str]] = field(default_factory=list)  # (engine, text)
    from_coordinator: list[tuple[int, str]] = field(default_factory=list)  # (engine, text)
    coordinator: tuple[int, bool] = (0, False)  # its (current_wave, engines_running) after the turn


class _Socket:
    """A PUSH socket that hands each frame to a list (``send(frame, flags)``, as zmq's)."""

    def __init__(self, outbox: list[bytes]) -> None:
        self.outbox = outbox

    def send(self, frame: bytes, flags: int = 0) -> None:
        self.outbox.append(frame)


class _Scheduler:
    """The scheduler as the wave logic sees it: its waiting and running lists."""

    def __init__(self) -> None:
        self.waiting: list[str] = []
        self.running: list[str] = []

    def has_requests(self) -> bool:
        return bool(self.waiting or self.running)

    has_unfinished_requests = has_requests


class _Engine:
    """An engine core's wave state, run by ``EngineCoreProc``'s own methods."""

    _maybe_start_wave = EngineCoreProc._maybe_start_wave
    _on_wave = EngineCoreProc._on_wave
    _report_load = EngineCoreProc._report_load
    _flush_coordinator_backlog = EngineCoreProc._flush_coordinator_backlog
    _load = EngineCoreProc._load
    dp_group = None  # no expert parallelism: the coordinator ends the wave

    def __init__(self, rank: int, outbox: list[bytes]) -> None:
        self.data_parallel_rank = rank
        self.current_wave, self.engines_running = 0, False
        self.load_sent = None
        self._coordinator_backlog: list[bytes] = []
        self.coordinator_socket = _Socket(outbox)
        self.scheduler = _Scheduler()
        self.inbox: list[object] = []
        self.tokens = 0

    def turn(self) -> str:
        """One turn of ``run_busy_loop``: inputs, load report, then a step or a dummy batch."""
        if not self.inbox and not self.scheduler.has_requests() and not self.engines_running:
            return "idle"  # blocked in _process_input_queue until input comes
        for item in self.inbox:
            if isinstance(item, DPWave):
                self._on_wave(item)
            else:  # a request: EngineCoreProc._handle_client_request's ADD
                self.scheduler.waiting.append(item)
                self._maybe_start_wave()
        self.inbox.clear()
        self._report_load()
        if self.scheduler.has_requests():
            if self.scheduler.waiting:
                self.scheduler.running.append(self.scheduler.waiting.pop(0))
                self.tokens = 1
                return "prefill"
            self.tokens += 1
            if self.tokens == MAX_TOKENS:
                self.scheduler.running.clear()
                return "decode (finished)"
            return "decode"
        if self.engines_running:
            return "dummy"
        return "idle"


def _describe(message) -> str:
    if isinstance(message, DPWave):
        return f"DPWave({message.wave}, {'running' if message.running else 'ended'})"
    name = type(message).__name__
    if name == "StartWave":
        return f"StartWave({message.wave})"
    return f"EngineLoad({message.num_waiting}, {message.num_running})"


def run_scenario() -> list[Turn]:
    """The turns of the scenario (module docstring), from the real wave methods."""
    outbox: list[bytes] = []
    engines = [_Engine(k, outbox) for k in range(DP)]
    coordinator = object.__new__(DPCoordinator)
    coordinator.counts = [(0, 0)] * DP
    coordinator.current_wave, coordinator.engines_running = 0, False
    coordinator.wave_started, coordinator.dirty = (0, None), False
    sent: list[DPWave] = []
    coordinator._send_wave = sent.append  # the PUB socket to every engine
    coordinator._record_wave = types.MethodType(lambda self, wave: None, coordinator)  # no trace here
    turns = []
    for n in range(1, TURNS + 1):
        if n == ARRIVES_AT:
            engines[REQUEST_ENGINE].inbox.append("request")
        did = [e.turn() for e in engines]
        turn = Turn(did=did, wave=[(e.current_wave, e.engines_running) for e in engines])
        for frame in outbox:  # the coordinator reads this turn's messages
            message = decode_as(EngineToCoordinator, frame)
            turn.to_coordinator.append((message.engine_index, _describe(message)))
            coordinator.handle(message)
        outbox.clear()
        for wave in sent:  # ... and its news reaches the engines at their next turn
            for e in engines:
                if wave.exclude_engine != e.data_parallel_rank:
                    e.inbox.append(wave)
                    turn.from_coordinator.append((e.data_parallel_rank, _describe(wave)))
        sent.clear()
        turn.coordinator = (coordinator.current_wave, coordinator.engines_running)
        turns.append(turn)
    return turns


# ---------------------------------------------------------------------------- drawing

CELL_W, CELL_H, GAP = 118, 46, 8
LANE_GAP = 92  # between an engine lane and the coordinator lane
LABEL_W = 170
STYLE = {  # what an engine did -> fill, stroke, label
    "prefill": ("#fff8c5", "#9a6700", "prefill"),
    "decode": ("#dafbe1", "#1a7f37", "decode"),
    "decode (finished)": ("#dafbe1", "#1a7f37", "decode, done"),
    "dummy": ("#eaeef2", "#6e7781", "dummy batch"),
    "idle": ("#ffffff", "#d0d7de", "idle: waits"),
}
COORD = "#bf3989"


def draw(turns: list[Turn]) -> str:
    svg = Canvas()
    svg.text(
        MARGIN, MARGIN + 14, "glassbox serve -dp 2: one request, one wave", size=15, mono=True, bold=True
    )
    svg.text(MARGIN, MARGIN + 34, f"one request (max_tokens={MAX_TOKENS}) reaches EngineCore_DP{REQUEST_ENGINE}; "
             "each column is one turn of every busy loop; a message is read at the next turn",
             size=12.5, colour=MUTED)  # fmt: skip
    top = MARGIN + 78
    x0 = MARGIN + LABEL_W
    lane_y = {0: top, "coord": top + CELL_H + LANE_GAP, 1: top + 2 * (CELL_H + LANE_GAP)}
    names = {0: "EngineCore_DP0", "coord": "DPCoordinator", 1: "EngineCore_DP1"}
    for lane, y in lane_y.items():
        svg.text(MARGIN, y + CELL_H / 2 + 5, names[lane], size=13, mono=True, bold=True)
    for i in range(len(turns)):
        svg.text(x0 + i * (CELL_W + GAP) + CELL_W / 2, top - 12, f"turn {i + 1}", size=11.5, anchor="middle",
                 colour=MUTED)  # fmt: skip
    # The engines' steps.
    for i, turn in enumerate(turns):
        x = x0 + i * (CELL_W + GAP)
        for k, did in enumerate(turn.did):
            fill, stroke, label = STYLE[did]
            y = lane_y[k]
            svg.rect(x, y, CELL_W, CELL_H, fill=fill, stroke=stroke, rx=6, width=1.4, dashed=did == "dummy")
            svg.text(x + CELL_W / 2, y + 19, label, size=12, anchor="middle", bold=did != "idle",
                     colour=TEXT if did != "idle" else MUTED)  # fmt: skip
            wave, running = turn.wave[k]
            svg.text(x + CELL_W / 2, y + 36, f"wave {wave}{', running' if running else ''}", size=11,
                     anchor="middle", colour=MUTED)  # fmt: skip
    # The coordinator: the wave as a band over the turns it runs.
    cy = lane_y["coord"]
    running = [i for i, t in enumerate(turns) if t.coordinator[1]]
    if running:
        a, b = running[0], running[-1]
        bx = x0 + a * (CELL_W + GAP)
        svg.rect(
            bx, cy, (b - a + 1) * (CELL_W + GAP) - GAP, CELL_H, fill="#ffeff7", stroke=COORD, rx=6, width=1.5
        )
        wave = turns[a].coordinator[0]
        svg.text(bx + 10, cy + 19, f"wave {wave} runs: every engine steps", size=12, bold=True, colour=COORD)
        svg.text(
            bx + 10, cy + 36, "ends when every engine reports (0 waiting, 0 running)", size=11, colour=COORD
        )
    for i, turn in enumerate(turns):
        if i not in running:
            x = x0 + i * (CELL_W + GAP)
            svg.text(x + CELL_W / 2, cy + 28, f"wave {turn.coordinator[0]}, idle", size=11, anchor="middle",
                     colour=MUTED)  # fmt: skip
    # The messages: from an engine at the turn it sends them, to an engine at the turn it reads
    # them; each label next to its own lane, so the two directions never share a line.
    for i, turn in enumerate(turns):
        x = x0 + i * (CELL_W + GAP)
        for n, (k, text) in enumerate(turn.to_coordinator):
            load = text.startswith("EngineLoad")
            ax = x + CELL_W * (0.3 if k == 0 else 0.7)
            ey, ty = (lane_y[0] + CELL_H, cy) if k == 0 else (lane_y[1], cy + CELL_H)
            svg.path([(ax, ey), (ax, ty)], COORD, width=1.4 if load else 2)
            if k == 0:
                svg.text(ax - 5, ey + 18 + 14 * n, text, size=10.5, anchor="end", bold=not load, colour=COORD)
            else:
                svg.text(ax + 5, ey - 10 - 14 * n, text, size=10.5, bold=not load, colour=COORD)
        for k, text in turn.from_coordinator:
            nx = x + CELL_W + GAP / 2
            fy, ty = (cy, lane_y[0] + CELL_H) if k == 0 else (cy + CELL_H, lane_y[1])
            svg.path([(nx, fy), (nx + GAP / 2 + CELL_W * 0.15, ty)], COORD, width=2)
            ly = fy - 10 if k == 0 else fy + 20
            svg.text(nx + 8, ly, text, size=10.5, bold=True, colour=COORD)
    # The legend.
    y = svg.max_y + 26
    for did in ("prefill", "decode", "dummy", "idle"):
        fill, stroke, _ = STYLE[did]
        svg.rect(MARGIN, y - 11, 26, 14, fill=fill, stroke=stroke, rx=3, width=1.2, dashed=did == "dummy")
        words = {"prefill": "a step that prefills the request", "decode": "a step that decodes one token",
                 "dummy": "a dummy batch (engine_core.dummy_step): the wave runs, this engine has no request",
                 "idle": "idle: the busy loop waits for input (no request, no running wave)"}[did]  # fmt: skip
        svg.text(MARGIN + 36, y, words, size=12, colour=TEXT)
        y += 20
    svg.path([(MARGIN, y - 4), (MARGIN + 26, y - 4)], COORD, width=2)
    svg.text(MARGIN + 36, y, "the coordinator's ZMQ: StartWave and EngineLoad (PUSH → PULL), DPWave (PUB → SUB)",
             size=12, colour=TEXT)  # fmt: skip
    return svg.render(
        "One data-parallel request wave: two engines, one request, dummy batches on the idle engine",
        "EngineCore_DP0 gets a request and starts wave 0 (StartWave); the DPCoordinator tells EngineCore_DP1 "
        "(DPWave running), which runs dummy batches until both engines report no requests and the coordinator "
        "ends the wave (DPWave ended, wave 1).",
        f"`{COMMAND}` from the real wave logic (engine/core/wave_picture.py)",
    )


def render_all() -> dict[str, str]:
    return {FILE_NAME: draw(run_scenario())}


def write_pictures(out_dir: Path) -> list[Path]:
    return write_svgs(render_all(), out_dir)
