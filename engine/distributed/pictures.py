"""The process-tree pictures (``docs/pictures/process-tree-*.svg``), drawn from the topology plan.

Each picture is what one ``glassbox serve`` command starts: the command line is parsed by
the serve parser, turned into an ``EngineConfig`` and planned by ``topology.plan`` exactly as
``engine/cli/serve.py`` does, so a picture cannot show a process the tree does not have::

    .venv/bin/python -m engine.distributed.pictures            # writes docs/pictures/

The same command draws the other pictures there too: one request's path
(``engine/distributed/request_path_picture.py``), the paged KV cache
(``engine/kv_cache/pictures.py``), one engine step on the engine core's threads
(``engine/core/step_picture.py``, from a recorded trace), one data-parallel request wave
(``engine/core/wave_picture.py``) and one under expert parallelism (``engine/core/ep_wave_picture.py``).

A test regenerates them and compares byte for byte (``tests/unit/distributed/test_pictures.py``).

What is drawn (``docs/architecture.md`` says the same in words):

- one box per process: its title (``glassbox::EngineCore_DP0``), its kind, what it holds;
- grey arrows: who starts whom. ``APIServer_0`` (the ``glassbox serve`` process) starts the
  DP coordinator and every engine core (``engine/frontend/engine_launcher.py``), then the other
  API servers (``engine/entrypoints/openai/multi_api_server.py``); each engine core starts its
  workers (``engine/executor/multiproc_executor.py``);
- blue: the ZMQ sockets between the API servers and the engine cores (``ipc://`` in the run
  directory): each API server binds an input ROUTER and an output PULL, each engine core
  connects a DEALER and a PUSH to every API server;
- green: the shared-memory queues (``MessageQueue``, files in the run directory): one
  broadcast queue from the engine core to all its workers, one response queue per worker;
- magenta: the DP coordinator's ZMQ sockets: engine cores PUSH their loads to its PULL, it
  publishes waves to the engine cores and the load table to the API servers (PUB/SUB);
- purple, dashed: the collectives between the tensor-parallel workers (``torch.distributed``).

The SVG is drawn on the shared canvas (``engine/utils/svg.py``): no dependency, fixed geometry,
generic fonts, a white background so it reads on light and dark pages, and nothing that
changes between runs.
"""

from __future__ import annotations

import argparse
import shlex
from pathlib import Path

from engine.distributed import topology
from engine.distributed.topology import ProcessRole, RoleKind, TopologyPlan
from engine.utils.svg import MARGIN, MUTED, TEXT, Canvas, write_svgs

# The pictures: file stem -> the flags of `glassbox serve` it shows.
SHAPES: dict[str, tuple[str, ...]] = {
    "process-tree-default": (),
    "process-tree-tp2": ("-tp", "2"),
    "process-tree-dp2": ("-dp", "2"),
}
DOCS_DIR = Path(__file__).resolve().parents[2] / "docs" / "pictures"
COMMAND = "python -m engine.distributed.pictures"

# ---------------------------------------------------------------------------- geometry

BOX_W, BOX_H = 268, 66
ROW_GAP = 150  # between the bottom of a row and the top of the next

# Per kind: fill, stroke, what the process holds.
KIND_STYLE: dict[RoleKind, tuple[str, str, str]] = {
    RoleKind.API_SERVER: ("#ddf4ff", "#0969da", "HTTP, tokenizer, detokenizer (AsyncLLM)"),
    RoleKind.ENGINE_CORE: ("#fff8c5", "#9a6700", "scheduler, KV cache manager, busy loop"),
    RoleKind.WORKER: ("#dafbe1", "#1a7f37", "the model, its KV cache"),
    RoleKind.DP_COORDINATOR: ("#ffeff7", "#bf3989", "load table, request waves"),
}

