"""OutputProcessor: text and stop strings per output kind, ``n`` fan-out, logprobs, aborts."""

from __future__ import annotations

import math
import time

import pytest
from frontend_fixtures import BOS_ID, EOS_ID, build_tokenizer_dir

from engine.core.messages import EngineCoreOutput, EngineCoreRequest
from engine.frontend.output_processor import OutputProcessor, ParentRequest
from engine.frontend.tokenizer import get_tokenizer
from engine.outputs import LogprobsLists
from engine.sampling_params import RequestOutputKind, SamplingParams
from engine.sched.request import FinishReason

CUMULATIVE, DELTA, FINAL_ONLY = (
    RequestOutputKind.CUMULATIVE,
    RequestOutputKind.DELTA,
    RequestOutputKind.FINAL_ONLY,
)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return get_tokenizer(str(build_tokenizer_dir(tmp_path_factory.mktemp("tok"))))


def _request(request_id: str, params: SamplingParams, prompt: list[int] | None = None) -> EngineCoreRequest:
    return EngineCoreRequest(
        request_id=request_id,
        prompt_token_ids=prompt or [BOS_ID, 5, 6],
        sampling_params=params,
        eos_token_id=EOS_ID,
        arrival_time=0.0,
    )


def _run(processor, request_id, ids, finish=FinishReason.LENGTH, **kw):
    """Feed ``ids`` one per step; the engine finishes the request on the last one."""
    results = []
    for i, t in enumerate(ids):
        last = i == len(ids) - 1
        out = EngineCoreOutput(
            request_id=request_id, new_token_ids=[t], finish_reason=finish if last else None, **kw
        )
        results.append(processor.process_outputs([out]))
    return results


def _texts(results):
    return [o.outputs[0].text for r in results for o in r.request_outputs]


def test_delta_stream_matches_cumulative_and_full_decode(tokenizer):
    ids = tokenizer.encode("Hi 日本語 and 👍 ok ñ.", add_special_tokens=False)
    final = {}
    deltas = []
    for kind in (CUMULATIVE, DELTA):
        proc = OutputProcessor(tokenizer)
        proc.add_request(_request("r", SamplingParams(output_kind=kind, max_tokens=len(ids))), prompt="Hi")
        results = _run(proc, "r", ids)
        outs = [o for r in results for o in r.request_outputs]
        assert outs[-1].finished and not any(o.finished for o in outs[:-1])
        assert outs[-1].outputs[0].finish_reason == "length"
        final[kind] = outs[-1]
        if kind == DELTA:
            deltas = [o.outputs[0].text for o in outs]
            assert [t for o in outs for t in o.outputs[0].token_ids] == ids
        assert not proc.has_unfinished_requests()
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == final[CUMULATIVE].outputs[0].text == tokenizer.decode(ids)
    assert final[CUMULATIVE].outputs[0].token_ids == ids
    assert final[CUMULATIVE].prompt == "Hi"
    assert final[CUMULATIVE].outputs[0].text_offsets is None  # only with logprobs


@pytest.mark.parametrize(
    ("stop", "include", "expected"),
    [
        (" fox", False, "The quick brown"),  # one whole token
        (" fox", True, "The quick brown fox"),
        ("brown fox j", False, "The quick "),  # three tokens
        ("own fo", False, "The quick br"),  # split across two tokens, ending mid-token
        ("own fo", True, "The quick brown fo"),
    ],
)
def test_stop_string_finishes_and_aborts(tokenizer, stop, include, expected):
    ids = tokenizer.encode("The quick brown fox jumps over the lazy dog.", add_special_tokens=False)
    proc = OutputProcessor(tokenizer)
    params = SamplingParams(stop=[stop, "never"], include_stop_str_in_output=include, output_kind=CUMULATIVE)
    proc.add_request(_request("r", params), prompt=None)

    results = _run(proc, "r", ids, finish=None)
    finished = [(i, o) for i, r in enumerate(results) for o in r.request_outputs if o.finished]
    assert len(finished) == 1
    step, out = finished[0]
    assert out.outputs[0].text == expected
    assert out.outputs[0].finish_reason == "stop"
    assert out.outputs[0].stop_reason == stop
    assert results[step].reqs_to_abort == ["r"], "the engine must be told to free it"
    # Outputs the engine sent after the stop are ignored; nothing is left unfinished.
    assert all(not r.request_outputs for r in results[step + 1 :])
    assert not proc.has_unfinished_requests()


