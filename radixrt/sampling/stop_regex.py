"""Stop regexes: SGLang's ``stop_regex`` sampling parameter.

A request with ``stop_regex`` (one pattern or a list) finishes as soon as one
of the patterns is found (``re.search``) in its output text, checked after
every new token like stop strings. As in SGLang:

* a match in text generated before ``min_new_tokens`` is reached stays text,
  as a stop string there does: only a match that ends in a later token counts;
* the finish reason is ``{"type": "stop", "matched": <the pattern>}`` (the
  pattern that matched, not the text it matched);
* the final text is cut where the pattern's own text first occurs in it
  (SGLang's detokenizer looks ``matched`` up literally). For a pattern that
  is plain text (``"END"``, ``"\\n\\n"``) that is where the match begins, as for
  a stop string; for a pattern with metacharacters (``"[0-9]+ apples"``) the
  pattern's text does not occur and the matched text stays in the output.

The scheduler decodes only a tail of the output each step (a bounded window,
not the whole text): `window_tokens` tokens, enough for any match of a
pattern whose longest match is bounded (``"[0-9]{3}"``, ``"END|STOP"``); a
pattern with unbounded repetition (``"a+"``, ``".*"``) is searched in the last
`UNBOUNDED_WINDOW_TOKENS` tokens, so its matches must fit there.

Patterns are checked when a request comes in (`check_patterns`): at most
`MAX_STOP_REGEX_COUNT`, each at most `MAX_STOP_REGEX_BYTES` bytes of UTF-8,
each one that compiles with Python's ``re`` (SGLang's engine). The search
itself runs on the scheduler's thread, so a pattern that backtracks without
end (``(a+)+b`` over a run of a's) must not stall it: the tail is searched
with the ``regex`` package under two budgets of the scheduler thread's CPU time
(so that other load on the machine stops no pattern that fits them):

* a step's: `SEARCH_TIMEOUT_S` for all of a request's searches together in one
  step (its patterns, its ``n`` samples' and the tokens of its accepted drafts;
  each search gets what the ones before it left, `search`'s ``spent_s``);
* a life's (`life_budget_s`): `LIFE_BUDGET_S` plus `TOKEN_BUDGET_S` an output
  token for one sample's searches over its whole output, so that a pattern
  that takes most of a step's budget every step (``(.*)*$x``) cannot slow every
  co-running request for as long as it generates.

Past either, `search` raises `SearchTimeout` and the scheduler ends the request
with an error (a 400). ``regex``'s own timeout is wall time: a search is first
cut at what is left of the budget in wall time, and only when the thread got
less than half of that as CPU (a loaded machine) is it tried again with
`WALL_SLACK` times as long. This module imports no torch.
"""

from __future__ import annotations

import functools
import re
import time
from typing import Any, Optional, Sequence

import regex  # a dependency of transformers too; re has no timeout

try:  # Python 3.11+ (sre_parse is deprecated there)
    from re import _parser as _sre_parse  # type: ignore[attr-defined]
except ImportError:  # pragma: no cover - Python 3.10
    import sre_parse as _sre_parse  # type: ignore[no-redef]

MAX_STOP_REGEX_COUNT = 32  # SGLang's limits
MAX_STOP_REGEX_BYTES = 256
UNBOUNDED_WINDOW_TOKENS = 256  # the tail searched for a pattern with unbounded repetition
_SLACK_TOKENS = 8  # decoding a tail may mangle its first token(s): decode a few more
_CONTEXT_CHARS = 8  # real text kept before the search start for \b, lookbehind, MULTILINE ^
_MARGIN_CHARS = 2  # the newest token's text length is measured on its own: allow for a char or two
WALL_SLACK = 4.0  # a search may take this many times its CPU budget in wall time on a loaded machine
_UNBOUNDED = 1 << 30
SEARCH_TIMEOUT_S = 0.05  # per request and step, all patterns and samples; a sane pattern takes microseconds
# per sample over its output: 32 unbounded patterns over a 256-token tail take about 0.3 ms a token
LIFE_BUDGET_S = 0.25
TOKEN_BUDGET_S = 0.002


