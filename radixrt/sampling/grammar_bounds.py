"""Bounds on what a grammar can cost before it is compiled or matched.

A grammar is client input, and xgrammar's costs follow its shape, not its
source size: ``a{3000000}`` is 10 bytes of regex whose jump-forward string is
3 million characters (a second to find, three more to tokenize, on the
scheduler's thread), and a JSON schema that requires itself
(``{"properties": {"n": {"$ref": "#"}}, "required": ["n"]}``) has no finite
instance at all, so xgrammar's jump-forward search, which follows the one
allowed character for as long as there is one, never ends and grows without
bound. Both are refused here, in the caller's thread at submission and again
before compilation, from the grammar's size and structure alone (microseconds):

* the source (regex, schema, EBNF or structural tag) has at most
  ``max_source_chars`` characters: parsing and compiling are linear in it but
  not cheap (a 625,000-character alternation takes 2 s to parse and 7 s to
  compile against a 49,152-token vocabulary), and this is checked first;
* every rule must be *productive*: it derives at least one finite string
  (a rule whose every alternative needs itself again is not);
* the shortest string of every rule is at most ``max_chars``
  characters; with every rule productive, text the grammar forces
  (jump-forward) is a prefix of some rule's shortest completion, so this
  bounds each jump-forward search;
* every repetition count (``{m,n}``, ``minItems``, ...) is at most
  ``max_repeat``, which bounds compilation (xgrammar expands counted
  repetitions into automaton states).

The structure is read from xgrammar's own serialization of the grammar
(``Grammar.serialize_json``): a table of rules and a flat array of
expressions, each ``[type, data_len, data...]``. The expression types are
xgrammar's ``GrammarExprType`` (cpp/grammar_impl.h); the ones that stand for
free text (tag dispatch, token-level dispatch) count as empty, and regular
expressions embedded in a rule (JSON-schema ``pattern``) are measured with
Python's regex parser.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Optional

try:  # Python >= 3.11
    from re import _parser as _sre_parse  # type: ignore[attr-defined]
except ImportError:  # pragma: no cover - Python 3.10
    import sre_parse as _sre_parse  # type: ignore[no-redef]

# xgrammar's GrammarExprType, in order.
(
    BYTE_STRING,
    CHARACTER_CLASS,
    CHARACTER_CLASS_STAR,
    EMPTY_STR,
    RULE_REF,
    SEQUENCE,
    CHOICES,
    TAG_DISPATCH,
    REPEAT,
    TOKEN,
    EXCLUDE_TOKEN,
    TOKEN_TAG_DISPATCH,
    REGEX,
    SUBSTRING,
) = range(14)

INFINITE = float("inf")

DEFAULT_MAX_CHARS = 1 << 16  # shortest text of any rule: far beyond any context, far below a stall
DEFAULT_MAX_REPEAT = 1 << 16  # largest counted repetition
# a grammar's source text: parsing and compiling cost about 15 s a million characters here
DEFAULT_MAX_SOURCE_CHARS = 1 << 18
DEFAULT_MAX_COMPILE_S = 10.0


class GrammarTooCostly(ValueError):
    """The grammar has no finite instance or exceeds a bound; the message says which part."""


@dataclass(frozen=True)
class GrammarLimits:
    """What one request's grammar may cost (see the module docstring)."""

    max_chars: int = DEFAULT_MAX_CHARS
    max_repeat: int = DEFAULT_MAX_REPEAT
    max_source_chars: int = DEFAULT_MAX_SOURCE_CHARS
    max_compile_s: float = DEFAULT_MAX_COMPILE_S  # a large grammar's trial compilation (compile_canary.py)


@dataclass
class _Exprs:
    data: list[int]
    indptr: list[int]

    def get(self, i: int) -> tuple[int, list[int]]:
        start = self.indptr[i]
        end = self.indptr[i + 1] if i + 1 < len(self.indptr) else len(self.data)
        kind, n = self.data[start], self.data[start + 1]
        return kind, self.data[start + 2 : start + 2 + n] if end - start >= 2 + n else self.data[start + 2 : end]


