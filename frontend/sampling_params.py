"""Sampling parameters of the frontend's generation calls (``gen`` and friends).

:class:`SglSamplingParams` is the frontend's own record, named as in SGLang; the
runtime's request-side class is ``radixrt.sampling.params.SamplingParams``. A
field left ``None`` means "not set here", so that a ``gen``'s values can be
layered over the program-level defaults (:func:`default_sampling_params`);
``to_wire()`` turns the merged record into SGLang's ``sampling_params`` keys.
"""

from __future__ import annotations

import dataclasses
import json
import re
import warnings
from dataclasses import dataclass
from typing import Any, Optional, Union

# Constraints used for ``dtype=int`` / ``gen_int``, ``float``, ``str`` / ``gen_string`` and
# ``bool``: SGLang's (a number may be followed by spaces and newlines, where the stops
# `NUMBER_STOPS` end it), with bounded repetition, so that a constrained decoder cannot run
# away with digits or characters.
REGEX_INT = r"[-+]?[0-9]{1,18}[ \n]*"
REGEX_STR = r"\"[\w\d\s]{0,256}\""
REGEX_FLOAT = r"[-+]?[0-9]{0,18}\.?[0-9]{1,18}[ \n]*"
REGEX_BOOL = r"(True|False)"
# what ends an int or float generation (SGLang adds them to the gen's stop strings)
NUMBER_STOPS = (" ", "\n")


# gen(dtype=...): the constraint each type asks for (SGLang's names and regexes)
_DTYPE_REGEX: dict[Any, str] = {
    **dict.fromkeys((int, "int"), REGEX_INT),
    **dict.fromkeys((float, "float"), REGEX_FLOAT),
    **dict.fromkeys((str, "str", "string"), REGEX_STR),
    **dict.fromkeys((bool, "bool"), REGEX_BOOL),
}


@dataclass
class SglSamplingParams:
    """Sampling parameters of one generation call.

    Field names follow the frontend (``max_new_tokens`` etc.); ``to_wire()``
    gives SGLang's ``sampling_params`` keys. ``None`` means "not set here"
    so that call-level values can be layered over program defaults.
    """

    max_new_tokens: Optional[int] = None
    min_new_tokens: Optional[int] = None
    n: Optional[int] = None
    stop: Optional[Union[str, list[str]]] = None
    stop_token_ids: Optional[list[int]] = None
    stop_regex: Optional[Union[str, list[str]]] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    frequency_penalty: Optional[float] = None
    presence_penalty: Optional[float] = None
    repetition_penalty: Optional[float] = None
    ignore_eos: Optional[bool] = None
    seed: Optional[int] = None
    return_logprob: Optional[bool] = None
    logprob_start_len: Optional[int] = None
    top_logprobs_num: Optional[int] = None
    return_text_in_logprobs: Optional[bool] = None
    dtype: Optional[Any] = None
    regex: Optional[str] = None
    json_schema: Optional[Union[str, dict]] = None
    ebnf: Optional[str] = None
    # beam search (radixrt's runtime): beam_width > 1 keeps that many hypotheses; n of them come back
    beam_width: Optional[int] = None
    length_penalty: Optional[float] = None
    early_stopping: Optional[Union[bool, str]] = None
    # the LoRA adapter (a radixrt or SGLang server's lora_path; None: the base model)
    lora: Optional[str] = None

    def merged_over(self, defaults: "SglSamplingParams") -> "SglSamplingParams":
        """A copy where every field unset here takes the value from ``defaults``."""
        vals = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            vals[f.name] = getattr(defaults, f.name) if v is None else v
        return SglSamplingParams(**vals)

    # --- what goes on the wire --------------------------------------------
    def effective_regex(self) -> Optional[str]:
        """The regex the request is constrained by: ``dtype``'s where one is set (as SGLang,
        which warns that a ``regex`` beside it is not used), else ``regex``."""
        dt = self.dtype
        regex = _DTYPE_REGEX.get(dt) if isinstance(dt, (type, str)) else None
        if regex is None:
            return self.regex
        if self.regex is not None:
            warnings.warn(
                f"gen has both dtype {dt!r} and a regex: the dtype's constraint is used (as SGLang)", stacklevel=2
            )
        return regex

    def to_wire(self) -> dict[str, Any]:
        """SGLang ``sampling_params`` (only the keys that are set)."""
        out: dict[str, Any] = {}
        simple = (
            "max_new_tokens",
            "min_new_tokens",
            "n",
            "stop_token_ids",
            "stop_regex",
            "temperature",
            "top_p",
            "top_k",
            "min_p",
            "frequency_penalty",
            "presence_penalty",
            "repetition_penalty",
            "ignore_eos",
            "seed",
            "ebnf",
            "beam_width",
            "length_penalty",
            "early_stopping",
        )
        for k in simple:
            v = getattr(self, k)
            if v is not None:
                out[k] = v
        stops = [] if self.stop is None else [self.stop] if isinstance(self.stop, str) else list(self.stop)
        if self.dtype in (int, "int", float, "float"):
            stops += [s for s in NUMBER_STOPS if s not in stops]
        if stops:
            out["stop"] = stops
        if self.n in (None, 1):
            out.pop("n", None)
        rx = self.effective_regex()
        if rx is not None:
            out["regex"] = rx
        if self.json_schema is not None:
            out["json_schema"] = self.json_schema if isinstance(self.json_schema, str) else json.dumps(self.json_schema)
        return out

    def logprob_kwargs(self) -> dict[str, Any]:
        """Top-level logprob options of a ``/generate`` request."""
        out: dict[str, Any] = {}
        if self.return_logprob:
            out["return_logprob"] = True
            if self.logprob_start_len is not None:
                out["logprob_start_len"] = self.logprob_start_len
            if self.top_logprobs_num:
                out["top_logprobs_num"] = self.top_logprobs_num
            if self.return_text_in_logprobs:
                out["return_text_in_logprobs"] = True
        return out


def default_sampling_params(**kwargs) -> SglSamplingParams:
    """Program-level defaults (what ``run()`` fills when a ``gen`` leaves a field unset)."""
    base = dict(
        max_new_tokens=128,
        min_new_tokens=0,
        n=1,
        stop=None,
        stop_token_ids=None,
        stop_regex=None,
        temperature=1.0,
        top_p=1.0,
        top_k=-1,
        min_p=0.0,
        frequency_penalty=0.0,
        presence_penalty=0.0,
        repetition_penalty=None,
        ignore_eos=False,
        seed=None,
        return_logprob=False,
        logprob_start_len=None,
        top_logprobs_num=None,
        return_text_in_logprobs=None,
        dtype=None,
        regex=None,
        json_schema=None,
        ebnf=None,
    )
    for k, v in kwargs.items():
        if k not in base:
            raise TypeError(f"unknown sampling parameter {k!r}")
        if v is not None:
            base[k] = v
    return SglSamplingParams(**base)


def is_valid_regex(pattern: str) -> None:
    """Raise ``ValueError`` naming ``pattern`` when it does not compile."""
    try:
        re.compile(pattern)
    except re.error as e:
        raise ValueError(f"invalid regex {pattern!r}: {e}") from e
