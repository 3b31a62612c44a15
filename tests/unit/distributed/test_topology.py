"""The topology plan: every process of a Glassbox tree, named in one place.

``engine/distributed/topology.py`` makes and parses every role name, title, log prefix and
status-file name, and counts the processes of any shape (A + DP + DP·PP·TP, +1 coordinator
when DP > 1). The config refuses tp/pp/dp > 1 for now, so the shapes are built from a
``ParallelConfig``-like object; today's 1×1×1 tree is checked against the manifest the engine
wrote before the plan existed, byte for byte.
"""

from __future__ import annotations

import json
import logging
import os
import time
from types import SimpleNamespace

import msgspec
import pytest

from engine.distributed import topology
from engine.distributed.topology import ProcessRole, RoleKind, TopologyPlan
from engine.utils import run_dir as run_dirs


def _shape(tp: int = 1, pp: int = 1, dp: int = 1, backend: str = "mp") -> SimpleNamespace:
    return SimpleNamespace(
        tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
        data_parallel_size=dp,
        distributed_executor_backend=backend,
    )


ROLES = [
    ProcessRole.api_server(0),
    ProcessRole.api_server(12),
    ProcessRole.engine_core(0),
    ProcessRole.engine_core(3),
    ProcessRole.worker(0, 0, 0),
    ProcessRole.worker(1, 2, 3),
    ProcessRole.worker(10, 0, 11),
    ProcessRole.dp_coordinator(),
    ProcessRole.frontend(),
]
NAMES = [
    "APIServer_0",
    "APIServer_12",
    "EngineCore_DP0",
    "EngineCore_DP3",
    "Worker_DP0_PP0_TP0",
    "Worker_DP1_PP2_TP3",
    "Worker_DP10_PP0_TP11",
    "DPCoordinator",
    "LLM",
]


# ---------------------------------------------------------------------------- names


@pytest.mark.parametrize(("role", "name"), list(zip(ROLES, NAMES, strict=True)), ids=NAMES)
def test_names_round_trip_through_parse(role, name, tmp_path):
    assert role.name == str(role) == name
    assert ProcessRole.parse(name) == role
    assert role.title == f"glassbox::{name}"
    assert ProcessRole.from_title(role.title + " extra words") == role
    assert role.log_prefix(4242) == f"({name} pid=4242)"
    assert role.status_file_name == f"{name}.status.json"
    assert (
        run_dirs.status_file(tmp_path, role)
        == run_dirs.status_file(tmp_path, name)
        == tmp_path / role.status_file_name
    )
    (tmp_path / role.status_file_name).write_text("{}")
    assert list(run_dirs.status_files(tmp_path)) == [name]  # the reader gets the name back


@pytest.mark.parametrize(
    "name",
    ["", "EngineCore_DP", "EngineCore_DP01", "EngineCore_DP-1", "Worker_DP0_PP0", "worker_dp0_pp0_tp0",
     "APIServer_x", "EngineCore_DP0 ", "glassbox::EngineCore_DP0", "DPCoordinator_0", "Main"],
)  # fmt: skip
def test_a_bad_name_raises_value_error_naming_it(name):
    with pytest.raises(ValueError, match="not a Glassbox process role") as info:
        ProcessRole.parse(name)
    assert repr(name) in str(info.value)
    assert topology.kind_of(name) == "unknown"


def test_titles_that_are_not_glassbox_are_not_roles():
    assert topology.name_from_title("python -m multiprocessing.resource_tracker") is None
    assert topology.name_from_title("glassbox::") is None
    assert topology.name_from_title(None) is None
    with pytest.raises(ValueError, match="not a Glassbox process title"):
        ProcessRole.from_title("python foo.py")


def test_a_role_carries_exactly_the_ranks_of_its_kind():
    with pytest.raises(ValueError, match="needs tp_rank"):
        ProcessRole.worker(0, 0, -1)
    with pytest.raises(ValueError, match="needs dp_rank"):
        ProcessRole(RoleKind.ENGINE_CORE)
    with pytest.raises(ValueError, match="has no tp_rank"):
        ProcessRole(RoleKind.ENGINE_CORE, dp_rank=0, tp_rank=0)
    # Typed on the wire too: msgspec checks the ranks when it decodes.
    role = ProcessRole.worker(1, 0, 1)
    assert msgspec.json.decode(msgspec.json.encode(role), type=ProcessRole) == role
    with pytest.raises(msgspec.ValidationError):
        msgspec.json.decode(b'{"kind": "worker", "dp_rank": 0}', type=ProcessRole)