@pytest.mark.parametrize("stop", ["own fo", "brown fox j", " jumps"])
def test_streamed_deltas_never_show_any_of_the_stop_string(tokenizer, stop):
    ids = tokenizer.encode("The quick brown fox jumps over the lazy dog.", add_special_tokens=False)
    proc = OutputProcessor(tokenizer)
    proc.add_request(_request("r", SamplingParams(stop=[stop], output_kind=DELTA)), prompt=None)
    streamed = ""
    final_text = "The quick brown fox jumps over the lazy dog."[: "The quick brown fox jumps over".find(stop)]
    for result in _run(proc, "r", ids, finish=None):
        for out in result.request_outputs:
            streamed += out.outputs[0].text
            # Every intermediate stream is a prefix of the final text, which lacks the stop.
            assert final_text.startswith(streamed), (streamed, stop)
    assert streamed == final_text


def test_engine_stop_token_sets_stop_reason(tokenizer):
    ids = tokenizer.encode("The end", add_special_tokens=False)
    proc = OutputProcessor(tokenizer)
    proc.add_request(_request("r", SamplingParams(stop_token_ids=[99])), prompt=None)
    last = EngineCoreOutput(
        request_id="r", new_token_ids=[99], finish_reason=FinishReason.STOP, stop_reason=99
    )
    results = _run(proc, "r", ids, finish=None) + [proc.process_outputs([last])]
    out = results[-1].request_outputs[0]
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == 99
    assert out.outputs[0].text == "The end", "the stop token's text is left out"
    assert out.outputs[0].token_ids == ids + [99]
    assert results[-1].reqs_to_abort == [], "the engine finished it itself"


def _fan_out(proc, params, request_id="p"):
    parent = ParentRequest(request_id, params)
    child_ids = []
    for index in range(params.n):
        child_id, child_params = parent.get_child_info(index)
        proc.add_request(_request(child_id, child_params), "prompt", parent, index)
        child_ids.append(child_id)
    return parent, child_ids


def test_parent_request_children_params():
    params = SamplingParams(n=3, seed=7, temperature=0.8)
    parent = ParentRequest("p", params)
    infos = [parent.get_child_info(i) for i in range(3)]
    assert [cid for cid, _ in infos] == ["0_p", "1_p", "2_p"]
    assert [p.seed for _, p in infos] == [7, 8, 9]
    assert all(p.n == 1 and p.temperature == 0.8 for _, p in infos)
    assert params.n == 3 and params.seed == 7, "the parent's params are untouched"
    unseeded = ParentRequest("q", SamplingParams(n=2))
    assert [unseeded.get_child_info(i)[1].seed for i in range(2)] == [None, None]


@pytest.mark.parametrize("kind", [CUMULATIVE, DELTA, FINAL_ONLY])
def test_n2_gathers_children_under_parent_id(tokenizer, kind):
    proc = OutputProcessor(tokenizer)
    _, (c0, c1) = _fan_out(proc, SamplingParams(n=2, output_kind=kind))
    a = tokenizer.encode("Hello world", add_special_tokens=False)
    b = tokenizer.encode("The end", add_special_tokens=False)
    assert proc.get_num_unfinished_requests() == 2

    outs = []
    steps = max(len(a), len(b))
    for i in range(steps):
        batch = []
        for cid, ids in ((c1, b), (c0, a)):  # engine order need not be index order
            if i < len(ids):
                fin = FinishReason.LENGTH if i == len(ids) - 1 else None
                batch.append(EngineCoreOutput(request_id=cid, new_token_ids=[ids[i]], finish_reason=fin))
        result = proc.process_outputs(batch)
        assert len(result.request_outputs) <= 1, "one output per parent per step"
        outs += result.request_outputs

    assert all(o.request_id == "p" for o in outs)
    assert [o.finished for o in outs].count(True) == 1 and outs[-1].finished
    assert not proc.has_unfinished_requests() and not proc.parent_requests
    if kind == FINAL_ONLY:
        assert len(outs) == 1
    if kind == DELTA:
        texts = {0: "", 1: ""}
        for o in outs:
            for c in o.outputs:
                texts[c.index] += c.text
        assert texts == {0: "Hello world", 1: "The end"}
    else:
        final = outs[-1]
        assert [c.index for c in final.outputs] == [0, 1]
        assert [c.text for c in final.outputs] == ["Hello world", "The end"]
        assert all(c.finish_reason == "length" for c in final.outputs)


