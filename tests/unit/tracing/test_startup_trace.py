"""One owner's start-up is one trace: cli.validate_config (run before tracing is up), the
engines' handshake, the other API servers' start; ``glassbox trace --startup`` draws it."""

from __future__ import annotations

import json
import time

import pytest

import tracing
from engine.cli import trace as trace_cli
from tracing import catalogue
from tracing.exporters import span_to_dict
from tracing.stage import forget_early_stages, startup_trace


@pytest.fixture(autouse=True)
def _clean():
    tracing.shutdown_tracing()
    forget_early_stages()
    yield
    tracing.shutdown_tracing()
    forget_early_stages()


def _serve_dp2_startup(tmp_path):
    """What APIServer_0 of ``glassbox serve -dp 2`` enters, in order, with real spans."""
    with tracing.stage(catalogue.CLI_VALIDATE_CONFIG):  # no tracing yet: held
        time.sleep(0.01)
    handle = tracing.setup_tracing("APIServer_0", in_memory=True)
    with startup_trace():
        with tracing.stage(catalogue.ENGINE_CORE_HANDSHAKE), tracing.stage(catalogue.PROCESS_SPAWN):
            pass
        with tracing.stage(catalogue.API_SERVER_START_OTHERS):
            pass
    with tracing.stage(catalogue.ENGINE_CORE_SHUTDOWN):  # after start-up: a trace of its own
        pass
    return {s.name: s for s in handle.get_finished_spans()}


def test_validate_config_is_recorded_once_tracing_is_up_with_the_time_it_ran(tmp_path):
    t0 = time.time_ns()
    spans = _serve_dp2_startup(tmp_path)
    validate = spans[catalogue.CLI_VALIDATE_CONFIG]
    assert t0 <= validate.start_time < validate.end_time <= spans[catalogue.ENGINE_CORE_HANDSHAKE].start_time
    assert validate.end_time - validate.start_time >= 10_000_000  # its own 10 ms, not the emit's instant
    assert validate.attributes["thread.name"] == "MainThread"
    ids = {spans[n].context.trace_id for n in (catalogue.CLI_VALIDATE_CONFIG, catalogue.ENGINE_CORE_HANDSHAKE,
                                               catalogue.API_SERVER_START_OTHERS)}  # fmt: skip
    assert len(ids) == 1  # one start-up trace, whose top-level stages are roots: no made-up parent
    assert (
        spans[catalogue.CLI_VALIDATE_CONFIG].parent is None
        and spans[catalogue.ENGINE_CORE_HANDSHAKE].parent is None
    )
    assert spans[catalogue.ENGINE_CORE_SHUTDOWN].context.trace_id not in ids
    assert (
        spans[catalogue.PROCESS_SPAWN].parent.span_id
        == spans[catalogue.ENGINE_CORE_HANDSHAKE].context.span_id
    )


def test_a_stage_held_once_is_recorded_once():
    with tracing.stage(catalogue.CLI_VALIDATE_CONFIG):
        pass
    handle = tracing.setup_tracing("LLM", in_memory=True)
    with startup_trace():
        pass
    with startup_trace():
        pass
    assert [s.name for s in handle.get_finished_spans()] == [catalogue.CLI_VALIDATE_CONFIG]


def test_startup_under_dp2_draws_the_engines_start_up_not_the_api_servers_start(tmp_path):
    spans = _serve_dp2_startup(tmp_path)
    path = tmp_path / "spans.jsonl"
    path.write_text("".join(json.dumps(span_to_dict(s), default=str) + "\n" for s in spans.values()))
    chosen = trace_cli.select(trace_cli.load(path), startup=True)
    names = {s.name for s in chosen.spans}
    assert {
        catalogue.CLI_VALIDATE_CONFIG,
        catalogue.ENGINE_CORE_HANDSHAKE,
        catalogue.API_SERVER_START_OTHERS,
    } <= names
    assert chosen.root.name == catalogue.CLI_VALIDATE_CONFIG and chosen.kind == trace_cli.START_UP
    assert chosen.remote_parent is None and all(r.parent_id is None for r in chosen.roots)
