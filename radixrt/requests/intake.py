"""The one front door of generation requests.

Every way in (the in-process `Engine`, the server's native ``/generate`` and
OpenAI routes, and the scheduler itself) turns its input into requests here:

* `split_prompts`: text or input_ids, one prompt or a batch -> token id lists;
* `build_specs`: per-prompt sampling params and logprob flags (a single value
  or one per prompt) -> one `RequestSpec` per prompt;
* `validate_prompt` / `validate_spec`: the admission checks against `Limits` (prompt empty or too long for the
  context or the KV pool, alone or with max_new_tokens; ids outside the vocabulary, sampling params, ``n``,
  grammar syntax, ``logprob_start_len``, ``top_logprobs_num``, ``priority``, text fields without a tokenizer);
* request ids (`new_request_id`, `sample_rids`, `RidTable`, see below);
* `resolve_logprob`: whether a request returns logprobs.

Request ids. A request has two: its *internal id*, a random uuid4 hex made here (`new_request_id`),
the only id the scheduler and the detokenizer ever see; and its *rid*, the label its client knows:
the ``rid`` the client gave, or else a random one (a uuid4 hex too, so nobody can guess the next).
The rid is what ``meta_info.id`` shows and what ``abort_request`` takes. The front (the Engine, the
server's TokenizerManager) keeps a `RidTable` from rids to internal ids: a client's rid must not be
running already (as a request's rid, or as the rid ``<rid>-<i>`` of a sample of one), and an abort
matches rids exactly, never by prefix. The ``n > 1`` samples of a request have the ids ``<id>-<i>``
(`sample_rids`) in both spaces; in the scheduler each knows its request's internal id as its ``parent``.

Every problem is a `RequestError` (a ValueError naming the request field at fault): the Engine
raises it as is, the server answers it with a 400."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Callable, Optional, Sequence

from radixrt.requests.cache_fields import cache_info_mode, request_namespace
from radixrt.requests.errors import RequestError
from radixrt.requests.generation_defaults import fill_unset
from radixrt.requests.hidden_states import check_call_rows, check_hidden_states
from radixrt.requests.messages import GenerateReq
from radixrt.requests.no_tokenizer import check_token_only
from radixrt.requests.token_id_lists import bad_token_ids, check_logprob_fields, is_int, token_ids_each
from radixrt.sampling.grammar import check_grammar, grammar_key
from radixrt.sampling.grammar_bounds import GrammarLimits
from radixrt.sampling.params import MAX_BEAM_WIDTH, SamplingParams

# The defaults of EngineConfig.max_n, .max_request_sequences, .max_top_logprobs_num and .max_client_priority.
DEFAULT_MAX_N = 128
DEFAULT_MAX_REQUEST_SEQUENCES = 4096
DEFAULT_MAX_TOP_LOGPROBS_NUM = 20
DEFAULT_MAX_CLIENT_PRIORITY = 100
ADMIN_PRIORITY_RANGE = (-(2**63), 2**63 - 1)  # the priorities an admin-keyed request may give
_BOOLEAN = (lambda v: isinstance(v, bool), "a boolean")  # per_item's check of a flag, and its words


@dataclass(frozen=True)
class Limits:
    """What the runtime can hold, for validation."""

    context_length: int  # a prompt has at most context_length - 1 tokens
    kv_total_slots: int  # KV pool size in tokens
    vocab_size: int  # token ids are in [0, vocab_size)
    max_n: int = DEFAULT_MAX_N  # samples of one prompt (sampling param n)
    max_request_sequences: int = DEFAULT_MAX_REQUEST_SEQUENCES  # sequences of one call (`validate_call`)
    max_top_logprobs_num: int = DEFAULT_MAX_TOP_LOGPROBS_NUM  # top logprobs per position
    max_client_priority: int = DEFAULT_MAX_CLIENT_PRIORITY  # |priority| at most this
    return_hidden_states: bool = False  # requests may ask for their hidden states (hidden_states.py)
    hidden_size: int = 0  # the model's width: what one hidden-state row holds (0: unknown)
    grammar: GrammarLimits = GrammarLimits()  # what a request's grammar may cost
    text: bool = True  # the runtime has a tokenizer (False: skip_tokenizer_init, no_tokenizer.py)
    auto_truncate: bool = False  # SGLang's --allow-auto-truncate: cut what does not fit instead of a 400
    preferred_sampling: Optional[dict] = field(default=None, hash=False)  # --preferred-sampling-params, parsed


def resolve_logprob(return_logprob: Any, top_logprobs_num: int, token_ids_logprob: Sequence[int] = ()) -> bool:
    """A request returns logprobs when asked to, or when it asks for top logprobs or named tokens' ones."""
    return bool(return_logprob) or top_logprobs_num > 0 or bool(token_ids_logprob)


