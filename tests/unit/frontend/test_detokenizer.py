"""The incremental detokenizer: split characters, prompt boundaries, special tokens, stop strings."""

from __future__ import annotations

import pytest
from frontend_fixtures import BOS_ID, EOS_ID, build_tokenizer_dir

from engine.frontend.detokenizer import IncrementalDetokenizer, check_stop_strings
from engine.frontend.tokenizer import get_tokenizer

SPLIT_TEXT = "Hi 日本語 and 👍 ok ñ, the end."


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return get_tokenizer(str(build_tokenizer_dir(tmp_path_factory.mktemp("tok"))))


def _encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def _stream(detok: IncrementalDetokenizer, ids: list[int]) -> list[str]:
    return [detok.decode_next(t) for t in ids]


def test_split_characters_never_come_out_broken(tokenizer):
    ids = _encode(tokenizer, SPLIT_TEXT)
    # The fixture must really split characters: some tokens are lone UTF-8 bytes.
    assert sum(tokenizer.decode([t]) == "\ufffd" for t in ids) >= 5

    detok = IncrementalDetokenizer(tokenizer, _encode(tokenizer, "Hello world"))
    deltas = _stream(detok, ids)

    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == tokenizer.decode(ids) == SPLIT_TEXT


def test_prompt_ending_mid_character_leaks_nothing(tokenizer):
    ids = _encode(tokenizer, "Hello 日本 ok")
    # Cut inside "日" (three byte tokens): the prompt holds its first byte only.
    cut = next(i for i, t in enumerate(ids) if tokenizer.decode(ids[: i + 1]).endswith("\ufffd")) + 1
    prompt, output = [BOS_ID] + ids[:cut], ids[cut:]
    assert tokenizer.decode(prompt, skip_special_tokens=True).endswith("\ufffd")

    detok = IncrementalDetokenizer(tokenizer, prompt)
    deltas = _stream(detok, output)

    # "日" is half prompt bytes: it is not output, and neither is any prompt text.
    assert "".join(deltas) == "本 ok"
    assert all("\ufffd" not in d for d in deltas)


def test_whole_prompt_context_is_not_output(tokenizer):
    prompt = tokenizer.encode("The quick brown")  # with BOS
    detok = IncrementalDetokenizer(tokenizer, prompt)
    assert "".join(_stream(detok, _encode(tokenizer, " fox jumps"))) == " fox jumps"


@pytest.mark.parametrize("skip", [True, False])
def test_skip_special_tokens(tokenizer, skip):
    ids = _encode(tokenizer, "Hello") + [EOS_ID] + _encode(tokenizer, " world")
    detok = IncrementalDetokenizer(tokenizer, [BOS_ID], skip_special_tokens=skip)
    detok.update(ids)
    assert detok.output_text == ("Hello world" if skip else "Hello</s> world")


def test_stop_token_text_left_out_when_stop_terminated(tokenizer):
    # The engine stopped on EOS: its text is not part of the output even when special
    # tokens are shown, unless include_stop_str_in_output.
    ids = _encode(tokenizer, "The end") + [EOS_ID]
    detok = IncrementalDetokenizer(tokenizer, [BOS_ID], skip_special_tokens=False)
    detok.update(ids, stop_terminated=True)
    assert detok.output_text == "The end"
    assert detok.output_token_ids == ids

    kept = IncrementalDetokenizer(
        tokenizer, [BOS_ID], skip_special_tokens=False, include_stop_str_in_output=True
    )
    kept.update(ids, stop_terminated=True)
    assert kept.output_text == "The end</s>"


def test_check_stop_strings_finds_earliest_and_cuts():
    text = "abc STOP xyz END"
    # The last 10 characters are new ("OP xyz END"): "STOP" starts before them and ends
    # inside; both stop strings match and the earlier one wins.
    assert check_stop_strings(text, 10, ["END", "STOP"], include_in_output=False) == ("STOP", 4)
    assert check_stop_strings(text, 10, ["END", "STOP"], include_in_output=True) == ("STOP", 8)
    # Stop string at the very end with include_in_output: no cut needed.
    assert check_stop_strings(text, 3, ["END"], include_in_output=True) == ("END", -1)
    # Text searched in an earlier step is not searched again.
    assert check_stop_strings(text, 3, ["abc"], include_in_output=False) is None


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_split_across_tokens(tokenizer, include):
    ids = _encode(tokenizer, "The quick brown fox jumps over")
    stop = "own fo"  # the end of " brown" and the start of " fox"
    detok = IncrementalDetokenizer(
        tokenizer, [BOS_ID], stop=[stop], include_stop_str_in_output=include,
        output_text_buffer_length=0 if include else len(stop) - 1,
    )  # fmt: skip
    matched = None
    for token_id in ids:
        matched = detok.update([token_id])
        if matched:
            break
    assert matched == stop
    assert tokenizer.decode([token_id]) == " fox", "found on the token that completes it"
    assert detok.output_text == ("The quick brown fo" if include else "The quick br")