def test_final_only_emits_once(tokenizer):
    ids = tokenizer.encode("Hello world", add_special_tokens=False)
    proc = OutputProcessor(tokenizer)
    proc.add_request(_request("r", SamplingParams(output_kind=FINAL_ONLY)), prompt=None)
    outs = [o for r in _run(proc, "r", ids) for o in r.request_outputs]
    assert len(outs) == 1 and outs[0].finished
    assert outs[0].outputs[0].text == "Hello world" and outs[0].outputs[0].token_ids == ids


def _rows(sampled, top, ranks, base=-1.0):
    """Rows: sampled token first, then the top-N; logprob of id t is base - t / 10."""
    ids = [[s, *top] for s in sampled]
    return LogprobsLists(
        logprob_token_ids=ids, logprobs=[[base - t / 10 for t in row] for row in ids], ranks=ranks
    )


@pytest.mark.parametrize("kind", [CUMULATIVE, DELTA])
def test_logprob_rows_become_dicts(tokenizer, kind):
    the, brown = tokenizer.encode("The brown", add_special_tokens=False)
    top = [the, EOS_ID]
    proc = OutputProcessor(tokenizer)
    proc.add_request(_request("r", SamplingParams(logprobs=2, output_kind=kind)), prompt=None)
    o1 = EngineCoreOutput(request_id="r", new_token_ids=[the], new_logprobs=_rows([the], top, [1]))
    o2 = EngineCoreOutput(
        request_id="r",
        new_token_ids=[brown],
        new_logprobs=_rows([brown], top, [7]),
        finish_reason=FinishReason.LENGTH,
    )
    first = proc.process_outputs([o1]).request_outputs[0].outputs[0]
    last = proc.process_outputs([o2]).request_outputs[0].outputs[0]

    assert len(first.logprobs) == 1
    assert first.logprobs[0][the].rank == 1 and first.logprobs[0][the].decoded_token == "The"
    assert first.logprobs[0][EOS_ID].rank == 2 and first.logprobs[0][EOS_ID].decoded_token == "</s>"
    rows = last.logprobs if kind == CUMULATIVE else first.logprobs + last.logprobs
    assert len(last.logprobs) == (2 if kind == CUMULATIVE else 1)
    second = rows[1]
    assert set(second) == {brown, the, EOS_ID}
    assert second[brown].rank == 7 and second[brown].decoded_token == " brown"
    assert math.isclose(second[brown].logprob, -1.0 - brown / 10)
    assert math.isclose(last.cumulative_logprob, (-1.0 - the / 10) + (-1.0 - brown / 10))
    # The detokenizer's offsets come with the logprobs: "The" at 0, " brown" at 3.
    assert (last.text_offsets if kind == CUMULATIVE else first.text_offsets + last.text_offsets) == [0, 3]


