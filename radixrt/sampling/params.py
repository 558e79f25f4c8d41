"""Sampling parameters of one request, with SGLang's names and defaults.

``SamplingParams.from_dict`` is the entry point for untrusted input (the
``sampling_params`` object of a ``/generate`` request, the Engine's keyword
arguments): it rejects unknown keys and wrong types with a ``ValueError`` that
names the field, and range-checks the values (``validate``).

Type rules (shared by the constructor and ``from_dict``):

* int fields accept ints (numpy ints included), never bools or floats;
* float fields accept ints and floats, never bools or strings;
* bool fields accept bools only;
* ``stop`` accepts a string or a list/tuple of strings and is stored as a list
  (``None`` becomes ``[]``; at most ``MAX_STOP_STRINGS`` of at most
  ``MAX_STOP_STRING_CHARS`` characters: every token is checked against them);
  so does ``stop_regex`` (its patterns must compile, see
  `radixrt.sampling.stop_regex`);
* ``stop_token_ids`` accepts a list/tuple of ints or ``None`` (stored as a list
  or ``None``; at most ``MAX_STOP_TOKEN_IDS``);
* ``logit_bias`` maps token ids (strings like ``"42"`` as in JSON, or ints) to
  floats; keys are stored as canonical decimal strings.

Number rules (``validate``): every float (temperature, top_p, min_p, the
penalties, the logit_bias values) must be finite and within float32's range
(|x| <= 3.4e38), as sampling runs in float32: NaN, infinities and values that
overflow float32 (1e300, say) are refused with a ValueError, never turned into
a distribution of NaNs. On top of that:

* ``logit_bias`` values are clamped to [-100, 100] (OpenAI's documented range,
  where -100 bans a token and 100 makes it all but certain; vLLM clamps the
  same way), so that no bias, once divided by a small temperature, overflows;
* ``repetition_penalty`` is in [0.01, 100] (1 is off);
* ``top_p`` is in (0, 1] and at least 1.2e-38 (a smaller one rounds to 0 in
  float32); ``top_k=1`` is the way to keep only the most likely token.

In ``from_dict`` a value of ``None`` means "use the default", as SGLang's
frontend sends keys such as ``"regex": None`` explicitly.

This module imports no torch.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass
from typing import Any, Optional, Union

from radixrt.sampling.param_types import (
    FLOAT32_MAX,
    LOGIT_BIAS_LIMIT,
    as_bool,
    as_float,
    as_int,
    as_str_list,
    clamp_bias,
    f32_ok,
    type_name,
)
from radixrt.sampling.stop_regex import check_patterns as check_stop_regex
from radixrt.sampling.token_filters import check_token_filters, read_allowed, read_bad_words

_INT_FIELDS = ("max_new_tokens", "min_new_tokens", "top_k", "n", "beam_width")
_FLOAT_FIELDS = (
    "temperature",
    "top_p",
    "min_p",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
    "length_penalty",
)
_BOOL_FIELDS = ("ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim", "speculative")
_CONSTRAINT_FIELDS = ("regex", "json_schema", "ebnf", "structural_tag")

# Keys that SGLang's server or frontend may send but radixrt does not implement.
# They are accepted while unset (None), so that SGLang's own client works
# unchanged, and rejected with a clear message otherwise.
_UNSUPPORTED_KEYS = ("custom_params",)
# SGLang spellings of our fields.
_ALIASES = {"sampling_seed": "seed"}

# what a request may ask of a KV budget (radixrt/memory/kv_budget.py holds the same two; a test checks)
KV_BUDGET_POLICIES = ("h2o", "infinigen", "window")
MIN_KV_BUDGET = 32
MAX_BEAM_WIDTH = 64  # a beam request runs this many rows every step at most
# Stop conditions are checked on every token (the scheduler and the detokenizer): bounded per request
MAX_STOP_STRINGS = 64
MAX_STREAM_INTERVAL = 1 << 20
MAX_STOP_STRING_CHARS = 512
MAX_STOP_TOKEN_IDS = 4096
MAX_LENGTH_PENALTY = 10.0  # |length_penalty| of a beam search (transformers' users pick 0.5 to 2)
EARLY_STOPPING = (True, False, "never")  # transformers' values
_GREEDY_TEMPERATURE = 1e-6
FLOAT32_TINY = 1.1754943508222875e-38  # the smallest normal float32
REPETITION_PENALTY_RANGE = (0.01, 100.0)


@dataclass
class SamplingParams:
    max_new_tokens: int = 128
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: off
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: Union[str, list[str], None] = None  # stored as a list
    stop_regex: Union[str, list[str], None] = None  # stored as a list
    stop_token_ids: Optional[list[int]] = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    n: int = 1
    seed: Optional[int] = None
    regex: Optional[str] = None
    json_schema: Optional[str] = None
    ebnf: Optional[str] = None
    structural_tag: Optional[str] = None  # xgrammar structural tag, JSON text (SGLang's field)
    logit_bias: Optional[dict[str, float]] = None
    speculative: bool = True  # False: this request never gets speculative drafts (when the server makes them)
    # the KV this request attends at most (radixrt/memory/kv_budget.py): tokens (>= 32) or a fraction in (0, 1)
    # of its prompt plus max_new_tokens; None: the server's --kv-budget (off unless set)
    kv_budget: Optional[float] = None
    kv_budget_policy: Optional[str] = None  # h2o, infinigen or window; None: the server's --kv-budget-policy
    # beam search (radixrt/scheduler/beam.py) when > 1: this many live hypotheses, scored by their
    # log-probability over (generated length ** length_penalty); ``n`` of them are returned, best first.
    # early_stopping as in transformers: True, False (its heuristic) or "never"
    beam_width: int = 0
    length_penalty: float = 1.0
    early_stopping: Union[bool, str] = False
    # SGLang's: partial results reach the front every this many tokens (the first at once, the last at
    # the finish); None: the server's --stream-interval
    stream_interval: Optional[int] = None
    # tokens it may not sample (radixrt/sampling/token_filters.py): only these (vLLM's); and sequences
    # of ids the output must not contain (transformers' bad_words_ids; vLLM's bad_words, tokenized)
    allowed_token_ids: Optional[list[int]] = None
    bad_words_ids: Optional[list[list[int]]] = None

    def __post_init__(self) -> None:
        """Check types and normalize containers (no range checks: see ``validate``)."""
        for name in _INT_FIELDS:
            setattr(self, name, as_int(name, getattr(self, name)))
        for name in _FLOAT_FIELDS:
            setattr(self, name, as_float(name, getattr(self, name)))
        for name in _BOOL_FIELDS:
            as_bool(name, getattr(self, name))
        if self.seed is not None:
            self.seed = as_int("seed", self.seed)
        if self.stream_interval is not None:
            self.stream_interval = as_int("stream_interval", self.stream_interval)
        self.allowed_token_ids = read_allowed(self.allowed_token_ids)
        self.bad_words_ids = read_bad_words(self.bad_words_ids)
        if self.kv_budget is not None:
            self.kv_budget = as_float("kv_budget", self.kv_budget)
        if self.kv_budget_policy is not None and not isinstance(self.kv_budget_policy, str):
            raise ValueError(
                f"sampling parameter 'kv_budget_policy' must be a string, got {type_name(self.kv_budget_policy)}"
            )
        if self.early_stopping not in EARLY_STOPPING or not isinstance(self.early_stopping, (bool, str)):
            raise ValueError(
                f"sampling parameter 'early_stopping' must be true, false or \"never\", got {self.early_stopping!r}"
            )
        for name in _CONSTRAINT_FIELDS:
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise ValueError(f"sampling parameter '{name}' must be a string, got {type_name(value)}")
            if value == "":  # as SGLang: an empty constraint is no constraint, not "generate nothing"
                setattr(self, name, None)

        self._normalize_stops()

        if self.logit_bias is not None:
            bias = self.logit_bias
            if not isinstance(bias, dict):
                raise ValueError(
                    f"sampling parameter 'logit_bias' must be an object mapping token ids to numbers, "
                    f"got {type_name(bias)}"
                )
            out: dict[str, float] = {}
            for key, value in bias.items():
                if isinstance(key, bool):
                    raise ValueError(f"sampling parameter 'logit_bias' has a non-token-id key {key!r}")
                if isinstance(key, numbers.Integral):
                    tok = int(key)
                elif isinstance(key, str) and key.strip().isascii() and key.strip().isdigit():  # not "5_0", "+5", "٥"
                    tok = int(key)
                else:
                    raise ValueError(f"sampling parameter 'logit_bias' keys must be token ids, got {key!r}")
                out[str(tok)] = clamp_bias(as_float("logit_bias", value))
            self.logit_bias = out

    # ------------------------------------------------------------------ API

    @classmethod
    def from_dict(cls, d: Optional[dict[str, Any]]) -> "SamplingParams":
        """Build from a JSON-like dict; type- and range-checks everything.

        Raises ValueError naming the offending field. Does not check token ids
        against a vocabulary (call ``validate(vocab_size)`` for that).
        """
        if d is None:
            d = {}
        if not isinstance(d, dict):
            raise ValueError(f"sampling_params must be an object, got {type_name(d)}")
        kwargs: dict[str, Any] = {}
        for key, value in d.items():
            if key in _UNSUPPORTED_KEYS:
                if value is None:
                    continue
                raise ValueError(f"sampling parameter '{key}' is not supported by radixrt")
            name = _ALIASES.get(key, key)
            if name not in _FIELD_NAMES:
                raise ValueError(f"unknown sampling parameter {key!r}; valid: {', '.join(sorted(_FIELD_NAMES))}")
            if name in kwargs and kwargs[name] is not None and value is not None:
                raise ValueError(f"sampling parameter '{name}' given twice (as {key!r} and another spelling)")
            if value is None:
                continue  # use the default
            kwargs[name] = value
        params = cls(**kwargs)
        params.validate()
        return params

    def validate(self, vocab_size: Optional[int] = None) -> None:
        """Range checks; raise ValueError naming the field. Token ids are checked
        against ``vocab_size`` when given."""

        def bad(name: str, why: str) -> None:
            raise ValueError(f"sampling parameter '{name}' {why}, got {getattr(self, name)!r}")

        # `not (a <= x)` style comparisons also reject NaN.
        for name in _FLOAT_FIELDS:
            if not f32_ok(getattr(self, name)):
                bad(name, "must be a finite number within float32's range (|x| <= 3.4e38)")
        if self.max_new_tokens < 0:
            bad("max_new_tokens", "must be >= 0")
        if self.stream_interval is not None and not 1 <= self.stream_interval <= MAX_STREAM_INTERVAL:
            bad("stream_interval", f"must be from 1 to {MAX_STREAM_INTERVAL}")
        if self.min_new_tokens < 0:
            bad("min_new_tokens", "must be >= 0")
        if self.min_new_tokens > self.max_new_tokens:
            raise ValueError(
                f"sampling parameter 'min_new_tokens' must be <= max_new_tokens ({self.max_new_tokens}), "
                f"got {self.min_new_tokens}"
            )
        if not (0.0 <= self.temperature < math.inf):
            bad("temperature", "must be >= 0 and finite")
        if not (0.0 < self.top_p <= 1.0):
            bad("top_p", "must be in (0, 1]")
        if self.top_p < FLOAT32_TINY:
            bad("top_p", "is too small for float32 (at least 1.2e-38; top_k=1 keeps only the most likely token)")
        if self.top_k == 0 or self.top_k < -1:
            bad("top_k", "must be -1 (off) or >= 1")
        if not (0.0 <= self.min_p <= 1.0):
            bad("min_p", "must be in [0, 1]")
        lo, hi = REPETITION_PENALTY_RANGE
        if not (lo <= self.repetition_penalty <= hi):
            bad("repetition_penalty", f"must be in [{lo:g}, {hi:g}] (1 is off)")
        if not (-2.0 <= self.frequency_penalty <= 2.0):
            bad("frequency_penalty", "must be in [-2, 2]")
        if not (-2.0 <= self.presence_penalty <= 2.0):
            bad("presence_penalty", "must be in [-2, 2]")
        if self.n < 1:
            bad("n", "must be >= 1")
        if self.seed is not None and not (-(2**63) <= self.seed < 2**64):
            bad("seed", "must fit in 64 bits")
        self._validate_stops(vocab_size)
        check_token_filters(self.allowed_token_ids, self.bad_words_ids, vocab_size)
        if self.logit_bias:
            for key, value in self.logit_bias.items():
                t = int(key)
                if t < 0 or (vocab_size is not None and t >= vocab_size):
                    raise ValueError(
                        f"sampling parameter 'logit_bias' has token id {t}, outside the vocabulary"
                        + (f" [0, {vocab_size})" if vocab_size is not None else "")
                    )
                if not f32_ok(value):
                    raise ValueError(
                        f"sampling parameter 'logit_bias' has {value!r} for token id {t}: values must be finite "
                        f"numbers within float32's range (|x| <= 3.4e38); they are clamped to "
                        f"[-{LOGIT_BIAS_LIMIT:g}, {LOGIT_BIAS_LIMIT:g}]"
                    )
        if self.kv_budget is not None and not (
            0.0 < self.kv_budget < 1.0 or MIN_KV_BUDGET <= self.kv_budget <= FLOAT32_MAX
        ):
            bad("kv_budget", f"must be a fraction in (0, 1) or at least {MIN_KV_BUDGET} tokens")
        if self.kv_budget_policy is not None and self.kv_budget_policy not in KV_BUDGET_POLICIES:
            bad("kv_budget_policy", f"must be one of {', '.join(KV_BUDGET_POLICIES)}")
        self._validate_beam_search()
        set_constraints = [name for name in _CONSTRAINT_FIELDS if getattr(self, name) is not None]
        if len(set_constraints) > 1:
            raise ValueError(
                f"sampling parameters {', '.join(repr(n) for n in set_constraints)} are exclusive: "
                "set at most one of regex, json_schema, ebnf, structural_tag"
            )

    def _normalize_stops(self) -> None:
        """``stop`` and ``stop_regex`` as lists of strings, ``stop_token_ids`` as a list of ints
        (or None), each within its count limit."""
        stop = self.stop
        if stop is None:
            stop = []
        elif isinstance(stop, str):
            stop = [stop]
        elif isinstance(stop, (list, tuple)):
            stop = list(stop)
            if len(stop) > MAX_STOP_STRINGS:
                raise ValueError(f"sampling parameter 'stop' holds {len(stop)} strings; at most {MAX_STOP_STRINGS}")
            for s in stop:
                if not isinstance(s, str):
                    raise ValueError(
                        f"sampling parameter 'stop' must be a string or a list of strings, "
                        f"got an element of type {type_name(s)}"
                    )
        else:
            raise ValueError(f"sampling parameter 'stop' must be a string or a list of strings, got {type_name(stop)}")
        self.stop = stop
        self.stop_regex = as_str_list("stop_regex", self.stop_regex)

        if self.stop_token_ids is not None:
            ids = self.stop_token_ids
            if isinstance(ids, (str, bytes)) or not isinstance(ids, (list, tuple)):
                raise ValueError(
                    f"sampling parameter 'stop_token_ids' must be a list of integers, got {type_name(ids)}"
                )
            if len(ids) > MAX_STOP_TOKEN_IDS:
                raise ValueError(
                    f"sampling parameter 'stop_token_ids' holds {len(ids)} ids; at most {MAX_STOP_TOKEN_IDS}"
                )
            self.stop_token_ids = [as_int("stop_token_ids", t) for t in ids]

    def _validate_stops(self, vocab_size: Optional[int]) -> None:
        """The stop strings' lengths, the stop patterns, and the stop token ids' sign."""
        for s in self.stop:
            if not s:
                raise ValueError("sampling parameter 'stop' must not contain an empty string")
            if len(s) > MAX_STOP_STRING_CHARS:
                raise ValueError(
                    f"sampling parameter 'stop' holds a string of {len(s)} characters; at most {MAX_STOP_STRING_CHARS}"
                )
        if self.stop_regex:
            check_stop_regex(self.stop_regex)
        if self.stop_token_ids:  # an id past the vocabulary is never sampled: accepted, as SGLang does
            for t in self.stop_token_ids:
                if t < 0:
                    raise ValueError(f"sampling parameter 'stop_token_ids' holds {t}; token ids are >= 0")

    def _validate_beam_search(self) -> None:
        """What a beam search cannot combine with: its hypotheses are scored by the
        model's log-probabilities, so nothing may reshape those; ``n`` of its
        ``beam_width`` hypotheses are returned."""
        if not 0 <= self.beam_width <= MAX_BEAM_WIDTH:
            raise ValueError(
                f"sampling parameter 'beam_width' must be in [0, {MAX_BEAM_WIDTH}] (0 or 1: no beam search), "
                f"got {self.beam_width}"
            )
        if self.beam_width == 0:  # vLLM refused them without a search too: they would be silently ignored
            for name, off in (("length_penalty", 1.0), ("early_stopping", False)):
                if getattr(self, name) != off:
                    raise ValueError(
                        f"sampling parameter '{name}' applies only to beam search; set beam_width "
                        f"(or use_beam_search) or leave it out, got {getattr(self, name)!r}"
                    )
        if not self.uses_beam_search:
            return
        if self.n > self.beam_width:
            raise ValueError(f"sampling parameter 'n' ({self.n}) must be <= beam_width ({self.beam_width})")
        if not abs(self.length_penalty) <= MAX_LENGTH_PENALTY:  # length ** penalty stays a finite, nonzero float
            raise ValueError(
                f"sampling parameter 'length_penalty' must be in [-{MAX_LENGTH_PENALTY}, {MAX_LENGTH_PENALTY}] "
                f"with beam search, got {self.length_penalty}"
            )
        if self.max_new_tokens < 1:
            raise ValueError("beam search needs max_new_tokens >= 1 (a search of no tokens has nothing to rank)")
        reshaping = [
            name
            for name, off in (
                ("frequency_penalty", 0.0),
                ("presence_penalty", 0.0),
                ("repetition_penalty", 1.0),
                ("logit_bias", None),
                ("kv_budget", None),
            )
            if getattr(self, name) not in (off, {})
        ]
        if reshaping:
            raise ValueError(f"beam search does not combine with sampling parameter(s) {', '.join(reshaping)}")

    @property
    def uses_beam_search(self) -> bool:
        return self.beam_width > 1

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _GREEDY_TEMPERATURE or self.top_k == 1

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict of every field (containers copied); ``from_dict``
        of it gives an equal object."""
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d["stop"] = list(self.stop)
        d["stop_regex"] = list(self.stop_regex)
        if self.stop_token_ids is not None:
            d["stop_token_ids"] = list(self.stop_token_ids)
        if self.logit_bias is not None:
            d["logit_bias"] = dict(self.logit_bias)
        if self.allowed_token_ids is not None:
            d["allowed_token_ids"] = list(self.allowed_token_ids)
        if self.bad_words_ids is not None:
            d["bad_words_ids"] = [list(seq) for seq in self.bad_words_ids]
        return d


_FIELD_NAMES = frozenset(f.name for f in dataclasses.fields(SamplingParams))