# Per link: colour, dashed, what the legend says.
LINKS: dict[str, tuple[str, bool, str]] = {
    "spawn": ("#6e7781", False, "starts: parent \u2192 child, the tree glassbox ps shows"),
    "zmq": (
        "#0969da",
        False,
        "ZMQ, ipc:// in the run directory: requests ROUTER \u2192 DEALER, outputs PUSH \u2192 PULL",
    ),  # fmt: skip
    "shm": (
        "#1a7f37",
        False,
        "shared memory (MessageQueue files in the run directory): "
        "one broadcast queue, a response queue per worker",
    ),  # fmt: skip
    "coord": (
        "#bf3989",
        False,
        "the coordinator's ZMQ: loads PUSH \u2192 PULL, waves and load tables PUB \u2192 SUB",
    ),  # fmt: skip
    "collective": (
        "#8250df",
        True,
        "torch.distributed collectives between TP ranks (gloo on CPU, NCCL on CUDA)",
    ),
}


def _link(svg: Canvas, points: list[tuple[float, float]], link: str, *, start: bool = False,
          end: bool = True, halo: bool = False) -> None:  # fmt: skip
    """A line of kind ``link`` (``LINKS``) through ``points``; ``halo``: on a wide white band, so
    a line it crosses is seen to pass under it, not to join it."""
    colour, dashed, _ = LINKS[link]
    svg.path(points, colour, width=1.6 if link == "spawn" else 2, dashed=dashed, start=start, end=end,
             halo=halo)  # fmt: skip


def _box(svg: Canvas, x: float, y: float, role: ProcessRole, detail: str) -> None:
    """One process: its title, its kind and what it holds, on its kind's colours."""
    fill, stroke, _ = KIND_STYLE[role.kind]
    svg.rect(x, y, BOX_W, BOX_H, fill=fill, stroke=stroke, rx=8, width=1.5)
    svg.text(x + 12, y + 21, role.title, size=13, mono=True, bold=True)
    svg.text(x + 12, y + 39, role.kind.value, size=12, mono=True, colour=stroke)
    svg.text(x + 12, y + 56, detail, size=11.5, colour=MUTED)


# ---------------------------------------------------------------------------- the plan


def plan_for(flags: tuple[str, ...]) -> TopologyPlan:
    """The plan of ``glassbox serve FLAGS``: parsed, configured and planned as the CLI does."""
    from engine.config_reference import serve_parser
    from engine.engine_args import EngineArgs

    args = serve_parser().parse_args(list(flags))
    config = EngineArgs.from_cli_args(args).create_engine_config(usage_context="serve")
    return topology.plan(config, frontend="serve", api_server_count=args.api_server_count)


def _detail(plan: TopologyPlan, role: ProcessRole) -> str:
    detail = KIND_STYLE[role.kind][2]
    if role.kind is RoleKind.WORKER:
        detail += f" (rank {plan.worker_rank(role)})"
        if plan.tensor_parallel_size > 1:
            detail = f"the model, TP rank {role.tp_rank} of {plan.tensor_parallel_size}, KV cache"
    return detail


# ---------------------------------------------------------------------------- drawing


def _pair(svg: Canvas, top: tuple[float, float], bottom: tuple[float, float], link: str,
          spread: float = 14) -> None:  # fmt: skip
    """Two straight arrows between a box above and a box below: down (left), up (right)."""
    (x1, y1), (x2, y2) = top, bottom
    _link(svg, [(x1 - spread / 2, y1), (x2 - spread / 2, y2)], link)
    _link(svg, [(x2 + spread / 2, y2), (x1 + spread / 2, y1)], link)