def test_worker_rank_is_pp_times_tp_size_plus_tp():
    assert ProcessRole.worker(0, 1, 2).worker_rank(4) == 6
    for rank in range(8):
        assert ProcessRole.worker_of_rank(3, rank, 4).worker_rank(4) == rank
    assert ProcessRole.worker_of_rank(3, 5, 4) == ProcessRole.worker(3, 1, 1)
    with pytest.raises(ValueError, match="not a worker"):
        ProcessRole.engine_core(0).worker_rank(1)
    with pytest.raises(ValueError, match="out of range"):
        ProcessRole.worker(0, 0, 2).worker_rank(2)


def test_log_prefix_is_what_the_logger_prints():
    from engine.logger import get_process_role, init_logger, set_process_role

    init_logger("engine.test_topology")
    handler = logging.getLogger("engine").handlers[0]
    role, before = ProcessRole.worker(0, 0, 1), get_process_role()
    set_process_role(role.name)
    try:
        record = logging.LogRecord("engine.x", logging.INFO, __file__, 1, "hello", None, None)
        assert handler.filter(record)
        assert handler.format(record).startswith(role.log_prefix(os.getpid()) + " INFO ")
    finally:
        set_process_role(before)


# ---------------------------------------------------------------------------- plan shapes


def _kinds(a: int = 0, e: int = 0, w: int = 0, c: int = 0, f: int = 0) -> dict[str, int]:
    """Counted roles by kind: API servers, engine cores, workers, coordinator, in-process frontend."""
    counts = {"api_server": a, "engine_core": e, "worker": w, "dp_coordinator": c, "frontend": f}
    return {kind: n for kind, n in counts.items() if n}


SERVE = {"frontend": "serve"}
# (id, shape, plan() keywords, expected count, counted roles by kind, names in order or None)
SHAPES = [
    ("serve 1x1x1", _shape(), SERVE, 3, _kinds(a=1, e=1, w=1),
     ["APIServer_0", "EngineCore_DP0", "Worker_DP0_PP0_TP0"]),
    ("LLM mp 1x1x1", _shape(), {}, 2, _kinds(e=1, w=1), ["LLM", "EngineCore_DP0", "Worker_DP0_PP0_TP0"]),
    ("LLM inproc", _shape(backend="uni"), {"multiprocess": False}, 1, _kinds(f=1), ["LLM"]),
    ("LLM inproc -tp 2 (mp workers)", _shape(tp=2), {"multiprocess": False}, 3, _kinds(f=1, w=2),
     ["LLM", "Worker_DP0_PP0_TP0", "Worker_DP0_PP0_TP1"]),
    ("LLM uni executor", _shape(backend="uni"), {}, 1, _kinds(e=1), ["LLM", "EngineCore_DP0"]),
    ("serve uni executor", _shape(backend="uni"), SERVE, 2, _kinds(a=1, e=1),
     ["APIServer_0", "EngineCore_DP0"]),
    ("LLM mp -tp 2", _shape(tp=2), {}, 3, _kinds(e=1, w=2),
     ["LLM", "EngineCore_DP0", "Worker_DP0_PP0_TP0", "Worker_DP0_PP0_TP1"]),
    ("serve -tp 2", _shape(tp=2), SERVE, 4, _kinds(a=1, e=1, w=2), None),
    ("serve -tp 4", _shape(tp=4), SERVE, 6, _kinds(a=1, e=1, w=4), None),
    ("serve -pp 2", _shape(pp=2), SERVE, 4, _kinds(a=1, e=1, w=2),
     ["APIServer_0", "EngineCore_DP0", "Worker_DP0_PP0_TP0", "Worker_DP0_PP1_TP0"]),
    ("serve -dp 2", _shape(dp=2), SERVE, 7, _kinds(a=2, e=2, w=2, c=1),
     ["APIServer_0", "APIServer_1", "EngineCore_DP0", "Worker_DP0_PP0_TP0", "EngineCore_DP1",
      "Worker_DP1_PP0_TP0", "DPCoordinator"]),
    ("serve -tp 2 -dp 2", _shape(tp=2, dp=2), SERVE, 9, _kinds(a=2, e=2, w=4, c=1), None),
    ("serve -tp 2 -dp 4", _shape(tp=2, dp=4), SERVE, 17, _kinds(a=4, e=4, w=8, c=1), None),
    ("serve --api-server-count 1 -dp 2", _shape(dp=2), {**SERVE, "api_server_count": 1}, 6,
     _kinds(a=1, e=2, w=2, c=1), None),
    ("LLM mp -dp 2", _shape(dp=2), {}, 5, _kinds(e=2, w=2, c=1), None),
    ("serve -tp 2 -pp 2 -dp 2", _shape(tp=2, pp=2, dp=2), SERVE, 13, _kinds(a=2, e=2, w=8, c=1), None),
]  # fmt: skip