@dataclass
class RequestSpec:
    """One prompt of a request, tokenized and normalized, not yet validated.

    ``return_logprob`` is resolved on construction (`resolve_logprob`).
    ``field`` is the request field the prompt came from, named in errors."""

    input_ids: list[int]
    sampling: SamplingParams
    return_logprob: bool = False
    logprob_start_len: int = -1  # -1: no prompt logprobs
    top_logprobs_num: int = 0
    token_ids_logprob: tuple[int, ...] = ()  # SGLang's: tokens whose logprobs every scored position returns
    return_text_in_logprobs: bool = False
    namespace: Optional[str] = None  # the radix-cache namespace (`cache_namespace`); None: the shared one
    rid: Optional[str] = None  # None: assigned when queued
    field: str = "text"
    priority: Optional[int] = None  # honoured only under enable_priority_scheduling
    cache_info: str = ""  # meta_info.cache_info: "" none, "own" or "full" (see cache_info_mode)
    lora: Optional[str] = None  # the LoRA adapter's name (SGLang's lora_path); None: the base model
    group: Optional[str] = None  # the call it came in (set on submission: a batch's prompts share one)
    # Sent with the server's admin key (only its routes set it): ``priority`` may be any 64-bit integer
    admin: bool = False
    return_prompt_token_ids: bool = False  # SGLang's: each result (and stream event) has prompt_token_ids
    asks_max_new_tokens: bool = False  # given (`build_specs` sets it; a default stops at the context): must fit
    return_hidden_states: bool = False  # SGLang's: meta_info.hidden_states (radixrt/requests/hidden_states.py)
    log_metrics: bool = True  # SGLang's: False leaves it out of the request, token and latency metrics

    def __post_init__(self) -> None:
        self.return_logprob = resolve_logprob(self.return_logprob, self.top_logprobs_num, self.token_ids_logprob)

    def to_generate_req(self, rid: str, stream: bool = False) -> GenerateReq:
        """The scheduler message for this prompt under request id ``rid``."""
        return GenerateReq(
            rid=rid,
            input_ids=self.input_ids,
            sampling=self.sampling,
            return_logprob=self.return_logprob,
            logprob_start_len=self.logprob_start_len,
            top_logprobs_num=self.top_logprobs_num,
            stream=stream,
            token_ids_logprob=self.token_ids_logprob,
            namespace=self.namespace,
            priority=self.priority,
            cache_info=self.cache_info,
            lora=self.lora,
            group=self.group,
            return_hidden_states=self.return_hidden_states,
        )


# ---------------------------------------------------------------------- validation
def validate_prompt(
    input_ids: Sequence[int],
    sampling: SamplingParams,
    limits: Limits,
    field: str = "input_ids",
    parse_grammar: bool = True,
) -> None:
    """Raise RequestError unless ``input_ids`` with ``sampling`` can be served within ``limits``;
    the grammar is parsed (not compiled) unless not ``parse_grammar`` (its compile thread will)."""
    n = len(input_ids)
    if not n:
        raise RequestError("the prompt is empty: give a non-empty text or input_ids", field)
    if n >= limits.context_length:
        raise RequestError(
            f"the prompt has {n} tokens; this model's context length is {limits.context_length}, "
            f"so at most {limits.context_length - 1} prompt tokens fit",
            field,
        )
    if n + 1 > limits.kv_total_slots:
        held = f"the KV pool holds {limits.kv_total_slots}"
        raise RequestError(f"the prompt has {n} tokens and needs one more for its output; {held}", field)
    if sampling.n > limits.max_n:
        raise RequestError(
            f"sampling parameter 'n' is {sampling.n}; this server allows at most {limits.max_n} "
            f"samples per prompt (--max-n)",
            "sampling_params",
        )
    bad = bad_token_ids(input_ids, limits.vocab_size)
    if bad:
        raise RequestError(
            f"input_ids contains ids outside the vocabulary [0, {limits.vocab_size}): {bad[:5]}", "input_ids"
        )
    try:
        sampling.validate(limits.vocab_size)
    except ValueError as e:
        raise RequestError(str(e), "sampling_params") from None
    key = grammar_key(sampling) if parse_grammar else None
    try:
        check_grammar(key, limits.grammar)
    except ValueError as e:
        raise RequestError(str(e), key[0] if key else "sampling_params") from None


def sequences_of(sampling: SamplingParams) -> int:
    """The sequences one prompt starts: its samples, or its beams when more."""
    return max(sampling.n, sampling.beam_width or 1)