class SearchTimeout(ValueError):
    """A stop regex took longer than `SEARCH_TIMEOUT_S` to search a tail."""


def check_patterns(patterns: Sequence[Any]) -> None:
    """ValueError naming ``stop_regex`` unless ``patterns`` are usable stop regexes."""
    if len(patterns) > MAX_STOP_REGEX_COUNT:
        raise ValueError(
            f"sampling parameter 'stop_regex' holds {len(patterns)} patterns; at most {MAX_STOP_REGEX_COUNT}"
        )
    for p in patterns:
        if not isinstance(p, str):
            raise ValueError(
                f"sampling parameter 'stop_regex' must be a string or a list of strings, "
                f"got an element of type {type(p).__name__}"
            )
        if not p:
            raise ValueError("sampling parameter 'stop_regex' must not contain an empty pattern")
        n = len(p.encode("utf-8", "surrogatepass"))
        if n > MAX_STOP_REGEX_BYTES:
            raise ValueError(
                f"sampling parameter 'stop_regex' holds a pattern of {n} bytes; at most {MAX_STOP_REGEX_BYTES}"
            )
        try:
            re.compile(p)
            _compiled(p)
        except (re.error, regex.error, RecursionError, OverflowError, ValueError) as e:
            raise ValueError(f"sampling parameter 'stop_regex' holds an invalid regex {p!r}: {e}") from None


@functools.lru_cache(maxsize=1024)
def _compiled(pattern: str) -> Any:
    return regex.compile(pattern)  # VERSION0: re's syntax and behaviour


@functools.lru_cache(maxsize=1024)
def max_match_chars(pattern: str) -> Optional[int]:
    """An upper bound on how many characters a match of ``pattern`` spans,
    lookarounds included; None when unbounded (or not known)."""
    try:
        n = _width(_sre_parse.parse(pattern))
    except (re.error, RecursionError, OverflowError, ValueError):
        return None
    return n if n < _UNBOUNDED else None


def _width(sub: Any) -> int:
    """Upper bound of the characters a parsed (sub)pattern examines; `_UNBOUNDED` if none."""
    total = 0
    for op, av in sub:
        name = getattr(op, "name", str(op))
        if name in ("LITERAL", "NOT_LITERAL", "IN", "ANY"):
            total += 1
        elif name in ("AT",):  # ^ $ \b \A \Z: zero width
            continue
        elif name == "SUBPATTERN":
            total += _width(av[-1])
        elif name == "ATOMIC_GROUP":
            total += _width(av)
        elif name == "BRANCH":
            total += max((_width(b) for b in av[1]), default=0)
        elif name == "GROUPREF_EXISTS":  # (?(1)yes|no)
            total += max(_width(av[1]), _width(av[2]) if av[2] is not None else 0)
        elif name in ("MAX_REPEAT", "MIN_REPEAT", "POSSESSIVE_REPEAT"):
            _, hi, inner = av
            w = _width(inner)
            if hi == _sre_parse.MAXREPEAT and w > 0:
                return _UNBOUNDED
            total += 0 if w == 0 else hi * w
        elif name in ("ASSERT", "ASSERT_NOT"):  # lookaround: examines text outside the match
            total += _width(av[1])
        else:  # back references and anything unknown
            return _UNBOUNDED
        if total >= _UNBOUNDED:
            return _UNBOUNDED
    return total


def window_tokens(patterns: Sequence[str]) -> int:
    """How many trailing output tokens to decode to search ``patterns``."""
    need = 0
    for p in patterns:
        chars = max_match_chars(p)
        need = max(need, UNBOUNDED_WINDOW_TOKENS if chars is None else min(chars, UNBOUNDED_WINDOW_TOKENS))
    return need + _SLACK_TOKENS