def test_unfinished_text_holds_back_buffer(tokenizer):
    detok = IncrementalDetokenizer(tokenizer, [BOS_ID], stop=["STOP"], output_text_buffer_length=3)
    detok.update(_encode(tokenizer, "Hello world"))
    assert detok.get_next_output_text(finished=False, delta=True) == "Hello wo"
    assert detok.get_next_output_text(finished=False, delta=True) == ""
    assert detok.get_next_output_text(finished=False, delta=False) == "Hello wo"
    assert detok.get_next_output_text(finished=True, delta=True) == "rld"


def test_min_tokens_delays_stop_strings(tokenizer):
    ids = _encode(tokenizer, "The end. The end.")
    detok = IncrementalDetokenizer(tokenizer, [BOS_ID], stop=["end"], min_tokens=3)
    assert detok.update(ids[:3]) is None  # "The end" lies within the first 3 tokens
    assert detok.update(ids[3:]) == "end"
    assert detok.output_text == "The end. The "


def test_detokenize_false_keeps_ids_only(tokenizer):
    detok = IncrementalDetokenizer(tokenizer, [BOS_ID], detokenize=False)
    ids = _encode(tokenizer, "Hello")
    detok.update(ids)
    assert detok.output_text == "" and detok.output_token_ids == ids


def _check_offsets(tokenizer, text: str, ids: list[int], offsets: list[int]) -> None:
    """Each offset is where its token's text starts in ``text``."""
    assert len(offsets) == len(ids)
    assert offsets == sorted(offsets)
    for token_id, offset in zip(ids, offsets):
        own = tokenizer.decode([token_id])
        # A token holding part of a character decodes alone to U+FFFD: what comes before
        # that is at the offset, then the character it is part of.
        head, partial, _ = own.partition("\ufffd")
        assert text[offset : offset + len(head)] == head
        if partial:
            char = text[offset + len(head)]
            assert len(char.encode()) > 1 or char == "\ufffd"


def test_token_offsets_are_positions_in_the_text(tokenizer):
    ids = _encode(tokenizer, SPLIT_TEXT)
    one_go = IncrementalDetokenizer(tokenizer, [BOS_ID])
    one_go.update(ids)
    _check_offsets(tokenizer, one_go.output_text, ids, one_go.token_offsets)
    # Counting each token's own text would overshoot: split characters decode alone to U+FFFD.
    assert one_go.token_offsets[-1] < sum(len(tokenizer.decode([t])) for t in ids[:-1])

    # Token by token (a stream) gives the same offsets.
    stepped = IncrementalDetokenizer(tokenizer, [BOS_ID])
    for token_id in ids:
        stepped.update([token_id])
    assert stepped.token_offsets == one_go.token_offsets


def test_token_offsets_after_a_byte_that_never_becomes_a_character(tokenizer):
    lead = next(t for t in _encode(tokenizer, "日") if tokenizer.decode([t]) == "\ufffd")
    ids = [lead, *_encode(tokenizer, " ok")]
    detok = IncrementalDetokenizer(tokenizer, [BOS_ID])
    detok.update(ids)
    assert detok.output_text == "\ufffd ok"
    assert detok.token_offsets[0] == 0 and detok.token_offsets[1] == 1  # " ok" follows the U+FFFD
    _check_offsets(tokenizer, detok.output_text, ids, detok.token_offsets)


def test_token_offsets_at_a_prompt_ending_mid_character(tokenizer):
    ids = _encode(tokenizer, "Hello 日本 ok")
    cut = next(i for i, t in enumerate(ids) if tokenizer.decode(ids[: i + 1]).endswith("\ufffd")) + 1
    # ids[cut:done] are the bytes that complete "日", whose first byte ends the prompt.
    done = next(j for j in range(cut, len(ids)) if not tokenizer.decode(ids[: j + 1]).endswith("\ufffd")) + 1
    detok = IncrementalDetokenizer(tokenizer, [BOS_ID] + ids[:cut])
    detok.update(ids[cut:])
    assert detok.output_text == "本 ok"
    # Those bytes add no text here ("日" is not output): they sit at the start.
    assert detok.token_offsets[: done - cut] == [0] * (done - cut)
    _check_offsets(tokenizer, detok.output_text, ids[done:], detok.token_offsets[done - cut :])


def test_token_offsets_of_a_stop_token_and_a_stop_string(tokenizer):
    ids = _encode(tokenizer, "The end") + [EOS_ID]
    detok = IncrementalDetokenizer(tokenizer, [BOS_ID], skip_special_tokens=False)
    detok.update(ids, stop_terminated=True)
    assert detok.token_offsets[-1] == len(detok.output_text) == len("The end")

    # A stop string cuts the text, not the offsets: they stay where the tokens were.
    ids = _encode(tokenizer, "The quick brown fox")
    detok = IncrementalDetokenizer(tokenizer, [BOS_ID], stop=["brown"])
    detok.update(ids)
    full = IncrementalDetokenizer(tokenizer, [BOS_ID])
    full.update(ids)
    assert detok.output_text == "The quick "
    assert detok.token_offsets == full.token_offsets