def _workers(svg: Canvas, plan: TopologyPlan, engine: ProcessRole, ex: float, ey: float,
             wy: float, wx: list[float]) -> None:  # fmt: skip
    """An engine core's workers: start arrows, the broadcast and response queues, the TP collectives."""
    workers = plan.workers_of(engine.dp_rank)
    n = len(workers)
    # Per worker three anchors on the engine core's bottom edge, in the workers' order, so that
    # no two lines cross: start (grey), broadcast (down), response (up).
    step = BOX_W / (3 * n + 1)
    for i, x in enumerate(wx):
        s, b = ex + step * (3 * i + 1), ex + step * (3 * i + 2)
        r = ex + step * (3 * i + 3)
        ds, db, dr = x + BOX_W * 0.22, x + BOX_W * 0.5 - 7, x + BOX_W * 0.5 + 7
        if n == 1:  # straight down
            s, b, r = ds - x + ex, db - x + ex, dr - x + ex
        _link(svg, [(s, ey + BOX_H), (ds, wy)], "spawn")
        _link(svg, [(b, ey + BOX_H), (db, wy)], "shm")
        _link(svg, [(dr, wy), (r, ey + BOX_H)], "shm")
    # The label of the queues: beside the lines of one worker; of several, above the first.
    if n == 1:
        lx, ly = wx[0] + BOX_W * 0.5 + 16, ey + BOX_H + (wy - ey - BOX_H) / 2 - 10
    else:
        lx, ly = wx[0] - 2, ey + BOX_H + 10
    lines = ["shared memory (run dir)", "\u2193 SchedulerOutput, broadcast", "\u2191 WorkerReply, own queue"]
    for j, line in enumerate(lines):
        svg.text(lx, ly + 15 * j, line, size=11.5, bold=j == 0, colour=LINKS["shm"][0], chip=True)
    # Tensor-parallel collectives: between neighbours in a stage.
    for i in range(n - 1):
        a, b = workers[i], workers[i + 1]
        if a.pp_rank == b.pp_rank:
            y = wy + BOX_H / 2
            _link(svg, [(wx[i] + BOX_W, y), (wx[i + 1], y)], "collective", start=True)
            gx = (wx[i] + BOX_W + wx[i + 1]) / 2
            svg.text(gx, y - 8, "all-reduce, all-gather", size=11.5, anchor="middle",
                     colour=LINKS["collective"][0], chip=True)  # fmt: skip
            svg.text(gx, y + 18, "gloo (CPU) / NCCL", size=11.5, anchor="middle",
                     colour=LINKS["collective"][0], chip=True)  # fmt: skip


