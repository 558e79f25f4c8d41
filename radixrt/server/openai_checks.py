"""The checks both OpenAI routes make, with errors in OpenAI's terms: sampling
parameters and the server's limits as 400s naming the OpenAI field
(``max_tokens``, not the runtime's ``max_new_tokens``)."""

from __future__ import annotations

import json
import re
from typing import Any, Optional

from radixrt.requests.generation_defaults import fill_unset
from radixrt.requests.intake import RequestError, RequestSpec, validate_call
from radixrt.sampling.grammar import check_grammar
from radixrt.sampling.params import MAX_BEAM_WIDTH, SamplingParams
from radixrt.server.errors import ServerError, bad_request
from radixrt.server.tokenizer_manager import TokenizerManager
from radixrt.server.vllm_structured import vllm_constraint_sampling

# runtime names -> the OpenAI fields that set them
_OPENAI_NAMES = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens", "bad_words_ids": "bad_words"}
_QUOTED_NAME = re.compile(r"'(\w+)'")
_SCHEMA_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for a json_schema format's name


def check_schema_name(name: Any, param: str) -> None:
    """A 400 unless ``name`` (a json_schema format's) is 1-64 of ``[A-Za-z0-9_-]``: OpenAI requires
    it (so do SGLang's and vLLM's request models)."""
    if not isinstance(name, str) or not _SCHEMA_NAME.fullmatch(name):
        got = "missing" if name is None else repr(name)
        raise bad_request(f"'{param}' must be 1-64 letters, digits, '_' or '-' (got {got}).", param)


def openai_error(message: str, param: Optional[str]) -> ServerError:
    """A 400 for a runtime error message: the field named in OpenAI's terms (a message
    about ``sampling_params`` names the parameter it quotes, as ``'logit_bias'``)."""
    if param in (None, "sampling_params"):
        quoted = _QUOTED_NAME.search(message)
        param = quoted.group(1) if quoted else param
    for name, openai_name in _OPENAI_NAMES.items():
        message = message.replace(name, openai_name)
    return bad_request(message, _OPENAI_NAMES.get(param or "", param))


def sampling_of(
    req: Any, max_new_tokens: Optional[int], extra: Optional[dict] = None, defaults: Optional[dict] = None
) -> SamplingParams:
    """The request's SamplingParams, ``defaults`` (the model's, `generation_defaults`) filling the
    fields it leaves unset (but for a beam search, which samples nothing); a bad value is a 400 naming
    the OpenAI field."""
    d = fill_unset(req.sampling_dict(max_new_tokens), defaults)
    if extra:
        d.update(extra)
    try:
        return SamplingParams.from_dict(d)
    except ValueError as e:
        raise openai_error(str(e), None) from None


def check_limits(req: Any, tm: TokenizerManager, tops: dict[str, Optional[int]]) -> None:
    """The server's limits on ``n`` and on each of ``tops`` (the OpenAI field asking for that many top
    logprobs per position, None when not asked), the same as /generate's, as 400s naming the OpenAI
    fields; a beam search refuses per-position lists (``prompt_logprobs``, k > 0 top logprobs) here
    too, so that the refusal names the field the client sent."""
    limits = tm.limits
    if req.n > limits.max_n:
        raise bad_request(f"'n' is {req.n}; this server allows at most {limits.max_n}.", "n")
    best_of = req.best_of
    if best_of is not None and best_of != req.n and not req.use_beam_search:
        raise bad_request("'best_of' other than n is supported only as a beam width (use_beam_search).", "best_of")
    if req.use_beam_search and req.beam_width is None:  # vLLM's search: its width is max(n, best_of)
        if best_of is not None and best_of < req.n:
            raise bad_request(f"'best_of' ({best_of}) must be at least 'n' ({req.n}).", "best_of")
        if max(req.n, best_of or 0) > MAX_BEAM_WIDTH:
            field = "best_of" if (best_of or 0) > req.n else "n"
            raise bad_request(
                f"use_beam_search searches with width '{field}' = {max(req.n, best_of or 0)}; "
                f"at most {MAX_BEAM_WIDTH}.",
                field,
            )
    search = "use_beam_search" if req.use_beam_search else "beam_width" if (req.beam_width or 0) > 1 else None
    for name, top in tops.items():
        if top is None:
            continue
        if top > limits.max_top_logprobs_num:
            raise bad_request(
                f"'{name}' is {top}; this server returns at most {limits.max_top_logprobs_num} top logprobs per token.",
                name,
            )
        if search and (top > 0 or name == "prompt_logprobs"):
            raise bad_request(
                f"'{name}' cannot be combined with a beam search ('{search}'): its outputs carry each "
                "token's own logprob only.",
                name,
            )