def _plural(count: int, noun: str) -> str:
    return f"{count} {noun}" + ("" if count == 1 else "s")


def sequences_each(sampling_params: Any) -> int:
    """The sequences each prompt starts when a call gives one ``sampling_params`` object for
    all its prompts (its n, or beam width when larger); 1 when it gives a list, or values
    validation will refuse."""
    if not isinstance(sampling_params, dict):
        return 1
    width: Any = sampling_params.get("beam_width")  # one out of its range is refused by its own check
    values: list[Any] = [sampling_params.get("n"), width if is_int(width) and 0 <= width <= MAX_BEAM_WIDTH else 1]
    return max([1] + [int(v) for v in values if is_int(v)])


def check_prompt_count(count: int, limits: Limits, field: str, each: int = 1) -> None:
    """RequestError unless a call of ``count`` prompts, each starting ``each`` sequences
    (at least one), may start: checked before they are tokenized."""
    if count * each > limits.max_request_sequences:
        times = f" of {_plural(each, 'sequence')} each" if each > 1 else ""
        raise RequestError(
            f"'{field}' holds {_plural(count, 'prompt')}{times}; this server starts at most "
            f"{_plural(limits.max_request_sequences, 'sequence')} per call (--max-request-sequences)",
            field,
        )


def validate_call(specs: Sequence[RequestSpec], limits: Limits) -> None:
    """The call's size (its prompts' sequences together), then `validate_spec` of each prompt."""
    total = sum(sequences_of(spec.sampling) for spec in specs)
    if total > limits.max_request_sequences:
        beams = any(spec.sampling.beam_width > spec.sampling.n for spec in specs)
        raise RequestError(
            f"this call starts {total} sequences ({_plural(len(specs), 'prompt')}, each with its "
            f"{'beam width' if beams else 'n'}); this server starts at most "
            f"{_plural(limits.max_request_sequences, 'sequence')} per call (--max-request-sequences)",
            "beam_width" if beams else "n",
        )
    for spec in specs:
        validate_spec(spec, limits)
    rows = sum((len(s.input_ids) + s.sampling.max_new_tokens) * s.sampling.n for s in specs if s.return_hidden_states)
    check_call_rows(rows, limits.hidden_size)


def validate_spec(spec: RequestSpec, limits: Limits) -> None:
    """`check_token_only` without a tokenizer, `validate_prompt`, then the logprob fields and the priority's range."""
    if not limits.text:
        check_token_only(spec.sampling, spec.return_text_in_logprobs)
    if limits.auto_truncate:  # as SGLang: the prompt's first tokens, one short of what the context (and pool) hold
        spec.input_ids = spec.input_ids[: min(limits.context_length, limits.kv_total_slots) - 1]
    validate_prompt(spec.input_ids, spec.sampling, limits, spec.field)
    n, wanted = len(spec.input_ids), spec.sampling.max_new_tokens
    room, holds = limits.context_length, f"this model's context length of {limits.context_length}"
    if spec.sampling.kv_budget is None and limits.kv_total_slots < room:  # the whole sequence's KV must fit
        room, holds = limits.kv_total_slots, f"the KV pool's {limits.kv_total_slots} tokens (--max-total-tokens)"
    if n + wanted > room and (limits.auto_truncate or not spec.asks_max_new_tokens):  # capped, as SGLang does
        spec.sampling = replace(spec.sampling, max_new_tokens=room - n)
    elif n + wanted > room:  # as SGLang, vLLM and OpenAI for the context
        raise RequestError(
            f"the prompt's {n} tokens and max_new_tokens {wanted} make {n + wanted}, more than {holds}: "
            f"ask for at most {room - n} new tokens",
            "max_new_tokens",
        )
    if spec.return_logprob and spec.logprob_start_len > len(spec.input_ids):  # (equal: no prompt logprobs, as SGLang)
        raise RequestError(
            f"logprob_start_len {spec.logprob_start_len} is beyond the prompt length {len(spec.input_ids)}",
            "logprob_start_len",
        )
    prompt_logprobs = spec.return_logprob and 0 <= spec.logprob_start_len < len(spec.input_ids)
    top, ids = spec.top_logprobs_num, spec.token_ids_logprob
    check_logprob_fields(top, ids, limits.max_top_logprobs_num, limits.vocab_size, spec.sampling, prompt_logprobs)
    _check_priority(spec, limits)
    check_hidden_states(spec.return_hidden_states, limits.return_hidden_states, spec.sampling.beam_width)


