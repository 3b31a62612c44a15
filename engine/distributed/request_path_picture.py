"""The picture of one request's path (``docs/pictures/request-path.svg``), named from the code.

One streamed completion through the default ``glassbox serve`` tree: the three processes
(their titles from the topology plan, as the process-tree pictures), their threads, the ZMQ
sockets and the queues between them, and the walk's steps numbered as in
``docs/architecture.md`` ("One request, in eight steps"; ``3a`` … ``3c`` are the parts of
step 3). Every class, method, thread, task, socket type and queue it names is taken from
the code, not typed: a qualified name is read off the imported object, and a thread name,
task name, socket type or attribute is looked up in the source of the method that creates
it. A rename there makes this module raise, so the freshness test fails
(``tests/unit/distributed/test_request_path_picture.py``)::

    .venv/bin/python -m engine.distributed.pictures     # writes every picture in docs/pictures/
"""

from __future__ import annotations

import inspect
from pathlib import Path

from engine.utils.svg import MARGIN, MUTED, TEXT, Canvas, write_svgs

FILE_NAME = "request-path.svg"
COMMAND = "python -m engine.distributed.pictures"


def _q(obj: object) -> str:
    """The qualified name of a class or function (``Scheduler.schedule``)."""
    return obj.__qualname__  # type: ignore[attr-defined]


def _lit(obj: object, literal: str, shown: str | None = None) -> str:
    """``shown`` (default ``literal``), after checking that ``literal`` is in ``obj``'s source.

    Raises:
        LookupError: the code no longer says it (renamed): redraw with the new name.
    """
    if literal not in inspect.getsource(obj):  # type: ignore[arg-type]
        raise LookupError(f"{literal!r} is no longer in {_q(obj)}: update {__name__}")
    return literal if shown is None else shown


def _names() -> dict[str, str]:
    """Every name the picture shows, read from the code."""
    from engine.core.engine_core import EngineCore
    from engine.core.engine_core_proc import EngineCoreProc, OutputRouter
    from engine.core.messages import EngineCoreOutputs, EngineCoreRequest
    from engine.distributed.pictures import plan_for
    from engine.entrypoints.openai.serving_completion import OpenAIServingCompletion
    from engine.executor.messages import WorkerReply, WorkerRPC
    from engine.executor.multiproc_executor import MultiprocExecutor, WorkerProc
    from engine.executor.shm_broadcast import MessageQueue
    from engine.frontend.async_llm import AsyncLLM
    from engine.frontend.core_client import AsyncMPClient, MPClient
    from engine.frontend.input_processor import InputProcessor
    from engine.frontend.output_processor import OutputProcessor
    from engine.frontend.outputs import RequestOutput
    from engine.model.sampler import Sampler
    from engine.outputs import ModelRunnerOutput
    from engine.sched.output import SchedulerOutput
    from engine.sched.scheduler import Scheduler
    from engine.worker.model_runner import ModelRunner
    from engine.worker.worker import Worker
    from engine.worker.worker_base import WorkerWrapperBase

    plan = plan_for(())
    (api,), (engine,), (worker,) = plan.api_servers, plan.local_engine_cores, plan.workers
    init, busy = EngineCoreProc.__init__, EngineCoreProc.run_busy_loop
    return {
        "api": api.title, "api_kind": api.kind.value,
        "engine": engine.title, "engine_kind": engine.kind.value,
        "worker": worker.title, "worker_kind": worker.kind.value,
        "route": _q(OpenAIServingCompletion.create_completion),
        "process_inputs": _q(InputProcessor.process_inputs),
        "EngineCoreRequest": EngineCoreRequest.__name__,
        "generate": _q(AsyncLLM.generate),
        "add_request_op": _q(OutputProcessor.add_request),
        "add_request_async": _q(AsyncMPClient.add_request_async),
        "ROUTER": _lit(MPClient.__init__, "zmq.ROUTER", "ROUTER"),
        "PULL": _lit(MPClient.__init__, "zmq.PULL", "PULL"),
        "DEALER": _lit(EngineCoreProc._connect_input_sockets, "zmq.DEALER", "DEALER"),
        "PUSH": _lit(init, "zmq.PUSH", "PUSH"),
        "input_thread": _lit(init, 'name="EngineCoreInputThread"', "EngineCoreInputThread"),
        "output_thread": _lit(init, 'name="EngineCoreOutputThread"', "EngineCoreOutputThread"),
        "process_input_sockets": _lit(init, "target=self.process_input_sockets", "process_input_sockets"),
        "process_output_sockets": _lit(init, "target=self.process_output_sockets", "process_output_sockets"),
        "input_queue": _lit(EngineCoreProc.process_input_sockets, "self.input_queue.put", "input_queue"),
        "output_queue": _lit(busy, "self.output_queue.put", "output_queue"),
        "busy_loop": _q(busy),
        "engine_add_request": _q(EngineCore.add_request),
        "schedule": _q(Scheduler.schedule),
        "SchedulerOutput": SchedulerOutput.__name__,
        "execute_model": _q(MultiprocExecutor.execute_model),
        "WorkerRPC": WorkerRPC.__name__,
        "MessageQueue": MessageQueue.__name__,
        "broadcast_mq": _lit(MultiprocExecutor._init_executor, "self.rpc_broadcast_mq =", "rpc_broadcast_mq"),
        "response_mqs": _lit(MultiprocExecutor._init_executor, "self.response_mqs =", "response_mqs"),
        "worker_response_mq": _lit(WorkerProc.__init__, "self.worker_response_mq =", "worker_response_mq"),
        "worker_busy_loop": _q(WorkerProc.worker_busy_loop),
        "wrapper": WorkerWrapperBase.__name__,
        "worker_execute": _q(Worker.execute_model),
        "ModelRunner": ModelRunner.__name__,
        "Sampler": Sampler.__name__,
        "ModelRunnerOutput": ModelRunnerOutput.__name__,
        "WorkerReply": WorkerReply.__name__,
        "update_from_output": _q(Scheduler.update_from_output),
        "EngineCoreOutputs": EngineCoreOutputs.__name__,
        "route_outputs": _q(OutputRouter.route),
        "output_handler": _lit(AsyncLLM._ensure_output_handler, 'name="AsyncLLM.output_handler"',
                               "AsyncLLM.output_handler"),  # fmt: skip
        "get_output_async": _q(AsyncMPClient.get_output_async),
        "process_outputs": _q(OutputProcessor.process_outputs),
        "RequestOutput": RequestOutput.__name__,
    }  # fmt: skip