def test_prompt_logprobs_accumulate_over_chunks(tokenizer):
    prompt = [BOS_ID, 5, 6, 7, 8]
    proc = OutputProcessor(tokenizer)
    proc.add_request(_request("r", SamplingParams(prompt_logprobs=1), prompt), prompt=None)
    # Two prefill chunks (positions 1-2, then 3-4) arrive before the first token.
    chunk1 = EngineCoreOutput(
        request_id="r", new_token_ids=[], new_prompt_logprobs=_rows([5, 6], [9], [3, 4])
    )
    chunk2 = EngineCoreOutput(
        request_id="r", new_token_ids=[], new_prompt_logprobs=_rows([7, 8], [9], [5, 6])
    )
    assert proc.process_outputs([chunk1]).request_outputs == [], "no tokens yet: nothing to show"
    proc.process_outputs([chunk2])
    out = proc.process_outputs([EngineCoreOutput(request_id="r", new_token_ids=[10])]).request_outputs[0]

    assert len(out.prompt_logprobs) == len(prompt)
    assert out.prompt_logprobs[0] is None
    assert [next(iter(d)) for d in out.prompt_logprobs[1:]] == [5, 6, 7, 8]
    assert [d[t].rank for d, t in zip(out.prompt_logprobs[1:], [5, 6, 7, 8])] == [3, 4, 5, 6]
    assert out.outputs[0].logprobs is None and out.outputs[0].cumulative_logprob is None


def test_abort_parent_returns_children(tokenizer):
    proc = OutputProcessor(tokenizer)
    proc.add_request(_request("solo", SamplingParams()), prompt=None)
    _, child_ids = _fan_out(proc, SamplingParams(n=3))
    assert proc.get_num_unfinished_requests() == 4
    assert sorted(proc.abort_requests(["p", "unknown"])) == sorted(child_ids)
    assert proc.get_num_unfinished_requests() == 1
    assert proc.abort_requests(["solo"]) == ["solo"]
    assert not proc.has_unfinished_requests()
    # Late outputs for aborted requests are dropped.
    late = EngineCoreOutput(request_id=child_ids[0], new_token_ids=[5])
    assert proc.process_outputs([late]).request_outputs == []


def test_duplicate_request_id_rejected(tokenizer):
    proc = OutputProcessor(tokenizer)
    proc.add_request(_request("r", SamplingParams()), prompt=None)
    with pytest.raises(ValueError, match="already running"):
        proc.add_request(_request("r", SamplingParams()), prompt=None)


def test_log_stats_fills_metrics(tokenizer):
    proc = OutputProcessor(tokenizer, log_stats=True)
    proc.add_request(_request("r", SamplingParams()), prompt=None)
    proc.process_outputs([EngineCoreOutput(request_id="r", new_token_ids=[5], num_cached_tokens=2)], 100.0)
    result = proc.process_outputs(
        [EngineCoreOutput(request_id="r", new_token_ids=[6], finish_reason=FinishReason.LENGTH)], 100.5
    )
    out = result.request_outputs[0]
    # The engine core's monotonic stamps, on the wall clock every stat uses.
    assert out.metrics.last_token_ts - out.metrics.first_token_ts == pytest.approx(0.5)
    assert abs(out.metrics.first_token_ts - (100.0 + time.time() - time.monotonic())) < 1.0
    assert out.metrics.num_generation_tokens == 2
    assert out.metrics.finished_time is not None
    assert OutputProcessor(tokenizer).log_stats is False


def test_request_output_add_merges_deltas_and_replaces_cumulative(tokenizer):
    proc = OutputProcessor(tokenizer)
    proc.add_request(_request("r", SamplingParams(output_kind=DELTA)), prompt=None)
    ids = tokenizer.encode("The quick brown", add_special_tokens=False)
    outs = [o for r in _run(proc, "r", ids) for o in r.request_outputs]
    merged = outs[0]
    for later in outs[1:]:
        merged.add(later, aggregate=True)
    assert merged.finished and merged.outputs[0].text == "The quick brown"
    assert merged.outputs[0].token_ids == ids and merged.outputs[0].finish_reason == "length"

    proc.add_request(_request("c", SamplingParams(output_kind=CUMULATIVE)), prompt=None)
    outs = [o for r in _run(proc, "c", ids) for o in r.request_outputs]
    first = outs[0]
    first.add(outs[-1], aggregate=False)
    assert first.outputs[0].text == "The quick brown" and first.finished
