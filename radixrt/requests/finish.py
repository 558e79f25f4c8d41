"""Why a request stopped: one typed value instead of dict literals.

`FinishReason` is what the scheduler puts on a `TokenOutput` and what a
result accumulator keeps. On the wire (a `/generate` result's
``meta_info["finish_reason"]``, the Engine's result dicts) it is written by
`FinishReason.to_dict` in SGLang's shape:

* ``{"type": "stop", "matched": <str | int>}`` (a stop string, or a stop/EOS token id)
* ``{"type": "length", "length": <int>}``
* ``{"type": "abort", "message": <str>}``, plus ``"status_code"`` when one is set

It is a frozen dataclass of plain fields, so it pickles (the server's ZMQ
sockets send pickled messages) and compares by value.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Union

STOP = "stop"
LENGTH = "length"
ABORT = "abort"


@dataclass(frozen=True)
class FinishReason:
    """A finished request's reason. Build one with `stop`, `length` or `abort`."""

    type: str  # STOP | LENGTH | ABORT
    matched: Union[str, int, None] = None  # stop: the stop string or token id that matched
    num_tokens: Optional[int] = None  # length: the output length at which it stopped (wire key "length")
    message: Optional[str] = None  # abort: why
    status_code: Optional[int] = None  # abort: the HTTP status the error maps to, if any

    # ------------------------------------------------------------------ constructors
    @classmethod
    def stop(cls, matched: Union[str, int]) -> "FinishReason":
        return cls(STOP, matched=matched)

    @classmethod
    def length(cls, n: int) -> "FinishReason":
        return cls(LENGTH, num_tokens=n)

    @classmethod
    def abort(cls, message: str, status_code: Optional[int] = None) -> "FinishReason":
        return cls(ABORT, message=message, status_code=status_code)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "FinishReason":
        """The inverse of `to_dict` (accepts the SGLang wire shape)."""
        kind = d.get("type")
        if kind == STOP:
            return cls(STOP, matched=d.get("matched"))
        if kind == LENGTH:
            return cls(LENGTH, num_tokens=d.get("length"))
        if kind == ABORT:
            return cls.abort(d.get("message", ""), d.get("status_code"))
        raise ValueError(f"unknown finish reason type {kind!r}")

    @classmethod
    def coerce(cls, value: Union["FinishReason", dict, None]) -> Optional["FinishReason"]:
        """None, a FinishReason, or its wire dict -> None or a FinishReason."""
        if value is None or isinstance(value, FinishReason):
            return value
        if isinstance(value, dict):
            return cls.from_dict(value)
        raise TypeError(f"a finish reason must be a FinishReason or a dict, not {type(value).__name__}")

    # ------------------------------------------------------------------ reading
    @property
    def is_abort(self) -> bool:
        return self.type == ABORT

    def to_dict(self) -> dict[str, Any]:
        """SGLang's wire shape (see the module docstring); a new dict each call."""
        if self.type == STOP:
            return {"type": STOP, "matched": self.matched}
        if self.type == LENGTH:
            return {"type": LENGTH, "length": self.num_tokens}
        d: dict[str, Any] = {"type": self.type, "message": self.message}
        if self.status_code is not None:
            d["status_code"] = self.status_code
        return d

    def get(self, key: str, default: Any = None) -> Any:
        """Read a field of the wire dict by name (``fr.get("type")``), for code
        that still reads finish reasons as dicts."""
        return self.to_dict().get(key, default)