# ---------------------------------------------------------------------------- drawing

PROCESS = {  # per process kind: fill, stroke (the process-tree pictures' colours)
    "api": ("#ddf4ff", "#0969da"),
    "engine": ("#fff8c5", "#9a6700"),
    "worker": ("#dafbe1", "#1a7f37"),
}
ZMQ, SHM, LOCAL, STEP = "#0969da", "#1a7f37", "#6e7781", "#cf222e"
LINE = 15  # between the lines of one activity
WIDTH = 1180


Activities = list[tuple[str, list[str]]]  # (step label, its lines)


def _lane_height(activities: Activities) -> float:
    return 39 + sum(LINE * len(lines) + 10 for _, lines in activities)


def _lane(svg: Canvas, x: float, y: float, w: float, title: str, subtitle: str, activities: Activities,
          h: float = 0) -> dict[str, float]:  # fmt: skip
    """A thread (or task) as a white box at least ``h`` high: its name, then numbered
    activities. Returns the y of each activity's first line, by step label."""
    rows: dict[str, float] = {}
    under = len(svg.boxes)
    ty = y + 19
    tw = svg.text(x + 10, ty, title, size=12.5, mono=True, bold=True)
    svg.text(x + 10 + tw + 14, ty, subtitle, size=11.5, colour=MUTED)
    ty += 24
    for label, lines in activities:
        rows[label] = ty
        bw = svg.badge(x + 10, ty - 4, label, STEP)
        for j, line in enumerate(lines):
            svg.text(x + 18 + bw, ty + LINE * j, line, size=11.5)
        ty += LINE * len(lines) + 10
    svg.rect(x, y, w, max(h, _lane_height(activities)), fill="#ffffff", stroke="#8c959f", rx=6, at=under)
    return rows


def _process(svg: Canvas, x: float, y: float, w: float, h: float, kind: str, title: str, note: str,
             under: int, note_x: float | None = None) -> None:  # fmt: skip
    """A process's box, under its threads (drawn since ``under``); ``note`` after the title at
    ``note_x``, or at the right end."""
    fill, stroke = PROCESS[kind]
    svg.rect(x, y, w, h, fill=fill, stroke=stroke, rx=10, width=1.8, at=under)
    svg.text(x + 14, y + 22, title, size=13.5, mono=True, bold=True)
    if note_x is None:
        svg.text(x + w - 14, y + 22, note, size=12, colour=stroke, anchor="end")
    else:
        svg.text(note_x, y + 22, note, size=12, colour=stroke)