def draw(plan: TopologyPlan, flags: tuple[str, ...]) -> str:
    """The SVG of ``plan`` (a ``serve`` plan on one node), for the command ``glassbox serve FLAGS``.

    Raises:
        ValueError: a plan this layout cannot draw without crossing lines (not ``serve``, or
            more than two engine cores).
    """
    if plan.mode != "serve" or plan.data_parallel_size > 2 or plan.remote_engine_cores:
        raise ValueError(f"no picture layout for this tree ({plan.describe()})")
    svg = Canvas()
    command = " ".join(["glassbox serve", *map(shlex.quote, flags)])
    svg.text(MARGIN, MARGIN + 14, command, size=15, mono=True, bold=True)
    svg.text(MARGIN, MARGIN + 34, plan.describe() + " processes", size=12.5, colour=MUTED)

    engines = plan.local_engine_cores
    coordinator = plan.coordinator
    api = plan.api_servers
    bus = len(api) > 1 or len(engines) > 1
    gutter = 26  # between a gutter line and the boxes
    top = MARGIN + 58
    bus_y = top + 44 if bus else None
    api_y = top + (96 if bus else 10)
    eng_y = api_y + BOX_H + ROW_GAP
    wrk_y = eng_y + BOX_H + ROW_GAP
    left = MARGIN + (gutter + 4 if bus else 0)

    # Engine groups, left to right, the coordinator between the first and the second.
    tp_gap = 190
    groups: list[tuple[ProcessRole, float, list[float]]] = []
    coord_x = None
    x = left
    for k, engine in enumerate(engines):
        n = len(plan.workers_of(engine.dp_rank)) if plan.workers_in_processes else 0
        width = max(BOX_W, n * BOX_W + (n - 1) * tp_gap)
        ex = x + (width - BOX_W) / 2
        wx = [x + i * (BOX_W + tp_gap) for i in range(n)]
        groups.append((engine, ex, wx))
        x += width + 230
        if k == 0 and coordinator is not None:
            coord_x = x
            x += BOX_W + 230
    right = x - 230

    # API servers: APIServer_0 above the middle of the engine row, the others to its right.
    centre = (left + right) / 2
    a0x = centre - BOX_W / 2
    api_x = [a0x + i * (BOX_W + 190) for i in range(len(api))]

    # Boxes.
    for role, ax in zip(api, api_x, strict=True):
        _box(svg, ax, api_y, role, _detail(plan, role))
    for engine, ex, wx in groups:
        _box(svg, ex, eng_y, engine, _detail(plan, engine))
        for role, x in zip(plan.workers_of(engine.dp_rank), wx, strict=True):
            _box(svg, x, wrk_y, role, _detail(plan, role))
        if wx:
            _workers(svg, plan, engine, ex, eng_y, wrk_y, wx)
    if coordinator is not None:
        _box(svg, coord_x, eng_y, coordinator, _detail(plan, coordinator))

    # APIServer_0 starts the other API servers (beside it) and the engine side (below it).
    for i in range(1, len(api)):
        y = api_y + BOX_H / 2
        _link(svg, [(api_x[i - 1] + BOX_W, y), (api_x[i], y)], "spawn")
        mx = (api_x[i - 1] + BOX_W + api_x[i]) / 2
        svg.text(mx, y - 8, "starts, once the", size=11.5, anchor="middle", colour=MUTED)
        svg.text(mx, y + 18, "engines are ready", size=11.5, anchor="middle", colour=MUTED)
    children = [(ex, engine) for engine, ex, _ in groups]
    if coordinator is not None:
        children.insert(1, (coord_x, coordinator))
    n = len(children)
    for i, (cx, _) in enumerate(children):
        if n == 1:  # beside the ZMQ arrows
            sx, dx = a0x + BOX_W * 0.22, cx + BOX_W * 0.22
        else:  # a fan from the bottom edge to each child's top middle
            sx, dx = a0x + BOX_W * (i + 1) / (n + 1), cx + BOX_W / 2
        _link(svg, [(sx, api_y + BOX_H), (dx, eng_y)], "spawn")

    zmq_colour = LINKS["zmq"][0]
    if not bus:
        # One API server, one engine core: two straight arrows beside the start arrow.
        (engine, ex, _), ax = groups[0], api_x[0]
        _pair(svg, (ax + BOX_W * 0.5, api_y + BOX_H), (ex + BOX_W * 0.5, eng_y), "zmq")
        lx, mid = ax + BOX_W * 0.5 + 20, api_y + BOX_H + ROW_GAP / 2
        for j, line in enumerate(["ZMQ, ipc:// (run dir)", "\u2193 EngineCoreRequest, ROUTER \u2192 DEALER",
                                  "\u2191 EngineCoreOutputs, PUSH \u2192 PULL"]):  # fmt: skip
            svg.text(lx, mid - 10 + 15 * j, line, size=11.5, bold=j == 0, colour=zmq_colour, chip=True)
    else:
        # Every engine core talks to every API server: one line above the API servers that
        # each of them taps, the engine cores through the gutters at the sides.
        gl, gr = MARGIN + 4, right + gutter
        _link(svg, [(gl, bus_y), (gr, bus_y)], "zmq", end=False)
        for ax in api_x:
            _link(svg, [(ax + BOX_W / 2, bus_y), (ax + BOX_W / 2, api_y)], "zmq", start=True)
        for k, (_, ex, _) in enumerate(groups):
            y = eng_y + BOX_H / 2
            if k == 0:
                _link(svg, [(ex, y), (gl, y), (gl, bus_y)], "zmq", start=True, end=False)
            else:
                _link(svg, [(ex + BOX_W, y), (gr, y), (gr, bus_y)], "zmq", start=True, end=False)
        # The label above the line, left of APIServer_0's tap.
        for j, line in enumerate(["ZMQ, ipc:// (run dir): every engine core \u2194 every API server",
                                  "requests ROUTER \u2192 DEALER, outputs PUSH \u2192 PULL"]):  # fmt: skip
            svg.text(gl + 24, bus_y - 24 + 15 * j, line, size=11.5, bold=j == 0, colour=zmq_colour)
        if coordinator is not None:
            # The coordinator publishes the load table to every API server: up beside the start
            # arrow into APIServer_0, and along a line under the API servers into each of the
            # others. That line has to cross APIServer_0's start arrow to EngineCore_DP1 (the
            # graph is not planar: APIServer_0, the coordinator and the ZMQ bus each reach
            # APIServer_1 and both engine cores), so it is drawn on a white band.
            colour = LINKS["coord"][0]
            taps = [ax + BOX_W / 2 + 40 for ax in api_x]
            under = api_y + BOX_H + 50
            _link(svg, [(taps[-1], under), (taps[0], under)], "coord", end=False, halo=True)
            _link(svg, [(taps[0], eng_y), (taps[0], api_y + BOX_H)], "coord")
            for tx in taps[1:]:
                _link(svg, [(tx, under), (tx, api_y + BOX_H)], "coord")
            label = ["PUB \u2192 SUB", "EngineLoads, the load table,", "to every API server"]
            for j, line in enumerate(label):
                svg.text(taps[0] + 8, under + 22 + 15 * j, line, size=11.5, colour=colour, chip=True)
            # ... and talks with each engine core beside it.
            for _, ex, _ in groups:
                on_left = ex < coord_x
                near, far = (ex + BOX_W, coord_x) if on_left else (ex, coord_x + BOX_W)
                y1, y2 = eng_y + 22, eng_y + BOX_H - 16
                _link(svg, [(near, y1), (far, y1)], "coord")
                _link(svg, [(far, y2), (near, y2)], "coord")
                mx = (near + far) / 2
                colour = LINKS["coord"][0]
                svg.text(mx, y1 - 8, "EngineLoad, StartWave", size=11.5, anchor="middle", colour=colour)
                svg.text(mx, y2 + 18, "DPWave", size=11.5, anchor="middle", colour=colour)

    # The legend.
    y = svg.max_y + 30
    for link, (_, _, text) in LINKS.items():
        if link == "coord" and coordinator is None or link == "collective" and plan.tensor_parallel_size == 1:
            continue
        _link(svg, [(MARGIN, y - 4), (MARGIN + 36, y - 4)], link)
        svg.text(MARGIN + 46, y, text, size=12, colour=TEXT)
        y += 20
    return svg.render(
        f"The processes of {command}", plan.describe(), f"`{COMMAND}` from engine/distributed/topology.py"
    )


