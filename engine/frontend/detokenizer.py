"""Token ids → text, a few tokens at a time, and stop strings.

Mirrors vLLM's ``vllm/v1/engine/detokenizer.py`` (``IncrementalDetokenizer``,
``check_stop_strings``). One detokenizer per request, living in the frontend: the engine
core only ever sees token ids.

The idea: a byte-level BPE token can be a piece of a UTF-8 character (``"🙂"`` may be four
tokens of one byte each), and some decoders render a token differently depending on the
token before it. So each step decodes a short window of ids, ``ids[prefix_offset:]``, and
compares it with the text of the part already handed out, ``ids[prefix_offset:read_offset]``
(the *prefix text*). The new text is whatever the window has beyond the prefix text — and
nothing, for now, while the window's text ends in U+FFFD (an incomplete character: wait for
its remaining bytes). When text is handed out, both offsets move forward, so each decode
touches only a handful of tokens.

Why not ``tokenizers.decoders.DecodeStream``, which runs the same scheme in Rust (and which
vLLM's fast path uses)? It compares *byte* prefixes, and a prompt that ends in the middle of a
character breaks that: primed with such a prompt it hands out the completed character —
prompt bytes included — as output (primed through ``DecodeStream(ids=...)`` in tokenizers
0.23, even the whole prompt text). Comparing lengths in *characters* instead treats the
prompt's trailing U+FFFD as the character it becomes, so the boundary character (half
prompt, half output) is never emitted and no prompt byte leaks. vLLM's slow-tokenizer path
behaves the same way.

Stop strings: after each update the new text (plus the ``len(stop) - 1`` characters before
it) is searched; on a match the text is cut at the stop string (or after it with
``include_stop_str_in_output``) and the output processor finishes the request and asks the
engine to abort it. While a request runs, ``get_next_output_text`` holds back the last
``output_text_buffer_length`` characters, so a stop string never shows, even in part, in a
streamed delta.

Text offsets: ``token_offsets[i]`` is where output token ``i``'s text starts in
``output_text`` (before a stop-string cut) — what the legacy completions API reports as
``logprobs.text_offset``, so kept only for a request that asks for logprobs. Counting each token's text decoded alone would be wrong twice over:
a token holding part of a UTF-8 character decodes alone to U+FFFD, one character too many,
and a stream knows only the characters already sent, which lag behind by any held-back text.

Left out: ``spaces_between_special_tokens=False`` (fast tokenizers decode special tokens
one way only; vLLM's fast path ignores it too); bytes of a character that never completes
are not flushed at the end.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tokenizers import Tokenizer

    from engine.core.messages import EngineCoreRequest

# How many prompt tokens to decode as context before the first output token (vLLM:
# INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET). Enough for a decoder that looks back one
# token and for a character split over up to four byte tokens.
INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET = 5

REPLACEMENT_CHAR = "\ufffd"


def backend_tokenizer(tokenizer: Any) -> Tokenizer:
    """The Rust ``tokenizers.Tokenizer`` behind a ``PreTrainedTokenizerFast`` (or itself)."""
    return getattr(tokenizer, "backend_tokenizer", tokenizer)


def check_stop_strings(
    output_text: str, new_char_count: int, stop: list[str], include_in_output: bool
) -> tuple[str, int] | None:
    """Find a stop string that ends in the last ``new_char_count`` characters.

    Only the new text and the ``len(stop_str) - 1`` characters before it are searched:
    earlier text was searched in earlier steps. When several stop strings match, the one
    that starts first wins (vLLM takes the first in list order; the earliest is the one a
    token-by-token run would have stopped at).

    Returns:
        None, or ``(stop_str, truncate_to)``: cut the text to ``output_text[:truncate_to]``
        (the start of the stop string, or its end with ``include_in_output``); -1 means the
        text ends exactly where it should and needs no cut.
    """
    if new_char_count <= 0 or not stop:
        return None
    best: tuple[int, str] | None = None
    for stop_str in stop:
        start = max(0, len(output_text) - new_char_count - len(stop_str) + 1)
        index = output_text.find(stop_str, start)
        if index != -1 and (best is None or index < best[0]):
            best = (index, stop_str)
    if best is None:
        return None
    index, stop_str = best
    truncate_to = index + len(stop_str) if include_in_output else index
    return stop_str, (-1 if truncate_to >= len(output_text) else truncate_to)


class IncrementalDetokenizer:
    """Turns one request's output token ids into text, step by step.

    Args:
        tokenizer: a ``PreTrainedTokenizerFast`` or a ``tokenizers.Tokenizer``.
        prompt_token_ids: the prompt; its last tokens are decoded as context only.
        skip_special_tokens: drop special tokens (BOS, EOS, ...) from the text.
        stop: stop strings (empty: none).
        include_stop_str_in_output: keep a matched stop string at the end of the text.
        output_text_buffer_length: characters to withhold from unfinished outputs
            (``SamplingParams.output_text_buffer_length``: longest stop string - 1).
        min_tokens: stop strings are not looked for in the text of the first
            ``min_tokens`` output tokens (as the scheduler ignores EOS until then).
        detokenize: False keeps only token ids; the text stays "" (and offsets are 0).
        text_offsets: keep ``token_offsets`` (the output processor asks for them only for a
            request with ``logprobs``: the completions API reports them with those).

    Attributes:
        output_text: the text so far (cut at a matched stop string).
        output_token_ids: every output token so far.
        token_offsets: per output token, the offset of its text in ``output_text``
            (``len(output_text)`` or more for tokens cut off with a stop string); None
            without ``text_offsets``.
    """

    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: list[int],
        *,
        skip_special_tokens: bool = True,
        stop: list[str] | None = None,
        include_stop_str_in_output: bool = False,
        output_text_buffer_length: int = 0,
        min_tokens: int = 0,
        detokenize: bool = True,
        text_offsets: bool = True,
    ) -> None:
        self.tokenizer = backend_tokenizer(tokenizer)
        self.skip_special_tokens = skip_special_tokens
        self.stop = list(stop or [])
        self.include_stop_str_in_output = include_stop_str_in_output
        self.output_text_buffer_length = output_text_buffer_length
        self.min_tokens = min_tokens
        self.detokenize = detokenize

        self.output_text = ""
        self.output_token_ids: list[int] = []
        # Per output token: where its text starts in output_text (the text before any stop
        # string cut), kept only when asked for. See _record_offset() and update().
        self.token_offsets: list[int] | None = [] if text_offsets else None
        # How much of output_text get_next_output_text(delta=True) has handed out.
        self._last_output_text_offset = 0

        # The decode window: a few prompt tokens as context, then the output tokens.
        self._ids: list[int] = prompt_token_ids[-INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET:]
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        # Text of ids[prefix_offset:read_offset]. When the prompt ends mid-character it
        # ends in U+FFFD, which stands for the character the first output bytes complete.
        self._prefix_text = self._decode(self._ids) if detokenize else ""
        # Text of the whole window ids[prefix_offset:] as last decoded.
        self._window_text = self._prefix_text

    @classmethod
    def from_new_request(cls, tokenizer: Any, request: EngineCoreRequest) -> IncrementalDetokenizer:
        """Build the detokenizer for a request, with its sampling params' settings."""
        params = request.sampling_params
        return cls(
            tokenizer,
            request.prompt_token_ids,
            skip_special_tokens=params.skip_special_tokens,
            stop=params.stop,
            include_stop_str_in_output=params.include_stop_str_in_output,
            output_text_buffer_length=params.output_text_buffer_length,
            min_tokens=params.min_tokens,
            detokenize=params.detokenize,
            text_offsets=params.logprobs is not None,
        )

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def decode_next(self, token_id: int) -> str:
        """Add one token; return the text it completes ("" while a character is partial)
        (vLLM's ``FastIncrementalDetokenizer.decode_next``). With ``token_offsets`` kept, it
        also records where the token's text starts (``_record_offset``)."""
        self._ids.append(token_id)
        text = self._decode(self._ids[self._prefix_offset :])
        if self.token_offsets is not None:
            self._record_offset(text)
        if len(text) <= len(self._prefix_text) or text.endswith(REPLACEMENT_CHAR):
            # Nothing new yet: a skipped special token, a partial character, or the
            # output's first bytes completing a character the prompt began.
            self._window_text = text
            return ""
        new_text = text[len(self._prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self._prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        self._window_text = self._prefix_text
        return new_text

    def _record_offset(self, text: str) -> None:
        """Append to ``token_offsets`` where the token just added starts in ``output_text``,
        given ``text``, the window's text with it (``decode_next`` calls this before it
        extends ``output_text``).

        Where it starts is where the window's text before and after the token part: their
        common prefix, less a trailing run of U+FFFD that is still an incomplete character.
        So a lone byte that never becomes a character counts as one U+FFFD once text follows
        it, and the bytes of a character under way point at that character. Never before the
        previous token's offset (a decoder may rewrite text already out).
        """
        before = self._window_text
        # Mostly the token only appends text: no character-by-character comparison then.
        common = len(before) if text.startswith(before) else len(os.path.commonprefix([before, text]))
        while common and text[common - 1] == REPLACEMENT_CHAR and not text[common:].strip(REPLACEMENT_CHAR):
            common -= 1
        offset = len(self.output_text) + common - len(self._prefix_text)
        self.token_offsets.append(max(offset, self.token_offsets[-1] if self.token_offsets else 0))

    def update(self, new_token_ids: list[int], stop_terminated: bool = False) -> str | None:
        """Add a step's tokens, extend ``output_text`` (and ``token_offsets``), look for stop strings.

        Args:
            new_token_ids: the tokens the engine produced this step.
            stop_terminated: the engine stopped the request on its last token (EOS or a
                stop token id); that token's text is left out unless
                ``include_stop_str_in_output`` (vLLM does the same).

        Returns:
            The stop string that matched (``output_text`` is then already cut), or None.
        """
        self.output_token_ids.extend(new_token_ids)
        to_decode = new_token_ids if self.detokenize else []
        if stop_terminated and not self.include_stop_str_in_output:
            to_decode = to_decode[:-1]

        # Text from tokens inside the first min_tokens is never searched for stop strings.
        num_before = len(self.output_token_ids) - len(new_token_ids)
        search_from = len(self.output_text)
        for i, token_id in enumerate(to_decode):
            self.output_text += self.decode_next(token_id)
            if num_before + i + 1 <= self.min_tokens:
                search_from = len(self.output_text)
        if self.token_offsets is not None:
            # Tokens with no text of their own (the stop token left out; every token without
            # detokenize) sit at the text's end.
            missing = len(self.output_token_ids) - len(self.token_offsets)
            self.token_offsets += [len(self.output_text)] * missing
        return self._check_stop_strings(search_from) if self.stop else None

    def _check_stop_strings(self, search_from: int) -> str | None:
        """The stop string that ends in ``output_text[search_from:]``, with ``output_text``
        cut at it (``check_stop_strings``), or None."""
        new_chars = len(self.output_text) - search_from
        match = check_stop_strings(self.output_text, new_chars, self.stop, self.include_stop_str_in_output)
        if match is None:
            return None
        stop_str, truncate_to = match
        if truncate_to != -1:
            self.output_text = self.output_text[:truncate_to]
        return stop_str

    def get_next_output_text(self, finished: bool, delta: bool) -> str:
        """The text to put in the next ``CompletionOutput``.

        While unfinished, the last ``output_text_buffer_length`` characters are held back
        (they could be the start of a stop string); on finish everything is released.

        Args:
            finished: this is the request's last output.
            delta: return only text not returned by an earlier delta call.
        """
        held = 0 if finished else self.output_text_buffer_length
        visible = max(0, len(self.output_text) - held)
        if not delta:
            return self.output_text[:visible]
        start = self._last_output_text_offset
        # Never backwards: text once handed out is not handed out again.
        self._last_output_text_offset = max(start, visible)
        return self.output_text[start:visible]
