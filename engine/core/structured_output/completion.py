"""Budget-aware completion: finish a constrained output before ``max_tokens`` runs out.

A grammar mask only says which token may come next; it does not make the model *finish*.
A small model inside a JSON string may write text until ``max_tokens`` and stop with the
string still open: finish reason ``length``, and JSON that does not parse. So when a
request's remaining budget gets short, the manager plans a short completion — a token
sequence that takes the grammar from where the output is now to an accepting state — and
forces it, one token per step (the mask allows only the planned token). The output then
always ends inside the grammar, whatever the model would have written.

How the plan is found (``plan_completion``): a depth-first search over real grammar states
(each step is the matcher's own ``consume_token``, so any plan found is valid by
construction), trying at each state the allowed tokens most likely to *close* things first:

1. tokens that leave fewer JSON-style openings (an open string counts one, each unclosed
   ``{`` or ``[`` one) — ``"``, ``}``, ``]``;
2. then by the class of their first byte: closers, separators (``,`` ``:``), digits, other
   punctuation, letters; shorter tokens first among equals (``0`` rather than ``12345678``);
   whitespace-only tokens last of all.

The ordering is only a heuristic (it knows JSON's brackets, and is neutral for regexes and
grammars); correctness comes from the matcher. The search is bounded (``max_evaluations``
matcher copies, 400: the schemas of the tests find their plan in 10 to 200), and returns
None when it finds nothing in time.

When (``GuidanceGrammar.fill_bitmask``): at compile time the plan from the grammar's start
gives the shortest whole output, ``L0`` tokens; once ``remaining <= reserve_tokens(L0)`` the
request plans from where it is and, if the plan fits the budget, follows it. Deviation: vLLM
has no such rule (its outputs end ``length`` with an unclosed document when the model
rambles); it changes nothing while the budget is large.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

# First-byte classes, tried in this order among tokens that leave as many openings.
_CLOSERS, _SEPARATORS, _DIGITS, _PUNCTUATION, _LETTERS, _WHITESPACE, _OTHER = range(7)
_WHITESPACE_BYTES = frozenset(b" \t\n\r")
# The bytes that open or close something (a token without any is scanned without scanning).
_STRUCTURAL = frozenset(b'"\\{}[]')
_CLOSING_BYTES = frozenset(b'"{}[],:0123456789 \t\n\r')
# Above this many allowed tokens, only the ``TokenTable.closing`` ones are ranked.
_RANK_ALL_BELOW = 256


def _byte_class(byte: int) -> int:
    if byte in b'"}])':
        return _CLOSERS
    if byte in b",:":
        return _SEPARATORS
    if 0x30 <= byte <= 0x39:
        return _DIGITS
    if byte in _WHITESPACE_BYTES:
        return _WHITESPACE
    if 0x41 <= byte <= 0x5A or 0x61 <= byte <= 0x7A:
        return _LETTERS
    if byte < 0x80:
        return _PUNCTUATION
    return _OTHER


def _scan(data: bytes, depth: int, in_string: bool, escaped: bool) -> tuple[int, bool, bool]:
    """JSON-style openings after ``data``: (unclosed brackets, inside a string, after a backslash)."""
    for byte in data:
        if in_string:
            if escaped:
                escaped = False
            elif byte == 0x5C:  # backslash
                escaped = True
            elif byte == 0x22:  # quote
                in_string = False
        elif byte == 0x22:
            in_string = True
        elif byte in b"{[":
            depth += 1
        elif byte in b"}]":
            depth -= 1
    return depth, in_string, escaped


class TokenTable:
    """Per-token facts the search ranks by, computed once per tokenizer.

    Args:
        token_bytes: each token id's bytes (``b""`` for special tokens, never planned).
    """

    def __init__(self, token_bytes: Sequence[bytes]) -> None:
        self.token_bytes = list(token_bytes)
        n = len(self.token_bytes)
        self.usable = np.array([bool(b) for b in self.token_bytes])  # (n,) special tokens are never planned
        self.length = np.array([len(b) for b in self.token_bytes], dtype=np.int64)  # (n,)
        # The tokens the search ranks where many are allowed (inside a string, a number): the
        # short ones (at most 2 bytes) and those made only of JSON's punctuation, digits and
        # whitespace; a vocabulary of 150k ranks a few hundred, not all of them.
        self.closing = np.array(
            [0 < len(b) <= 2 or (bool(b) and set(b) <= _CLOSING_BYTES) for b in self.token_bytes]
        )  # (n,)
        # Whitespace-only tokens are tried last, whatever they leave open.
        self.whitespace = np.array(
            [bool(b) and all(byte in _WHITESPACE_BYTES for byte in b) for b in self.token_bytes]
        )  # (n,)
        self.first_class = np.array(
            [_byte_class(b[0]) if b else _OTHER for b in self.token_bytes], dtype=np.int64
        )  # (n,)
        # From outside and from inside a string: the change in open brackets, and whether
        # the token ends inside a string.
        self.depth_delta = np.zeros((2, n), dtype=np.int64)
        self.ends_in_string = np.zeros((2, n), dtype=np.int64)
        self.ends_in_string[1] = 1  # a token without quotes stays where it started
        for i, data in enumerate(self.token_bytes):
            if not _STRUCTURAL.intersection(data):  # most tokens: nothing to scan
                continue
            for start in (0, 1):
                depth, in_string, _ = _scan(data, 0, bool(start), False)
                self.depth_delta[start, i] = depth
                self.ends_in_string[start, i] = in_string

    def ranked(self, allowed: np.ndarray, state: tuple[int, bool, bool], limit: int) -> list[int]:
        """The best ``limit`` of the ``allowed`` token ids, one per (openings, class) pair,
        best first (the shortest token of each pair)."""
        allowed = allowed[self.usable[allowed]]
        if allowed.size > _RANK_ALL_BELOW:
            closing = allowed[self.closing[allowed]]
            if closing.size:
                allowed = closing
        if allowed.size == 0:
            return []
        depth, in_string, escaped = state
        if escaped:  # right after a backslash: the few escapes allowed, scanned one by one
            openings = np.array(
                [sum(_scan(self.token_bytes[t], depth, True, True)[:2]) for t in allowed], dtype=np.int64
            )
        else:
            start = int(in_string)
            openings = depth + self.depth_delta[start, allowed] + self.ends_in_string[start, allowed]
        classes = self.first_class[allowed]
        whitespace = self.whitespace[allowed]
        order = np.lexsort((self.length[allowed], classes, openings, whitespace))  # last key sorts first
        # (whitespace, openings, class) as one number, in sorted order: keep each run's first.
        keys = whitespace[order] * 1_000_000 + (openings[order] + 1000) * 10 + classes[order]
        firsts = np.flatnonzero(np.concatenate(([True], keys[1:] != keys[:-1])))[:limit]
        return [int(t) for t in allowed[order[firsts]]]


def plan_completion(
    matcher,
    table: TokenTable,
    allowed_tokens: Callable[[object], np.ndarray],
    text_so_far: bytes,
    max_tokens: int,
    max_evaluations: int = 400,
    branching: int = 3,
) -> list[int] | None:
    """A token sequence of at most ``max_tokens`` that takes ``matcher`` to an accepting state.

    Args:
        matcher: an ``llguidance.LLMatcher`` where the output is now (left untouched: the
            search works on copies).
        table: the tokenizer's ``TokenTable``.
        allowed_tokens: a matcher → the token ids it allows next (int64 array).
        text_so_far: the output's bytes so far (where the JSON-style openings are counted from).
        max_tokens: the longest plan wanted.
        max_evaluations: matcher copies the search may make before it gives up.
        branching: the alternatives tried at each state.

    Returns:
        The plan (``[]`` when the matcher already accepts), or None when none was found.
    """
    if matcher.is_accepting():
        return []
    evaluations = 0
    # Depth-first: each frame is (matcher, scan state, plan so far, untried tokens).
    root_state = _scan(text_so_far, 0, False, False)
    stack = [(matcher, root_state, [], None)]
    while stack:
        state_matcher, state, plan, untried = stack[-1]
        if untried is None:
            if len(plan) >= max_tokens:
                stack.pop()
                continue
            untried = table.ranked(allowed_tokens(state_matcher), state, branching)
            stack[-1] = (state_matcher, state, plan, untried)
        if not untried or evaluations >= max_evaluations:
            stack.pop()
            continue
        token = untried.pop(0)
        child = state_matcher.deep_copy()
        evaluations += 1
        if not child.consume_token(token) or child.is_error():
            continue
        child_plan = plan + [token]
        if child.is_accepting():
            return child_plan
        stack.append((child, _scan(table.token_bytes[token], *state), child_plan, None))
    return None


def reserve_tokens(shortest_output: int | None) -> int:
    """How many tokens before ``max_tokens`` a request starts planning its completion: twice
    the shortest whole output (a completion from mid-way may have to finish a nested item
    as well as the rest), plus 8 for a string or number left open; 32 when no shortest
    output was found."""
    if shortest_output is None:
        return 32
    return 2 * shortest_output + 8
