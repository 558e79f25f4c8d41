"""Client-side fallback for output constraints a backend may not enforce.

The in-process engine and radixrt servers decode ``regex`` / ``dtype``
constraints exactly, and then nothing here changes the output. A backend that
ignores them (an OpenAI-compatible server without constrained decoding, a
test backend) can return text that breaks the constraint;
:func:`fit_to_constraint` then repairs what it can and flags the rest:

* ``regex``: keep the longest prefix of the output that matches (meta flag
  ``constraint_fallback: "trimmed"``), else keep the output and flag
  ``constraint_violated``;
* ``dtype=int`` / ``float``: keep the leading number (the variable holds the
  number alone), else flag ``dtype_mismatch``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from .sampling_params import SglSamplingParams

_INT_PREFIX = re.compile(r"\s*([-+]?[0-9]+)")
_FLOAT_PREFIX = re.compile(r"\s*([-+]?[0-9]+(?:\.[0-9]+)?)")


@dataclass
class Fitted:
    """What to keep of one generation: ``text`` stays in the program text,
    ``value`` is stored in the variable, ``flags`` go into its meta info."""

    text: str
    value: str
    flags: dict[str, Any] = field(default_factory=dict)


def fit_to_constraint(sp: SglSamplingParams, output: str) -> Fitted:
    """``output`` of a single-sample generation, fitted to ``sp``'s ``regex``
    (which wins) or ``dtype``."""
    if sp.regex is not None:
        return _fit_regex(sp.regex, output)
    pattern = _number_prefix(sp.dtype)
    return Fitted(output, output) if pattern is None else _fit_number(pattern, output)


def _fit_regex(regex: str, output: str) -> Fitted:
    try:
        rx = re.compile(regex)
    except re.error:
        return Fitted(output, output)
    if rx.fullmatch(output):
        return Fitted(output, output)
    for k in range(len(output) - 1, 0, -1):
        if rx.fullmatch(output, 0, k):
            return Fitted(output[:k], output[:k], {"constraint_fallback": "trimmed"})
    return Fitted(output, output, {"constraint_violated": True})


def _number_prefix(dtype: Any):
    if dtype in (int, "int"):
        return _INT_PREFIX
    if dtype in (float, "float"):
        return _FLOAT_PREFIX
    return None


def _fit_number(pattern: re.Pattern, output: str) -> Fitted:
    m = pattern.match(output)
    if m is None:
        return Fitted(output, output.strip(), {"dtype_mismatch": True})
    return Fitted(output[: m.end()], m.group(1))