@pytest.mark.parametrize(("shape", "kwargs", "count", "kinds", "names"), [s[1:] for s in SHAPES],
                         ids=[s[0] for s in SHAPES])  # fmt: skip
def test_plan_counts_and_titles(shape, kwargs, count, kinds, names):
    p = topology.plan(shape, **kwargs)
    assert p.expected_process_count == count
    counted = {}
    for role in p.counted_roles:
        counted[role.kind.value] = counted.get(role.kind.value, 0) + 1
    assert counted == kinds
    if names is not None:
        assert [r.name for r in p.roles] == names
    # The formula: A + DP + DP·PP·TP (+1) when workers have processes.
    dp, world = shape.data_parallel_size, shape.tensor_parallel_size * shape.pipeline_parallel_size
    if p.workers_in_processes:  # in inproc mode the LLM stands for the engine core
        assert count == p.api_server_count + dp + dp * world + (dp > 1)
    # Every role is unique, parses back from its title, and lies under the owner first.
    assert len(set(p.roles)) == len(p.roles)
    assert all(ProcessRole.from_title(r.title) == r for r in p.roles)
    assert p.owner == p.roles[0]
    assert p.describe().endswith(f"= {count}")
    # Engine order: each engine core (not in inproc mode: it is the LLM), then its workers in rank order.
    expected = []
    for k in range(dp):
        if p.mode != "inproc":
            expected.append(ProcessRole.engine_core(k))
        if p.workers_in_processes:
            expected.extend(p.workers_of(k))
    assert list(p.engine_processes()) == expected


@pytest.mark.parametrize(
    ("shape", "kwargs", "stage", "roles"),
    [
        (_shape(dp=2), SERVE, "engine_core.init", ["EngineCore_DP0", "EngineCore_DP1"]),
        (_shape(tp=2), SERVE, "worker.load_model", ["Worker_DP0_PP0_TP0", "Worker_DP0_PP0_TP1"]),
        (_shape(dp=2), SERVE, "dp_coordinator.wave", ["DPCoordinator"]),
        # the uni executor's worker runs in the engine core; an inproc engine core in the LLM
        (_shape(backend="uni"), SERVE, "worker.load_model", ["EngineCore_DP0"]),
        (_shape(backend="uni"), {"multiprocess": False}, "worker.load_model", ["LLM"]),
        (_shape(tp=2), {"multiprocess": False}, "engine_core.init", ["LLM"]),
        (_shape(tp=2), {"multiprocess": False}, "worker.load_model", ["Worker_DP0_PP0_TP0", "Worker_DP0_PP0_TP1"]),
    ],
)  # fmt: skip
def test_roles_entering_a_stage_are_where_its_code_runs(shape, kwargs, stage, roles):
    assert [r.name for r in topology.plan(shape, **kwargs).roles_entering(stage)] == roles