def render_all() -> dict[str, str]:
    """Every picture: file name -> SVG text."""
    return {f"{stem}.svg": draw(plan_for(flags), flags) for stem, flags in SHAPES.items()}


def write_pictures(out_dir: Path = DOCS_DIR) -> list[Path]:
    """Write every picture into ``out_dir``; returns the paths written."""
    return write_svgs(render_all(), out_dir)


def write_every_picture(out_dir: Path = DOCS_DIR) -> list[Path]:
    """The process trees, one request's path, the paged KV cache, one engine step, one DP wave
    and one wave under expert parallelism: every picture of ``docs/pictures/``, each from its
    own module; returns the paths written."""
    from engine.core import ep_wave_picture, step_picture, wave_picture
    from engine.distributed import request_path_picture
    from engine.kv_cache import pictures as kv_cache_pictures

    return [
        *write_pictures(out_dir),
        *request_path_picture.write_pictures(out_dir),
        *kv_cache_pictures.write_pictures(out_dir),
        *step_picture.write_pictures(out_dir),
        *wave_picture.write_pictures(out_dir),
        *ep_wave_picture.write_pictures(out_dir),
    ]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog=COMMAND, description="Draw every picture of docs/pictures/.")
    parser.add_argument(
        "--out", type=Path, default=DOCS_DIR, help="the folder to write (default: docs/pictures)"
    )
    for path in write_every_picture(parser.parse_args(argv).out):
        print(path)


if __name__ == "__main__":
    main()