def _socket(svg: Canvas, cx: float, y: float, label: str, colour: str) -> None:
    """A socket or queue end as a pill centred on (cx, y), on a process box's edge."""
    w = len(label) * 11.5 * 0.61 + 16
    svg.labels.append(
        f'<rect x="{cx - w / 2:.1f}" y="{y - 10:.1f}" width="{w:.1f}" height="20" rx="10" fill="#ffffff" '
        f'stroke="{colour}" stroke-width="1.6"/>'
    )
    svg.text(cx, y + 4, label, size=11.5, mono=True, bold=True, anchor="middle", colour=colour)


def _queue(svg: Canvas, x1: float, x2: float, y: float, name: str) -> None:
    """A queue.Queue between two threads of one process: an arrow through a striped box."""
    mid = (x1 + x2) / 2
    svg.path([(x1, y), (mid - 26, y)], LOCAL, end=False)
    svg.path([(mid + 26, y), (x2, y)], LOCAL)
    svg.rect(mid - 26, y - 9, 52, 18, fill="#ffffff", stroke=LOCAL, width=1.4)
    for k in (1, 2, 3):
        svg.path([(mid - 26 + 13 * k, y - 9), (mid - 26 + 13 * k, y + 9)], LOCAL, width=1, end=False)
    svg.text(mid, y - 15, name, size=11.5, mono=True, bold=True, anchor="middle", colour=TEXT)
    svg.text(mid, y + 24, "queue.Queue", size=11, anchor="middle", colour=MUTED)