def validate_specs(tm: TokenizerManager, specs: list[RequestSpec]) -> None:
    """`TokenizerManager.validate_specs` (blocking: off the event loop), its 400s in OpenAI's terms."""
    try:
        validate_call(specs, tm.limits)
    except RequestError as e:
        raise openai_error(e.message, e.param) from None


def constraint_sampling(req: Any) -> dict[str, Any]:
    """The sampling params of the constraint the request's OpenAI-side fields ask for, checked:
    ``response_format`` (a JSON schema, or SGLang's structural tag) or vLLM's structured outputs
    (`radixrt.server.vllm_structured`)."""
    rf = req.response_format
    formats = ["response_format"] if rf is not None and rf.type != "text" else []
    vllm = vllm_constraint_sampling(req, [n for n in ("regex", "json_schema", "ebnf") if getattr(req, n)] + formats)
    if vllm:
        return vllm
    if rf is None or rf.type == "text":
        return {}
    if req.regex or req.json_schema or req.ebnf:
        raise bad_request("'response_format' cannot be combined with regex, json_schema or ebnf.", "response_format")
    if rf.type == "structural_tag":  # SGLang's: the tag is the structural_tag sampling parameter
        fields = rf.model_dump(include={"format", "structures", "triggers"}, exclude_none=True)
        kind, source, what = "structural_tag", json.dumps({"type": "structural_tag", **fields}), "structural tag"
    elif rf.type == "json_object":
        kind, source, what = "json_schema", json.dumps({"type": "object"}), "JSON schema"
    else:
        if rf.json_schema is None or rf.json_schema.schema_ is None:
            raise bad_request("response_format json_schema needs a 'json_schema.schema'.", "response_format")
        check_schema_name(rf.json_schema.name, "response_format.json_schema.name")
        kind, source, what = "json_schema", json.dumps(rf.json_schema.schema_), "JSON schema"
    try:
        check_grammar((kind, source))
    except ValueError as e:
        raise bad_request(
            f"'response_format' holds an unusable {what}: {str(e).split(': ', 1)[-1]}", "response_format"
        ) from None
    return {kind: source}


def truncated(ids: list[int], keep: Optional[int], context_length: int) -> list[int]:
    """vLLM's ``truncate_prompt_tokens``: the prompt's last ``keep`` tokens (-1: as many as the
    context holds; None: all of it). More than the context holds, or 0, is a 400."""
    if keep is None:
        return ids
    if keep == -1:
        keep = context_length
    if not 1 <= keep <= context_length:
        raise openai_error(
            f"'truncate_prompt_tokens' must be -1 or 1 to the context length ({context_length}), got {keep}.",
            "truncate_prompt_tokens",
        )
    return ids[-keep:] if len(ids) > keep else ids


def bad_words_sampling(req: Any, tokenizer: Any) -> dict[str, Any]:
    """vLLM's ``bad_words`` as ``bad_words_ids``: each word's tokens, and those it has after a space
    (as it reads mid-sentence) where they differ, as vLLM tokenizes them ({} without any)."""
    if not req.bad_words:
        return {}
    sequences: list[list[int]] = []
    for word in req.bad_words:
        for text in (word.lstrip(), " " + word.lstrip()):
            ids = list(tokenizer.encode(text, add_special_tokens=False))
            if ids and ids not in sequences:
                sequences.append(ids)
    return {"bad_words_ids": sequences}
