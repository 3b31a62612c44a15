"""The DPCoordinator's own lifecycle stages: a fault aimed at it can strike."""

from __future__ import annotations

import pytest

from engine.core.coordinator import DPCoordinator
from engine.core.coordinator_messages import CoordinatorSpawnPayload, coordinator_addresses, wave_address
from engine.distributed import topology
from engine.engine_args import EngineArgs
from tracing import catalogue
from tracing.faults import InjectedFault, install_faults, uninstall_faults


@pytest.fixture
def payload(tmp_path):
    into, out = coordinator_addresses(tmp_path)
    return CoordinatorSpawnPayload(input_address=into, publish_address=out, data_parallel_size=2,
                                   wave_address=wave_address(tmp_path))  # fmt: skip


@pytest.fixture(autouse=True)
def _disarm():
    yield
    uninstall_faults()


def test_a_fault_aimed_at_the_coordinators_start_up_strikes_it(payload, tmp_path):
    install_faults(topology.COORDINATOR_NAME, "dp_coordinator.init:crash@DPCoordinator", quiet=True)
    with pytest.raises(InjectedFault, match="struck DPCoordinator at stage dp_coordinator.init"):
        DPCoordinator(payload)
    # The sockets it bound are closed again: a second coordinator binds the same addresses.
    uninstall_faults()
    DPCoordinator(payload).close()


def test_a_fault_aimed_at_the_coordinators_shut_down_strikes_it(payload):
    coordinator = DPCoordinator(payload)
    install_faults(topology.COORDINATOR_NAME, "dp_coordinator.shutdown:crash@DPCoordinator", quiet=True)
    with pytest.raises(InjectedFault, match="dp_coordinator.shutdown"):
        coordinator.close()


def test_the_plan_accepts_a_fault_at_the_coordinators_stages_and_only_its_own():
    plan = topology.plan(EngineArgs(data_parallel_size=2).create_engine_config(), frontend="serve")
    assert [r.name for r in plan.roles_entering(catalogue.DP_COORDINATOR_INIT)] == ["DPCoordinator"]
    plan.check_fault_targets("dp_coordinator.init:hang@DPCoordinator")  # would strike: accepted
    with pytest.raises(ValueError, match="EngineCore_DP0 never enters dp_coordinator.init"):
        plan.check_fault_targets("dp_coordinator.init:hang@EngineCore_DP0")
    one = topology.plan(EngineArgs().create_engine_config(), frontend="serve")
    with pytest.raises(ValueError, match="no process DPCoordinator"):
        one.check_fault_targets("dp_coordinator.init:hang@DPCoordinator")


def test_the_coordinators_start_up_joins_the_spawners_start_up_trace(tmp_path):
    import tracing
    from engine.frontend.engine_launcher import coordinator_payload
    from tracing.propagation import attached_trace_context

    handle = tracing.setup_tracing("APIServer_0", in_memory=True)
    try:
        config = EngineArgs(data_parallel_size=2).create_engine_config()
        with tracing.stage(catalogue.ENGINE_CORE_HANDSHAKE):  # where the client spawns it
            payload = coordinator_payload(config, tmp_path, None)
        assert payload.trace_headers and "traceparent" in payload.trace_headers
        with attached_trace_context(payload.trace_headers):  # what run_coordinator's body does
            DPCoordinator(payload).close()
        spans = {s.name: s for s in handle.get_finished_spans()}
        init, handshake = spans[catalogue.DP_COORDINATOR_INIT], spans[catalogue.ENGINE_CORE_HANDSHAKE]
        assert init.context.trace_id == handshake.context.trace_id
        assert init.parent.span_id == handshake.context.span_id
    finally:
        tracing.shutdown_tracing()