def life_budget_s(output_tokens: int) -> float:
    """CPU seconds one sample's searches may take in all once it has ``output_tokens`` tokens."""
    return LIFE_BUDGET_S + TOKEN_BUDGET_S * output_tokens


def search(
    patterns: Sequence[str],
    tail: str,
    whole: bool,
    new_chars: int,
    spent_s: float = 0.0,
    min_end: int = 0,
    life_left_s: float = float("inf"),
) -> Optional[str]:
    """The first of ``patterns`` found in ``tail`` (the decoded end of the
    output; ``whole`` when it is all of it, and its last ``new_chars``
    characters are the newest token's), or None.

    When the tail is only the end of the output, the search skips the start
    of the tail that no new match can reach: a match that the newest token
    made starts at most ``max_match_chars`` characters before that token's
    text. The skipped characters are context for ``\\b``, lookbehinds and
    MULTILINE ``^``; a plain ``^`` / ``\\A`` never matches the tail's start
    (it is not the output's). Raises `SearchTimeout` when the patterns together
    take longer than what is left of `SEARCH_TIMEOUT_S` after ``spent_s`` (the
    request's other searches this step: its other samples', its drafts'), or than
    ``life_left_s`` (what is left of the sample's `life_budget_s`). ``min_end``: only a
    match that ends past this many characters of ``tail`` counts (the text before it came
    while ``min_new_tokens`` kept the request from stopping, and stays text)."""
    deadline = time.thread_time() + min(SEARCH_TIMEOUT_S - spent_s, life_left_s)
    for p in patterns:
        try:
            found = _search_within(p, tail, whole, new_chars, deadline, min_end)
        except TimeoutError:
            raise SearchTimeout(
                f"stop_regex {p!r} took the request over its search budget: {SEARCH_TIMEOUT_S * 1000:.0f} ms in one "
                "step, with the patterns before it and the request's other samples, and "
                f"{LIFE_BUDGET_S * 1000:.0f} ms plus {TOKEN_BUDGET_S * 1000:.0f} ms an output token in all "
                "(a pattern backtracks too much); the request was stopped"
            ) from None
        if found:
            return p
    return None


def _search_within(p: str, tail: str, whole: bool, new_chars: int, deadline: float, min_end: int) -> bool:
    """`_search_one` until the scheduler thread's CPU clock reaches ``deadline``; TimeoutError past it."""
    left = deadline - time.thread_time()
    if left <= 0:
        raise TimeoutError
    began = time.thread_time()
    try:
        return _search_one(p, tail, whole, new_chars, left, min_end)
    except TimeoutError:
        if time.thread_time() - began >= left / 2:
            raise  # the thread had the CPU: the pattern used its budget
    left = deadline - time.thread_time()  # a loaded machine: wall time is not CPU time
    if left <= 0:
        raise TimeoutError
    return _search_one(p, tail, whole, new_chars, left * WALL_SLACK, min_end)


def _search_one(p: str, tail: str, whole: bool, new_chars: int, timeout: float, min_end: int = 0) -> bool:
    rx = _compiled(p)
    if whole:
        text, start = tail, 0
    else:
        chars = max_match_chars(p)
        if chars is None:  # unbounded: anywhere in the tail, past a little context
            start = min(_CONTEXT_CHARS, len(tail) - new_chars)
        else:
            start = len(tail) - new_chars - chars - _MARGIN_CHARS
        text = tail
        if start <= 0:  # "\0" stands for the unknown text before the tail
            text, start, min_end = "\0" + tail, 1, min_end + 1
    if min_end <= start:
        return rx.search(text, start, timeout=timeout) is not None
    # every match (overlapping ones too): one that ends in the text min_new_tokens held counts not
    return any(m.end() > min_end for m in rx.finditer(text, start, overlapped=True, timeout=timeout))
