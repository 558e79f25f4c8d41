"""How `SamplingParams` reads its fields: the type rules of every field kind (see params.py's
docstring), each refusal a ValueError that names the sampling parameter."""

from __future__ import annotations

import numbers
from typing import Any

FLOAT32_MAX = 3.4028234663852886e38  # the largest finite float32
LOGIT_BIAS_LIMIT = 100.0  # logit_bias values are clamped to [-100, 100]


def type_name(value: Any) -> str:
    return type(value).__name__


def as_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"sampling parameter '{name}' must be an integer, got {type_name(value)} {value!r}")
    return int(value)


def as_float(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"sampling parameter '{name}' must be a number, got {type_name(value)} {value!r}")
    return float(value)


def f32_ok(x: float) -> bool:
    """Finite and within float32's range (NaN fails)."""
    return -FLOAT32_MAX <= x <= FLOAT32_MAX


def clamp_bias(x: float) -> float:
    """A logit_bias value clamped to [-LOGIT_BIAS_LIMIT, LOGIT_BIAS_LIMIT];
    one outside float32's range (or NaN) is kept as is for ``validate`` to refuse."""
    return max(-LOGIT_BIAS_LIMIT, min(LOGIT_BIAS_LIMIT, x)) if f32_ok(x) else x


def as_str_list(name: str, value: Any) -> list[str]:
    """None, a string or a list/tuple of strings -> a new list of strings."""
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    if isinstance(value, (list, tuple)):
        for s in value:
            if not isinstance(s, str):
                raise ValueError(
                    f"sampling parameter '{name}' must be a string or a list of strings, "
                    f"got an element of type {type_name(s)}"
                )
        return list(value)
    raise ValueError(f"sampling parameter '{name}' must be a string or a list of strings, got {type_name(value)}")


def as_bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"sampling parameter '{name}' must be a boolean, got {type_name(value)} {value!r}")
    return value


def as_int_list(name: str, value: Any) -> list[int]:
    """A list/tuple of integers -> a new list of ints."""
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"sampling parameter '{name}' must be a list of token ids, got {type_name(value)}")
    return [as_int(name, t) for t in value]