def _check_priority(spec: RequestSpec, limits: Limits) -> None:
    """A priority within ``[-max_client_priority, max_client_priority]``, or any 64-bit integer for an admin."""
    p, (low, high), cap = spec.priority, ADMIN_PRIORITY_RANGE, limits.max_client_priority
    if p is None or (spec.admin and low <= p <= high):
        return
    if spec.admin:
        raise RequestError(f"'priority' is {p}; it must be a 64-bit integer (from {low} to {high})", "priority")
    if not -cap <= p <= cap:
        raise RequestError(
            f"'priority' is {p}; this server accepts priorities from {-cap} to {cap} (--max-client-priority); "
            f"a request presenting the server's admin key (--admin-api-key) may give any 64-bit integer",
            "priority",
        )


# ---------------------------------------------------------------------- normalization
@dataclass
class PromptBatch:
    """The prompts of one request, tokenized."""

    ids: list[list[int]]
    texts: list[Optional[str]]  # the prompt text, where it was given as text
    batch: bool  # given as a list of prompts (answered with a list)
    field: str  # the request field they came from


def split_prompts(
    text: Any,
    input_ids: Any,
    encode: Callable[[str], list[int]],
    *,
    text_name: str = "text",
    ids_name: str = "input_ids",
    allow_empty_batch: bool = False,
    limits: Optional[Limits] = None,
    each: int = 1,
) -> PromptBatch:
    """Exactly one of ``text`` (a string or a list of strings) and
    ``input_ids`` (a list of ints, or a list of such lists) -> a PromptBatch.

    An empty text, or ``input_ids=[]``, is one empty prompt (refused by
    validation). An empty list of texts is refused unless ``allow_empty_batch``.
    With ``limits``, more prompts than a call may start (each starting ``each``
    sequences, when the call gives one n or beam width for all) is refused before
    any is tokenized (`check_prompt_count`)."""
    if (text is None) == (input_ids is None):
        raise RequestError(f"Give exactly one of '{text_name}' or '{ids_name}'.", text_name)
    if text is not None:
        if isinstance(text, str):
            texts = [text]
        elif isinstance(text, (list, tuple)) and (text or allow_empty_batch) and all(isinstance(t, str) for t in text):
            texts = list(text)
        else:
            raise RequestError(f"'{text_name}' must be a string or a non-empty list of strings.", text_name)
        if limits is not None:
            check_prompt_count(len(texts), limits, text_name, each)
        ids = [list(encode(t)) if t else [] for t in texts]
        return PromptBatch(ids, list(texts), not isinstance(text, str), text_name)
    if isinstance(input_ids, (list, tuple)) and all(is_int(t) for t in input_ids):
        return PromptBatch([[int(t) for t in input_ids]], [None], False, ids_name)  # [] is one empty prompt
    if (
        isinstance(input_ids, (list, tuple))
        and input_ids
        and all(isinstance(x, (list, tuple)) and all(is_int(t) for t in x) for x in input_ids)
    ):
        if limits is not None:
            check_prompt_count(len(input_ids), limits, ids_name, each)
        return PromptBatch([[int(t) for t in x] for x in input_ids], [None] * len(input_ids), True, ids_name)
    raise RequestError(
        f"'{ids_name}' must be a list of integers (token ids; true and false are not) or a non-empty "
        f"list of such lists.",
        ids_name,
    )


def per_item(
    name: str, value: Any, prompts: PromptBatch, default: Any, check: Callable[[Any], bool], what: str
) -> list[Any]:
    """``value`` for each prompt: a list gives one value per prompt (for a
    batch, or for ``sampling_params`` of a single prompt, a one-item list),
    anything else is shared. None (or a None entry) means ``default``. Every
    value must pass ``check`` ("'{name}' must be {what}")."""
    n = len(prompts.ids)
    if value is None:
        return [default] * n
    if isinstance(value, list) and (prompts.batch or name == "sampling_params" and len(value) == 1):
        if len(value) != n:
            raise RequestError(f"'{name}' has {len(value)} entries for {n} prompts.", name)
        values = [default if v is None else v for v in value]
    else:
        values = [value] * n
    for v in values:
        if not check(v):
            raise RequestError(f"'{name}' must be {what}, got {v!r}.", name)
    return values


def to_sampling_params(value: Any, defaults: Optional[dict] = None) -> SamplingParams:
    """A SamplingParams as is, or one from its dict and ``defaults`` (`fill_unset`); errors name 'sampling_params'."""
    if isinstance(value, SamplingParams):
        return value
    try:
        return SamplingParams.from_dict(fill_unset(value, defaults))
    except ValueError as e:
        raise RequestError(str(e), "sampling_params") from None