def test_a_fault_for_a_role_that_never_enters_its_stage_is_refused():
    p = topology.plan(_shape(dp=2), frontend="serve")
    with pytest.raises(ValueError) as err:
        p.check_fault_targets("engine_core.init:hang@DPCoordinator")
    assert str(err.value) == (
        "fault engine_core.init:hang@DPCoordinator: DPCoordinator never enters engine_core.init, so it "
        "would never strike; in this tree only EngineCore_DP0, EngineCore_DP1 enter it"
    )
    with pytest.raises(
        ValueError, match=r"no process of this tree enters it \(only api_server processes do\)"
    ):
        topology.plan(_shape()).check_fault_targets("api_server.attach:crash@EngineCore_DP0")
    # what can strike is accepted: a role that enters the stage, or no role (whoever enters it)
    p.check_fault_targets("engine_core.init:hang@EngineCore_DP1,worker.load_model:crash")
    topology.plan(_shape(backend="uni"), frontend="serve").check_fault_targets(
        "worker.load_model:crash@EngineCore_DP0"
    )


def test_plan_lookups_for_tp2_dp4():
    p = topology.plan(_shape(tp=2, dp=4), frontend="serve")
    assert p.describe() == "4 API servers + 4 engine cores + 8 workers + 1 coordinator = 17"
    assert [r.name for r in p.api_servers] == [f"APIServer_{i}" for i in range(4)]
    assert [r.name for r in p.engine_cores] == [f"EngineCore_DP{k}" for k in range(4)]
    assert [r.name for r in p.workers_of(2)] == ["Worker_DP2_PP0_TP0", "Worker_DP2_PP0_TP1"]
    assert p.worker(3, 1) == ProcessRole.worker(3, 0, 1) and p.worker_rank(p.worker(3, 1)) == 1
    assert p.coordinator == ProcessRole.dp_coordinator()
    assert p.role("Worker_DP1_PP0_TP1") == ProcessRole.worker(1, 0, 1)
    assert len(p.workers) == 8 and p.world_size == 2 and p.api_server_count == 4
    with pytest.raises(ValueError, match="not a process of this plan"):
        p.role("Worker_DP4_PP0_TP0")
    with pytest.raises(ValueError, match="no engine DP4"):
        p.workers_of(4)
    with pytest.raises(ValueError, match="no worker rank 2"):
        p.worker(0, 2)
    assert topology.plan(_shape()).coordinator is None
    # The plan itself is a typed message.
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(p), type=TopologyPlan) == p


@pytest.mark.parametrize(
    ("shape", "kwargs", "match"),
    [
        (_shape(tp=0), {}, "tensor_parallel_size must be an integer >= 1"),
        (_shape(tp=2, backend="uni"), {}, "'uni' runs one worker"),
        (_shape(pp=2, backend="uni"), {"multiprocess": False}, "'uni' runs one worker"),
        (_shape(dp=2, backend="uni"), {"multiprocess": False}, "runs one engine"),
        (_shape(), {"api_server_count": 1}, "an offline LLM has no API servers"),
        (_shape(), {"frontend": "serve", "api_server_count": 0}, "api_server_count must be"),
        (_shape(), {**SERVE, "multiprocess": False}, "always runs the engine in its own processes"),
        (_shape(), {"frontend": "cli"}, "frontend must be"),
    ],
)  # fmt: skip
def test_impossible_shapes_are_refused(shape, kwargs, match):
    with pytest.raises(ValueError, match=match):
        topology.plan(shape, **kwargs)


# ---------------------------------------------------------------------------- today's tree, unchanged

# The manifests the engine wrote for 1×1×1 before the plan existed (minus frontend_pid).
OLD_MANIFESTS = {
    "serve": {"mode": "serve", "roles": [{"role": "APIServer_0", "kind": "api_server"},
              {"role": "EngineCore_DP0", "rank": 0, "kind": "engine_core"},
              {"role": "Worker_DP0_PP0_TP0", "rank": 0, "kind": "worker"}],
              "expected_process_count": 3, "api_server_count": 1, "data_parallel_size": 1, "world_size": 1},
    "mp": {"mode": "mp", "roles": [{"role": "LLM", "kind": "frontend"},
           {"role": "EngineCore_DP0", "rank": 0, "kind": "engine_core"},
           {"role": "Worker_DP0_PP0_TP0", "rank": 0, "kind": "worker"}],
           "expected_process_count": 2, "api_server_count": 0, "data_parallel_size": 1, "world_size": 1},
    "uni": {"mode": "mp", "roles": [{"role": "LLM", "kind": "frontend"},
            {"role": "EngineCore_DP0", "rank": 0, "kind": "engine_core"}],
            "expected_process_count": 1, "api_server_count": 0, "data_parallel_size": 1, "world_size": 1},
    "inproc": {"mode": "inproc", "roles": [{"role": "LLM", "kind": "frontend"}], "expected_process_count": 1,
               "api_server_count": 0, "data_parallel_size": 1, "world_size": 1},
}  # fmt: skip