def _regex_min_len(pattern: str, limits: GrammarLimits, rule: str) -> float:
    """The shortest match of an embedded regex, in characters; raises when a
    repetition count exceeds the limit."""
    for m in re.finditer(r"\{\s*(\d+)\s*(?:,\s*(\d*)\s*)?\}", pattern):
        for count in m.groups():
            if count and int(count) > limits.max_repeat:
                raise GrammarTooCostly(
                    f"rule '{rule}': the repetition {m.group(0)} exceeds the limit of {limits.max_repeat}"
                )
    try:
        return float(_sre_parse.parse(pattern).getwidth()[0])
    except Exception:  # noqa: BLE001 - a pattern Python cannot read: xgrammar's own dialect, counted as empty
        return 0.0


def _expr_min_len(
    exprs: _Exprs, i: int, rule_min: list[float], limits: GrammarLimits, rule: str, names: list[str]
) -> float:
    """Shortest string of expression ``i`` given the rules' current estimates."""
    kind, d = exprs.get(i)
    if kind == BYTE_STRING:
        return float(len(d))
    if kind == CHARACTER_CLASS:
        return 1.0
    if kind in (CHARACTER_CLASS_STAR, EMPTY_STR, TAG_DISPATCH, TOKEN_TAG_DISPATCH, SUBSTRING):
        return 0.0
    if kind == RULE_REF:
        return rule_min[d[0]]
    if kind == SEQUENCE:
        return sum((_expr_min_len(exprs, j, rule_min, limits, rule, names) for j in d), 0.0)
    if kind == CHOICES:
        return min((_expr_min_len(exprs, j, rule_min, limits, rule, names) for j in d), default=0.0)
    if kind == REPEAT:
        ref, lo, hi = d[0], d[1], d[2]
        if lo > limits.max_repeat or hi > limits.max_repeat:
            raise GrammarTooCostly(
                f"rule '{rule}': a repetition of '{names[ref]}' "
                f"{{{lo}, {hi if hi >= 0 else ''}}} exceeds the limit of {limits.max_repeat}"
            )
        return 0.0 if lo == 0 else lo * rule_min[ref]
    if kind in (TOKEN, EXCLUDE_TOKEN):
        return 1.0
    if kind == REGEX:
        return _regex_min_len(bytes(b & 0xFF for b in d[1:]).decode("utf-8", "replace"), limits, rule)
    return 0.0  # a type this version does not know: counted as free text


def check_grammar_bounds(grammar: Any, limits: Optional[GrammarLimits] = None) -> None:
    """Raise `GrammarTooCostly` when ``grammar`` (an xgrammar ``Grammar``) has
    a rule with no finite instance, a rule whose shortest text exceeds
    ``limits.max_chars``, or a repetition count above ``limits.max_repeat``.
    Linear in the grammar's size times its rule nesting; touches nothing."""
    limits = limits or GrammarLimits()
    table = json.loads(grammar.serialize_json())
    rules = table["rules"]
    names = [str(r[0]) for r in rules]
    exprs = _Exprs(table["grammar_expr_data"], table["grammar_expr_indptr"])
    rule_min = [INFINITE] * len(rules)
    # Least fixpoint: a rule's estimate only falls, and reaches its shortest derivation.
    changed = True
    while changed:
        changed = False
        for r, rule in enumerate(rules):
            n = _expr_min_len(exprs, int(rule[1]), rule_min, limits, names[r], names)
            if n < rule_min[r]:
                rule_min[r] = n
                changed = True
    for r, n in enumerate(rule_min):
        if n == INFINITE:
            raise GrammarTooCostly(
                f"it has no finite instance: rule '{names[r]}' can only be completed by "
                "repeating itself (a recursive schema or grammar with no way out)"
            )
        if n > limits.max_chars:
            raise GrammarTooCostly(
                f"rule '{names[r]}' needs at least {int(n)} characters, more than the limit of {limits.max_chars}"
            )