def _asks_max_new_tokens(sampling: Any) -> bool:
    """Whether a request's sampling parameters set max_new_tokens (a SamplingParams object always does)."""
    return not isinstance(sampling, dict) or sampling.get("max_new_tokens") is not None


def _check_rids(rids: list[Any], prompts: PromptBatch, rid: Any) -> None:
    if not prompts.batch and isinstance(rid, list):
        raise RequestError("'rid' must be a string for a single prompt.", "rid")
    given = [r for r in rids if r]
    if prompts.batch and len(set(given)) != len(given):
        raise RequestError("'rid' values must be unique.", "rid")


def build_specs(
    prompts: PromptBatch,
    *,
    sampling_params: Any = None,
    return_logprob: Any = None,
    logprob_start_len: Any = None,
    top_logprobs_num: Any = None,
    token_ids_logprob: Any = None,
    rid: Any = None,
    return_text_in_logprobs: Any = False,
    cache_salt: Any = None,
    priority: Any = None,
    return_cache_info: Any = False,
    prompt_cache_key: Any = None,
    admin: bool = False,
    lora_path: Any = None,
    return_prompt_token_ids: Any = False,
    extra_key: Any = None,
    return_hidden_states: Any = False,
    sampling_defaults: Optional[dict] = None,
) -> list[RequestSpec]:
    """One RequestSpec per prompt. The per-prompt fields take a single value or one per prompt (`per_item`);
    ``sampling_params`` are dicts (``sampling_defaults`` fill what one leaves out) or SamplingParams. Types
    are checked; limits are not (`validate_spec`). ``admin``: the request presented the admin key."""
    sampling = per_item(
        "sampling_params",
        sampling_params,
        prompts,
        {},
        lambda v: isinstance(v, (dict, SamplingParams)),
        "an object (or a list of objects)",
    )
    flags = per_item("return_logprob", return_logprob, prompts, False, *_BOOLEAN)
    hidden = per_item("return_hidden_states", return_hidden_states, prompts, False, *_BOOLEAN)
    starts = per_item("logprob_start_len", logprob_start_len, prompts, -1, is_int, "an integer")
    tops = per_item("top_logprobs_num", top_logprobs_num, prompts, 0, lambda v: is_int(v) and v >= 0, "an integer >= 0")
    token_ids = token_ids_each(token_ids_logprob, len(prompts.ids), prompts.batch)
    if prompts.batch and isinstance(rid, str) and rid and len(prompts.ids) > 1:
        rid = [f"{rid}_{i}" for i in range(len(prompts.ids))]  # SGLang's names for a batch's prompts
    rids = per_item("rid", rid, prompts, None, lambda v: isinstance(v, str) and v != "", "a non-empty string")
    _check_rids(rids, prompts, rid)
    for name, flag in (
        ("return_text_in_logprobs", return_text_in_logprobs),
        ("return_prompt_token_ids", return_prompt_token_ids),
    ):
        if not isinstance(flag, bool):
            raise RequestError(f"'{name}' must be a boolean.", name)
    priorities = per_item(
        "priority", priority, prompts, None, lambda v: v is None or is_int(v), "an integer (or one per prompt)"
    )
    loras = per_item(
        "lora_path", lora_path, prompts, None, lambda v: v is None or isinstance(v, str), "a string (or one per prompt)"
    )
    loras = [lora or None for lora in loras]  # "" is the base model, as SGLang reads it
    cache_info = cache_info_mode(return_cache_info)
    salts = per_item("cache_salt", cache_salt, prompts, None, lambda v: True, "a string (or one per prompt)")
    keys = per_item("extra_key", extra_key, prompts, None, lambda v: True, "a string (or one per prompt)")
    namespaces = [request_namespace(salt, prompt_cache_key, key) for salt, key in zip(salts, keys)]
    return [
        RequestSpec(
            input_ids=ids,
            sampling=to_sampling_params(sampling[i], sampling_defaults),
            return_logprob=flags[i],
            logprob_start_len=int(starts[i]),
            asks_max_new_tokens=_asks_max_new_tokens(sampling[i]),
            return_prompt_token_ids=return_prompt_token_ids,
            top_logprobs_num=int(tops[i]),
            token_ids_logprob=token_ids[i],
            return_text_in_logprobs=return_text_in_logprobs,
            namespace=namespaces[i],
            rid=rids[i],
            field=prompts.field,
            priority=None if priorities[i] is None else int(priorities[i]),
            cache_info=cache_info,
            admin=admin,
            lora=loras[i],
            return_hidden_states=hidden[i],
        )
        for i, ids in enumerate(prompts.ids)
    ]