def draw(n: dict[str, str]) -> str:
    svg = Canvas()
    right = WIDTH - MARGIN
    svg.text(MARGIN, MARGIN + 14, "One request's path: a streamed completion through glassbox serve", size=15,
             mono=True, bold=True)  # fmt: skip
    svg.text(MARGIN, MARGIN + 34, "processes, their threads, the sockets and queues between them; the numbers "
             "are the steps of docs/architecture.md's walk", size=12.5, colour=MUTED)  # fmt: skip

    # The HTTP client.
    cy = MARGIN + 52
    svg.rect(MARGIN, cy, right - MARGIN, 32, fill="#f6f8fa", stroke="#8c959f", rx=6)
    svg.text(MARGIN + 14, cy + 21, "HTTP client (curl, the openai client)", size=12.5, bold=True)

    # --- API server: one thread, the event loop; the request's coroutine and the output handler.
    ay = cy + 32 + 56
    lane_y = ay + 36
    left_w, gap = 600, 44
    lx, rx = MARGIN + 16, MARGIN + 16 + left_w + gap
    rw = right - 16 - rx
    api_under = len(svg.boxes)
    request_side: Activities = [
        ("1", ["POST /v1/completions: the body is validated (else a 400)"]),
        ("2", [f"{n['process_inputs']}: tokenise, check max_model_len", f"\u2192 an {n['EngineCoreRequest']}"]),
        ("3a", [f"{n['generate']}: {n['add_request_op']},", f"{n['add_request_async']}: msgpack \u2192 {n['ROUTER']}"]),
        ("8b", [f"await the request's queue: each {n['RequestOutput']} becomes", "an SSE chunk (data: \u2026), then data: [DONE]"]),
    ]  # fmt: skip
    lh = _lane_height(request_side)
    lrows = _lane(svg, lx + 12, lane_y + 30, left_w - 24, n["route"], "the request's coroutine", request_side)
    handler_side: Activities = [
        ("8a", [f"{n['get_output_async']}: {n['EngineCoreOutputs']}", f"from {n['PULL']};  {n['process_outputs']}:",
                f"detokenise, stop strings \u2192 a {n['RequestOutput']}", "onto its request's queue"]),
    ]  # fmt: skip
    rh = _lane_height(handler_side)
    rrows = _lane(svg, rx + 12, lane_y + 30, rw - 24, n["output_handler"], "a task", handler_side)
    inner_h = max(lh, rh) + 30 + 14
    svg.rect(
        lx,
        lane_y,
        right - 16 - lx,
        inner_h,
        fill="#f6f8fa",
        stroke="#8c959f",
        rx=8,
        dashed=True,
        at=api_under,
    )
    svg.text(
        lx + 12, lane_y + 20, "main thread: the asyncio event loop (uvloop)", size=12, bold=True, colour=MUTED
    )
    ah = lane_y + inner_h + 22 - ay
    _process(svg, MARGIN, ay, right - MARGIN, ah, "api", n["api"], f"{n['api_kind']}: FastAPI on uvicorn, no torch",
             api_under)  # fmt: skip
    # The RequestOutput hand-over, output handler -> the request's coroutine.
    hx = rx + 60
    svg.path([(hx, lane_y + 30 + rh), (hx, lrows["8b"]), (lx + left_w - 12, lrows["8b"])], LOCAL)
    assert rrows["8a"] < lrows["8b"]

    # HTTP in and out, at the right end of the request's coroutine.
    hx = lx + left_w - 120
    svg.path([(hx, cy + 32), (hx, lane_y + 30)], TEXT, width=1.8)
    svg.path([(hx + 40, lane_y + 30), (hx + 40, cy + 32)], TEXT, width=1.8)
    svg.text(hx - 8, cy + 52, "HTTP request", size=11.5, anchor="end", chip=True)
    svg.text(hx + 48, cy + 52, "text/event-stream", size=11.5, chip=True)

    # --- Engine core: three threads, two queues; the executor's shared-memory queues below.
    ey = ay + ah + 84
    ly = ey + 44
    in_x, in_w = MARGIN + 16, 250
    busy_x, busy_w = in_x + in_w + 96, 430
    out_x = busy_x + busy_w + 96
    out_w = right - 16 - out_x
    engine_under = len(svg.boxes)
    input_side: Activities = [
        ("3b", [f"{n['process_input_sockets']}:", f"{n['DEALER']} recv, decode the", f"{n['EngineCoreRequest']}",
                f"\u2192 {n['input_queue']}"]),
    ]  # fmt: skip
    busy_side: Activities = [
        ("3c", [f"{n['engine_add_request']}: a Request with its", "block hashes, into the Scheduler's waiting queue"]),
        ("4", [f"{n['schedule']} \u2192 a {n['SchedulerOutput']}", "(token budget; KVCacheManager.allocate_slots)"]),
        ("5a", [f"{n['execute_model']}: the {n['SchedulerOutput']}", f"in one {n['WorkerRPC']} onto {n['broadcast_mq']}"]),
        ("7b", [f"{n['WorkerReply']} from {n['response_mqs']}[0] \u2192 {n['ModelRunnerOutput']};",
                f"{n['update_from_output']} \u2192 {n['EngineCoreOutputs']};",
                f"{n['route_outputs']} \u2192 {n['output_queue']}"]),
    ]  # fmt: skip
    output_side: Activities = [
        ("7c", [f"{n['process_output_sockets']}:", f"take from {n['output_queue']},", f"encode, {n['PUSH']} to the",
                f"client's {n['PULL']}"]),
    ]  # fmt: skip
    bh = max(map(_lane_height, (input_side, busy_side, output_side)))
    irows = _lane(svg, in_x, ly, in_w, n["input_thread"], "", input_side, bh)
    brows = _lane(svg, busy_x, ly, busy_w, "main thread", n["busy_loop"], busy_side, bh)
    _lane(svg, out_x, ly, out_w, n["output_thread"], "", output_side, bh)
    eh = bh + 44 + 18
    _process(svg, MARGIN, ey, right - MARGIN, eh, "engine", n["engine"],
             f"{n['engine_kind']}: three threads (EngineCoreProc)", engine_under, busy_x)  # fmt: skip
    _queue(svg, in_x + in_w, busy_x, irows["3b"] + 3 * LINE - 4, n["input_queue"])
    _queue(svg, busy_x + busy_w, out_x, brows["7b"] + 2 * LINE - 4, n["output_queue"])

    # ZMQ between the API server and the engine core: in on the left, out on the right.
    zin = in_x + in_w - 40  # clear of the process's title
    zout = out_x + out_w / 2
    svg.path([(zin, lane_y + 30 + lh), (zin, ly)], ZMQ)
    svg.path([(zout, ly), (zout, lane_y + 30 + rh)], ZMQ)
    _socket(svg, zin, ay + ah, f"{n['ROUTER']} (bind)", ZMQ)
    _socket(svg, zin, ey, f"{n['DEALER']} (connect)", ZMQ)
    _socket(svg, zout, ay + ah, f"{n['PULL']} (bind)", ZMQ)
    _socket(svg, zout, ey, f"{n['PUSH']} (connect)", ZMQ)
    mid = (ay + ah + ey) / 2
    svg.text(zin + 14, mid - 2, f"{n['EngineCoreRequest']} (msgpack)", size=11.5, colour=ZMQ, bold=True)
    svg.text(zin + 14, mid + 13, "ZMQ, ipc:// in the run directory", size=11.5, colour=ZMQ)
    svg.text(zout - 14, mid - 2, f"{n['EngineCoreOutputs']} (msgpack)", size=11.5, colour=ZMQ, bold=True,
             anchor="end")  # fmt: skip
    svg.text(zout - 14, mid + 13, "one PUSH per client (API server)", size=11.5, colour=ZMQ, anchor="end")

    # --- Worker: one thread.
    wy = ey + eh + 96
    wx, ww = busy_x - 250, busy_w + 520
    worker_under = len(svg.boxes)
    worker_side: Activities = [
        ("5b", [f"{n['broadcast_mq']}.dequeue \u2192 {n['wrapper']} \u2192 {n['worker_execute']}",
                f"\u2192 {n['ModelRunner']}: update its mirror, build the batch, block tables, slot_mapping"]),
        ("6", ["the model's forward: paged attention writes K/V at the slot_mapping;",
               f"{n['Sampler']}: the next token \u2192 a {n['ModelRunnerOutput']}"]),
        ("7a", [f"a {n['WorkerReply']} onto {n['worker_response_mq']} (the output rank only)"]),
    ]  # fmt: skip
    _lane(svg, wx + 16, wy + 44, ww - 32, "main thread", n["worker_busy_loop"], worker_side)
    wh = _lane_height(worker_side) + 44 + 18
    _process(svg, wx, wy, ww, wh, "worker", n["worker"], f"{n['worker_kind']}: one thread (WorkerProc)",
             worker_under)  # fmt: skip
    down, up = busy_x + 90, busy_x + busy_w - 90
    svg.path([(down, ly + bh), (down, wy + 44)], SHM)
    svg.path([(up, wy + 44), (up, ly + bh)], SHM)
    _socket(svg, down, ey + eh, f"{n['broadcast_mq']} (write)", SHM)
    _socket(svg, down, wy, f"{n['broadcast_mq']} (read)", SHM)
    _socket(svg, up, ey + eh, f"{n['response_mqs']}[0] (read)", SHM)
    _socket(svg, up, wy, f"{n['worker_response_mq']} (write)", SHM)
    mid = (ey + eh + wy) / 2
    svg.text(down - 14, mid - 2, f"{n['SchedulerOutput']} in a {n['WorkerRPC']}", size=11.5, colour=SHM, bold=True,
             anchor="end")  # fmt: skip
    svg.text(down - 14, mid + 13, f"shared memory ({n['MessageQueue']}, run dir)", size=11.5, colour=SHM,
             anchor="end")  # fmt: skip
    svg.text(
        up + 14, mid - 2, f"{n['WorkerReply']} ({n['ModelRunnerOutput']})", size=11.5, colour=SHM, bold=True
    )
    svg.text(up + 14, mid + 13, f"one response {n['MessageQueue']} per worker", size=11.5, colour=SHM)

    # The legend.
    y = wy + wh + 36
    for colour, text in [
        (ZMQ, "ZMQ sockets between processes (the API server binds, the engine core connects)"),
        (
            SHM,
            "shared-memory ring buffers (MessageQueue): one broadcast queue, one response queue per worker",
        ),
        (
            LOCAL,
            "within a process: a queue.Queue between threads, the request's asyncio queue in the API server",
        ),
        (TEXT, "HTTP between the client and the API server"),
    ]:
        svg.path([(MARGIN, y - 4), (MARGIN + 36, y - 4)], colour)
        svg.text(MARGIN + 46, y, text, size=12)
        y += 20
    svg.badge(MARGIN + 4, y - 4, "3a", STEP)
    svg.text(MARGIN + 46, y, "a step of docs/architecture.md's walk (3a, 3b, 3c: the parts of step 3), in order",
             size=12)  # fmt: skip
    return svg.render("One request's path across processes, threads, sockets and queues",
                      f"{n['api']}, {n['engine']}, {n['worker']}", f"`{COMMAND}` from "
                      "engine/distributed/request_path_picture.py")  # fmt: skip


def render() -> dict[str, str]:
    """The picture: file name -> SVG text."""
    return {FILE_NAME: draw(_names())}


def write_pictures(out_dir: Path) -> list[Path]:
    return write_svgs(render(), out_dir)
