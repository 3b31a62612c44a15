"""The engine's spans: start-up stages in lifecycle order with parent links, and one span
per step phase — what a user sees in Jaeger or in a --trace-file."""

from __future__ import annotations

import json

import tracing
from engine import LLM, SamplingParams
from tracing import catalogue
from tracing.run_dir import read_status

START_UP = [
    catalogue.LLM_INIT,
    catalogue.ENGINE_CORE_INIT,
    catalogue.EXECUTOR_INIT,
    catalogue.WORKER_WRAPPER_INIT,
    catalogue.WORKER_INIT_WORKER,
    catalogue.WORKER_INIT_DEVICE,
    catalogue.WORKER_LOAD_MODEL,
    catalogue.ENGINE_CORE_INITIALIZE_KV_CACHE,
    catalogue.WORKER_DETERMINE_AVAILABLE_MEMORY,
    catalogue.WORKER_INITIALIZE_KV_CACHE,
    catalogue.WORKER_COMPILE_OR_WARM_UP_MODEL,
]


def test_start_up_stages_in_order_with_parents_and_step_phases(monkeypatch):
    # In-process, so the in-memory exporter sees the worker's stages too. Compiled, as a
    # user's engine is (the other tests run eagerly): the warm-up stage says how.
    monkeypatch.setenv("GLASSBOX_ENABLE_MULTIPROCESSING", "0")
    monkeypatch.setenv("GLASSBOX_TORCH_COMPILE", "1")
    tracing.setup_tracing("test", in_memory=True)
    try:
        with LLM(max_model_len=128) as llm:
            llm.generate(
                ["a b c", "d"], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), use_tqdm=False
            )
            steps_run = llm.engine_core.call_utility("get_scheduler_stats").step_counter
        spans = tracing.get_finished_spans()
    finally:
        tracing.shutdown_tracing()
    by_name: dict[str, list] = {}
    for s in spans:
        by_name.setdefault(s.name, []).append(s)
    # Start-up: each stage once, entered in lifecycle order.
    started = sorted((s for s in spans if s.name in START_UP), key=lambda s: s.start_time)
    assert [s.name for s in started] == START_UP
    one = {name: by_name[name][0] for name in START_UP}

    def parent_of(name):
        return next(s.name for s in spans if s.context.span_id == one[name].parent.span_id)

    assert one[catalogue.LLM_INIT].parent is None
    assert parent_of(catalogue.ENGINE_CORE_INIT) == catalogue.LLM_INIT
    assert parent_of(catalogue.EXECUTOR_INIT) == catalogue.ENGINE_CORE_INIT
    assert parent_of(catalogue.WORKER_LOAD_MODEL) == catalogue.EXECUTOR_INIT
    assert parent_of(catalogue.WORKER_DETERMINE_AVAILABLE_MEMORY) == catalogue.ENGINE_CORE_INITIALIZE_KV_CACHE
    assert parent_of(catalogue.WORKER_COMPILE_OR_WARM_UP_MODEL) == catalogue.ENGINE_CORE_INITIALIZE_KV_CACHE
    warm_up = one[catalogue.WORKER_COMPILE_OR_WARM_UP_MODEL].attributes
    assert warm_up[catalogue.ATTR_COMPILE_MODE] == "inductor"
    assert warm_up[catalogue.ATTR_COMPILE_NUM_GRAPHS] == 1 and warm_up[catalogue.ATTR_COMPILE_SECONDS] > 0
    # A warm start, a cold one, or both (AOTAutograd's cache missed on this process's config
    # while Inductor's held the graph another test compiled): never "off" on the default.
    assert warm_up[catalogue.ATTR_COMPILE_CACHE] in ("hit", "miss", "mixed")
    kv = one[catalogue.ENGINE_CORE_INITIALIZE_KV_CACHE].attributes
    assert kv[catalogue.ATTR_KV_NUM_BLOCKS] > 1 and kv[catalogue.ATTR_KV_BLOCK_SIZE] == 16
    # One block's bytes and the numbers they are made of (the bundled model: 4 layers, 4 KV heads of 32, float32).
    inputs = [catalogue.ATTR_KV_BLOCK_SIZE, catalogue.ATTR_KV_NUM_LAYERS, catalogue.ATTR_KV_NUM_KV_HEADS,
              catalogue.ATTR_KV_HEAD_SIZE, catalogue.ATTR_KV_DTYPE_SIZE]  # fmt: skip
    assert [kv[a] for a in inputs] == [16, 4, 4, 32, 4]
    block_bytes = kv[catalogue.ATTR_KV_BYTES_PER_BLOCK]
    assert block_bytes == 2 * 16 * 4 * 4 * 32 * 4
    assert kv[catalogue.ATTR_KV_NUM_BLOCKS] == kv[catalogue.ATTR_KV_AVAILABLE_BYTES] // block_bytes
    # Steps: one engine_core.step per step run, each with exactly one span per phase.
    steps = by_name[catalogue.ENGINE_CORE_STEP]
    assert len(steps) == steps_run >= 3
    for phase in (
        catalogue.SCHEDULER_SCHEDULE,
        catalogue.EXECUTOR_EXECUTE_MODEL,
        catalogue.SCHEDULER_UPDATE_FROM_OUTPUT,
    ):
        assert sorted(s.parent.span_id for s in by_name[phase]) == sorted(s.context.span_id for s in steps)
    first_schedule = min(by_name[catalogue.SCHEDULER_SCHEDULE], key=lambda s: s.start_time)
    assert first_schedule.attributes[catalogue.ATTR_STEP_NUM_NEW_REQS] == 2
    assert first_schedule.attributes[catalogue.ATTR_STEP_NUM_SCHEDULED_TOKENS] > 2


def test_trace_file_gets_one_json_line_per_span(tmp_path):
    trace_file = tmp_path / "spans.jsonl"
    with LLM(max_model_len=128, trace_file=str(trace_file)) as llm:
        llm.generate("hi", SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)
    tracing.shutdown_tracing()
    lines = [json.loads(line) for line in trace_file.read_text().splitlines()]
    names = {line["name"] for line in lines}
    assert {
        catalogue.WORKER_LOAD_MODEL,
        catalogue.ENGINE_CORE_STEP,
        catalogue.EXECUTOR_EXECUTE_MODEL,
    } <= names


def test_status_file_names_the_stage_and_run_dir_is_removed(monkeypatch):
    monkeypatch.setenv("GLASSBOX_ENABLE_MULTIPROCESSING", "0")
    seen = {}

    def hook(event, name, attrs):
        if event == "enter" and name == catalogue.WORKER_LOAD_MODEL:
            handle = tracing.get_handle()
            seen["stage"] = read_status(handle.status_file).stage
            seen["path"] = handle.status_file

    remove = tracing.add_stage_hook(hook)
    try:
        llm = LLM(max_model_len=128)
    finally:
        remove()
    run_dir = llm.run_dir
    assert seen["stage"] == catalogue.WORKER_LOAD_MODEL
    assert seen["path"].startswith(str(run_dir))
    llm.shutdown()
    assert not run_dir.exists()
