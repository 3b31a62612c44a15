"""The run-directory contract (``tracing/run_dir.py``) and the engine's adapter to it.

The contract's records go through its one writer and come back through its readers; the
readers are lenient about old and hand-written files and return None — never raise — for a
missing or broken one. The engine's adapter (``engine/utils/run_dir.py``) writes the
topology plan into the manifest with every structured field, and the crash-report and
root-cause helpers of ``engine/utils/processes.py`` go through the same records.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import threading
import time

import pytest

import tracing
from engine.distributed import topology
from engine.utils import processes
from engine.utils import run_dir as engine_run_dir
from tracing import instances
from tracing import run_dir as contract


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait(timeout=20)
    return proc.pid


# ---------------------------------------------------------------------------- records


def test_each_record_round_trips_through_the_one_writer(tmp_path):
    manifest = contract.Manifest(
        created_at=1.5, run_dir=str(tmp_path), mode="serve", frontend_pid=42, expected_process_count=1,
        roles=[contract.PlannedProcess(role="R0", kind="engine_core", rank=0, dp_rank=0, counted=True)],
        host="127.0.0.1", port=8000,
    )  # fmt: skip
    contract.write_manifest(tmp_path, manifest)
    assert contract.read_manifest(tmp_path) == manifest == contract.load_manifest(tmp_path)

    status = contract.ProcessStatus(
        role="R0", rank=0, pid=7, stage="b", stage_stack=["a", "b"], entered_at=2.0, updated_at=3.0,
        last_finished=contract.FinishedStage("x", duration_ms=1.25, error=None, finished_at=2.5),
    )  # fmt: skip
    path = contract.status_path(tmp_path, "R0")
    contract.write_status(path, status)
    assert contract.read_status(path) == status

    crash = contract.CrashReport(role="R0", pid=7, stage="b", exception="RuntimeError: boom", time=4.0)
    contract.write_crash_report(tmp_path, crash)
    assert contract.read_crash_report(tmp_path, "R0") == crash
    assert not list(tmp_path.glob("*.tmp"))


def test_files_are_json_people_can_read(tmp_path):
    """Manifest and crash report indented; the often-rewritten status file one line; unset
    optional fields of a manifest entry left out."""
    contract.write_manifest(tmp_path, contract.Manifest(roles=[contract.PlannedProcess(role="LLM")]))
    text = contract.manifest_path(tmp_path).read_text()
    assert text.startswith("{\n  ") and json.loads(text) == {"roles": [{"role": "LLM"}]}
    contract.write_status(contract.status_path(tmp_path, "LLM"), contract.ProcessStatus(pid=1))
    assert "\n" not in contract.status_path(tmp_path, "LLM").read_text().strip()


def test_readers_are_lenient_and_never_raise(tmp_path):
    # A hand-written or older status file: missing fields read as None, unknown ones are ignored.
    path = contract.status_path(tmp_path, "EngineCore_DP0")
    path.write_text(json.dumps({"pid": 12, "from_the_future": True, "entered_at": 5}))
    status = contract.read_status(path)
    assert (status.pid, status.stage, status.stage_stack, status.entered_at) == (12, None, [], 5.0)
    for bad in ("", "{not json", '{"pid": "twelve"}', "[1, 2]"):
        path.write_text(bad)
        assert contract.read_status(path) is None
    assert contract.read_status(tmp_path / "missing.status.json") is None
    assert contract.read_manifest(tmp_path) is None
    assert contract.read_crash_report(tmp_path, "nobody") is None
    assert contract.read_crash_report(tmp_path / "gone", "nobody") is None


def test_load_record_says_what_is_wrong(tmp_path):
    with pytest.raises(FileNotFoundError):
        contract.load_manifest(tmp_path)
    contract.manifest_path(tmp_path).write_text('{"roles": [{"kind": "worker"}]}')
    with pytest.raises(contract.RecordError) as e:
        contract.load_manifest(tmp_path)
    assert "role" in e.value.reason and e.value.path == str(contract.manifest_path(tmp_path))
    assert isinstance(e.value, ValueError)


def test_writer_leaves_no_temp_file_when_it_fails(tmp_path):
    with pytest.raises(OSError):
        contract.write_record(tmp_path / "no-such-dir" / "x.json", contract.ProcessStatus())
    with pytest.raises(TypeError):  # not encodable: nothing written, nothing left
        contract.write_record(tmp_path / "x.json", object())  # type: ignore[arg-type]
    assert list(tmp_path.iterdir()) == []


def test_concurrent_writers_never_show_a_reader_half_a_file(tmp_path):
    path = contract.status_path(tmp_path, "R")
    contract.write_status(path, contract.ProcessStatus(pid=0))
    stop = threading.Event()

    def write(k: int) -> None:
        n = 0
        while not stop.is_set():
            n += 1
            contract.write_status(path, contract.ProcessStatus(pid=k, stage_stack=["s"] * (n % 50)))

    writers = [threading.Thread(target=write, args=(k,)) for k in range(1, 4)]
    for t in writers:
        t.start()
    try:
        reads = [contract.read_status(path) for _ in range(300)]
    finally:
        stop.set()
        for t in writers:
            t.join(10)
    assert all(r is not None for r in reads)
    assert not list(tmp_path.glob("*.tmp"))


# ---------------------------------------------------------------------------- directories


def test_run_dir_base_takes_an_explicit_base_first(tmp_path, monkeypatch):
    monkeypatch.setenv("GLASSBOX_RUN_DIR_BASE", str(tmp_path / "env"))
    assert contract.run_dir_base(tmp_path / "given") == tmp_path / "given"
    assert contract.run_dir_base() == tmp_path / "env"
    assert contract.run_dir_base("") == tmp_path / "env"  # empty means unset
    assert engine_run_dir.run_dir_base() == tmp_path / "env"  # the engine's envs agree


def test_make_list_and_sweep_run_dirs(tmp_path):
    base = tmp_path / "base"
    fresh = contract.make_run_dir(base)
    assert fresh.parent == base and stat.S_IMODE(fresh.stat().st_mode) == 0o700
    assert contract.creator_pid(fresh) == os.getpid()
    (base / "glassbox-notapid").mkdir()  # not named like a run directory
    (base / "glassbox-12-file").write_text("")  # not a directory
    assert contract.list_run_dirs(base) == [fresh]
    assert contract.list_run_dirs(tmp_path / "nothing-here") == []

    dead = _dead_pid()
    stale = base / f"glassbox-{dead}-stale"
    stale.mkdir()
    contract.write_status(contract.status_path(stale, "W"), contract.ProcessStatus(pid=dead))
    kept = base / f"glassbox-{dead}-kept"  # creator gone, but one of its processes lives
    kept.mkdir()
    contract.write_status(contract.status_path(kept, "W"), contract.ProcessStatus(pid=os.getpid()))
    assert contract.sweep_stale_run_dirs(base) == [stale]
    assert not stale.exists() and kept.exists() and fresh.exists()
    assert not contract.pid_alive(dead) and contract.pid_alive(os.getpid()) and not contract.pid_alive(None)


def test_titles_and_file_names_treat_role_names_as_opaque(tmp_path):
    assert contract.role_from_title("glassbox::Anything_At_All extra words") == "Anything_At_All"
    assert contract.role_from_title("python -m x") is None and contract.role_from_title(None) is None
    assert contract.role_from_title("glassbox::") is None
    assert contract.status_path(tmp_path, "X_1") == tmp_path / "X_1.status.json"
    assert contract.crash_path(tmp_path, "X_1") == tmp_path / "X_1.crash.json"
    (tmp_path / "X_1.status.json").write_text("{}")
    (tmp_path / "X_1.crash.json").write_text("{}")
    assert contract.status_paths(tmp_path) == {"X_1": tmp_path / "X_1.status.json"}


def test_the_contract_and_the_topology_agree_on_names(tmp_path):
    role = topology.ProcessRole.worker(1, 0, 1)
    assert contract.role_from_title(role.title) == topology.name_from_title(role.title) == role.name
    assert engine_run_dir.status_file(tmp_path, role) == contract.status_path(tmp_path, role.name)


# ---------------------------------------------------------------------------- the engine's adapter


def _shape(tp: int = 1, pp: int = 1, dp: int = 1):
    from engine.config import ParallelConfig

    return ParallelConfig(
        tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
        data_parallel_size=dp,
        distributed_executor_backend="mp",
    )


def test_manifest_entries_carry_the_plan_structured(tmp_path):
    plan = topology.plan(_shape(tp=2, pp=2, dp=2), frontend="serve", api_server_count=1)
    engine_run_dir.write_manifest(tmp_path, host="::1", port=1234, **engine_run_dir.plan_tree(plan))
    manifest = contract.read_manifest(tmp_path)
    assert (manifest.mode, manifest.frontend_pid, manifest.run_dir) == ("serve", os.getpid(), str(tmp_path))
    assert (manifest.host, manifest.port, manifest.expected_process_count) == ("::1", 1234, 12)
    assert (manifest.data_parallel_size, manifest.world_size) == (2, 4)
    assert (manifest.tensor_parallel_size, manifest.pipeline_parallel_size) == (2, 2)
    assert time.time() - manifest.created_at < 60
    assert [e.role for e in manifest.roles] == [r.name for r in plan.roles]
    for entry, role in zip(manifest.roles, plan.roles, strict=True):
        assert entry.kind == role.kind.value and entry.title == role.title
        assert (entry.dp_rank, entry.pp_rank, entry.tp_rank, entry.api_index) == (
            role.dp_rank, role.pp_rank, role.tp_rank, role.api_index,
        )  # fmt: skip
        assert entry.status_file == role.status_file_name and entry.counted is plan.is_counted(role)
        if role.kind is topology.RoleKind.WORKER:
            assert entry.rank == plan.worker_rank(role)
    assert engine_run_dir.planned_roles(tmp_path) == list(plan.roles)
    assert contract.read_manifest(tmp_path).roles[0].title == "glassbox::APIServer_0"


@pytest.mark.parametrize(("multiprocess", "counted"), [(True, False), (False, True)], ids=["mp", "inproc"])
def test_the_owner_llm_is_counted_only_in_process(tmp_path, multiprocess, counted):
    from engine.config import ParallelConfig

    backend = "mp" if multiprocess else "uni"
    plan = topology.plan(ParallelConfig(distributed_executor_backend=backend), multiprocess=multiprocess)
    engine_run_dir.write_manifest(tmp_path, **engine_run_dir.plan_tree(plan))
    llm = contract.read_manifest(tmp_path).roles[0]
    assert (llm.role, llm.kind, llm.pid, llm.counted) == ("LLM", "frontend", os.getpid(), counted)
    assert contract.read_manifest(tmp_path).tensor_parallel_size == 1


def test_write_manifest_rejects_what_the_manifest_does_not_hold(tmp_path):
    with pytest.raises(TypeError):
        engine_run_dir.write_manifest(tmp_path, mode="mp", colour="blue")
    with pytest.raises(ValueError, match="not a Glassbox process role"):
        engine_run_dir.write_manifest(tmp_path, mode="mp", roles=[{"role": "Nobody"}])
    assert not contract.manifest_path(tmp_path).exists()


def test_create_run_dir_uses_the_engine_base(tmp_path, monkeypatch):
    monkeypatch.setenv("GLASSBOX_RUN_DIR_BASE", str(tmp_path))
    run_dir = engine_run_dir.create_run_dir()
    assert contract.list_run_dirs(tmp_path) == [run_dir] == engine_run_dir.list_run_dirs()
    engine_run_dir.remove_run_dir(run_dir)
    assert not run_dir.exists()


# ---------------------------------------------------------------------------- crash reports, root cause


def test_crash_report_is_a_contract_record(tmp_path):
    try:
        raise RuntimeError("no device")
    except RuntimeError as e:
        processes.write_crash_report(tmp_path, "Worker_DP0_PP0_TP1", e, stage="worker.init_device", rank=1)
    report = contract.read_crash_report(tmp_path, "Worker_DP0_PP0_TP1")
    assert (report.role, report.rank, report.pid, report.stage) == (
        "Worker_DP0_PP0_TP1", 1, os.getpid(), "worker.init_device",
    )  # fmt: skip
    assert report.exception == "RuntimeError: no device" and "Traceback" in report.traceback
    assert processes.crash_file(tmp_path, "Worker_DP0_PP0_TP1") == contract.crash_path(
        tmp_path, "Worker_DP0_PP0_TP1"
    )
    assert contract.read_crash_report(tmp_path, "EngineCore_DP0") is None
    processes.write_crash_report(tmp_path / "gone", "X", RuntimeError(), stage=None)  # never raises


def test_root_cause_reads_crash_report_and_status_file(tmp_path):
    role = "EngineCore_DP0"
    failed = contract.FinishedStage(
        "engine_core.init", duration_ms=3.0, error="OSError: disk", finished_at=1.0
    )
    contract.write_status(
        contract.status_path(tmp_path, role),
        contract.ProcessStatus(role=role, rank=0, pid=99, last_finished=failed),
    )
    text = processes.format_root_cause(tmp_path, role, pid=None, returncode=-9)
    assert "process:   EngineCore_DP0 (rank 0)" in text
    assert "stage:     engine_core.init (failed: OSError: disk)" in text
    assert "pid:       ?" in text and "killed by SIGKILL" in text and "none recorded" in text
    contract.write_crash_report(
        tmp_path, contract.CrashReport(role=role, pid=99, stage="engine_core.handshake", exception="E: x")
    )
    text = processes.format_root_cause(tmp_path, role, pid=None, returncode=1, note="first to die")
    assert "pid:       99" in text and "stage:     engine_core.handshake" in text
    assert "exception: E: x" in text and "note:      first to die" in text
    text = processes.format_root_cause(tmp_path / "gone", role, pid=5, returncode=None)
    assert "stage:     unknown" in text and "still running" in text


# ---------------------------------------------------------------------------- status files


def test_tracing_writes_status_through_the_contract(tmp_path):
    path = contract.status_path(tmp_path, "TestRole")
    try:
        tracing.setup_tracing("TestRole", rank=2, status_file=str(path))
        with tracing.stage(tracing.catalogue.WORKER_LOAD_MODEL):
            status = contract.read_status(path)
        assert (status.role, status.rank, status.pid, status.stage) == (
            "TestRole",
            2,
            os.getpid(),
            "worker.load_model",
        )
        after = contract.read_status(path)
        assert after.stage is None and after.last_finished.name == "worker.load_model"
    finally:
        tracing.shutdown_tracing()


# ---------------------------------------------------------------------------- the collector


def test_collector_reads_a_run_dir_without_the_engine(tmp_path):
    """No live process: a stale instance, its rows from the manifest and status files; an
    entry's ``counted`` wins over the kind's default, and without ``kind_of`` a role the
    manifest gives no kind for is ``unknown``."""
    dead = _dead_pid()
    run_dir = tmp_path / f"glassbox-{dead}-x"
    run_dir.mkdir()
    contract.write_manifest(
        run_dir,
        contract.Manifest(
            created_at=time.time(), mode="mp", frontend_pid=dead, expected_process_count=1,
            roles=[contract.PlannedProcess(role="LLM", kind="frontend", counted=False),
                   contract.PlannedProcess(role="Core", kind="engine_core", rank=0, counted=True),
                   contract.PlannedProcess(role="Side", kind="worker", counted=False),
                   contract.PlannedProcess(role="Odd")],
        ),
    )  # fmt: skip
    contract.write_status(
        contract.status_path(run_dir, "Core"),
        contract.ProcessStatus(role="Core", pid=dead, stage="engine_core.init", updated_at=time.time()),
    )
    [inst] = instances.collect_instances(tmp_path, include_stale=True)
    assert inst.stale and inst.frontend_pid == dead and inst.problems == []
    rows = {p.role: p for p in inst.processes}
    assert [(r.kind, r.counted, r.state) for r in rows.values()] == [
        ("frontend", False, "exited"), ("engine_core", True, "exited"), ("worker", False, "not started"),
        ("unknown", False, "not started"),
    ]  # fmt: skip
    assert rows["LLM"].is_owner and not rows["Core"].is_owner
    assert inst.missing == [("Core", f"pid {dead} exited in stage engine_core.init")]
    assert instances.collect_instances(tmp_path) == []  # stale: left out by default
    data = instances.instance_to_dict(inst)
    assert data["run_dir"] == str(run_dir) and data["found_process_count"] == 0
    assert data["missing"] == [{"role": "Core", "reason": f"pid {dead} exited in stage engine_core.init"}]
    json.dumps(data)  # plain JSON data


def test_collector_names_a_broken_manifest_as_a_problem(tmp_path):
    run_dir = tmp_path / f"glassbox-{os.getpid()}-broken"
    run_dir.mkdir()
    inst = instances.collect_instance(run_dir)
    assert inst.problems == ["manifest.json missing (the instance is starting, or died before writing it)"]
    assert not inst.stale and inst.frontend_pid == os.getpid()  # from the directory's name
    contract.manifest_path(run_dir).write_text('{"mode": 3}')
    [problem] = instances.collect_instance(run_dir).problems
    assert problem.startswith("manifest.json unreadable: Expected `str | null`, got `int`")