@pytest.mark.parametrize(
    ("case", "backend", "kwargs"),
    [("serve", "mp", {"frontend": "serve", "api_server_count": 1}), ("mp", "mp", {}), ("uni", "uni", {}),
     ("inproc", "uni", {"multiprocess": False})],
)  # fmt: skip
def test_todays_manifest_is_unchanged(case, backend, kwargs):
    from engine.config import ParallelConfig

    fields = run_dirs.plan_tree(topology.plan(ParallelConfig(distributed_executor_backend=backend), **kwargs))
    assert fields.pop("frontend_pid") == os.getpid()
    assert json.dumps(fields) == json.dumps(OLD_MANIFESTS[case])  # same keys, same order


def test_glassbox_ps_reads_a_planned_manifest(tmp_path, monkeypatch):
    """A -tp 2 -dp 2 plan written as a manifest: ps lists all nine counted roles, none started yet."""
    from engine.cli.ps import collect_instance

    run_dir = tmp_path / f"glassbox-{os.getpid()}-x"
    run_dir.mkdir()
    p = topology.plan(_shape(tp=2, dp=2), frontend="serve")
    run_dirs.write_manifest(run_dir, **run_dirs.plan_tree(p))
    inst = collect_instance(run_dir)
    assert inst.expected_process_count == 9
    assert [(r.role, r.kind, r.counted) for r in inst.processes] == [
        (r.name, r.kind.value, True) for r in p.roles
    ]
    assert [role for role, _ in inst.missing] == [r.name for r in p.roles]  # no status files yet
    assert [r.rank for r in inst.processes if r.kind == "worker"] == [0, 1, 0, 1]
    assert run_dirs.planned_roles(run_dir) == list(p.roles)


def test_the_laggard_is_the_deepest_planned_process_in_a_stage(tmp_path):
    from engine.utils.supervisor import describe_laggard

    p = topology.plan(_shape(tp=2))
    run_dirs.write_manifest(tmp_path, **run_dirs.plan_tree(p))
    assert describe_laggard(tmp_path) == f"EngineCore_DP0 has not started yet (no status file in {tmp_path})."
    now = time.time()
    for role, stage in ((p.engine_cores[0], "engine_core.init"), (p.worker(0, 0), "worker.load_model"),
                        (p.worker(0, 1), None)):  # fmt: skip
        status = {"role": role.name, "pid": 7, "stage": stage, "entered_at": now - 2}
        run_dirs.status_file(tmp_path, role).write_text(json.dumps(status))
    assert describe_laggard(tmp_path).startswith(
        "Worker_DP0_PP0_TP0 (pid 7) has been in stage worker.load_model"
    )


def test_architecture_doc_tree_table_matches_the_plan():
    """docs/architecture.md's table of trees gives each count the plan gives."""
    import re
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[3] / "docs" / "architecture.md").read_text()
    rows = re.findall(r"^\| (\(none\)|`[^|]*`) \| [^|]*: (\d+) \|", doc, flags=re.M)
    assert len(rows) == 7
    for flags, count in rows:
        tp = int(m.group(1)) if (m := re.search(r"-tp (\d+)", flags)) else 1
        pp = int(m.group(1)) if (m := re.search(r"-pp (\d+)", flags)) else 1
        dp = int(m.group(1)) if (m := re.search(r"-dp (\d+)", flags)) else 1
        api = int(m.group(1)) if (m := re.search(r"--api-server-count (\d+)", flags)) else None
        plan = topology.plan(_shape(tp=tp, pp=pp, dp=dp), frontend="serve", api_server_count=api)
        assert plan.expected_process_count == int(count), flags
