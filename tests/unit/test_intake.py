"""The request front door (normalization, validation, ids) and the typed
finish reason, with no model."""

from __future__ import annotations

import pickle

import pytest

from radixrt.requests.cache_fields import cache_info_mode, cache_namespace
from radixrt.requests.finish import FinishReason
from radixrt.requests.intake import (
    Limits,
    PromptBatch,
    RequestError,
    RequestSpec,
    build_specs,
    resolve_logprob,
    split_prompts,
    validate_prompt,
    validate_spec,
)
from radixrt.requests.messages import TokenBatch, TokenOutput
from radixrt.requests.rids import RidAllocator, sample_rids
from radixrt.sampling.params import SamplingParams

LIMITS = Limits(context_length=16, kv_total_slots=12, vocab_size=100)


def encode(text: str) -> list[int]:
    return [ord(c) % 100 for c in text]


def test_split_prompts_shapes():
    p = split_prompts("ab", None, encode)
    assert p.ids == [[97, 98]] and not p.batch and p.field == "text" and p.texts == ["ab"]
    p = split_prompts(["a", ""], None, encode)
    assert p.ids == [[97], []] and p.batch
    p = split_prompts(None, [1, 2], encode)
    assert p.ids == [[1, 2]] and not p.batch and p.field == "input_ids" and p.texts == [None]
    assert split_prompts(None, [], encode).ids == [[]]  # one empty prompt, refused by validation
    p = split_prompts(None, [[1], [2, 3]], encode)
    assert p.ids == [[1], [2, 3]] and p.batch
    assert split_prompts([], None, encode, allow_empty_batch=True).ids == []
    for text, ids, param in [
        ("a", [1], "text"),
        (None, None, "text"),
        ([], None, "text"),
        (["a", 3], None, "text"),
        (None, [[1], "x"], "input_ids"),
        (None, [True], "input_ids"),
    ]:
        with pytest.raises(RequestError) as ei:
            split_prompts(text, ids, encode)
        assert ei.value.param == param
    with pytest.raises(RequestError, match="'prompt'"):
        split_prompts(5, None, encode, text_name="prompt")


def test_build_specs_per_item_values():
    batch = split_prompts(["a", "b"], None, encode)
    specs = build_specs(
        batch,
        sampling_params=[{"n": 2}, None],
        return_logprob=[True, False],
        top_logprobs_num=[0, 3],
        rid=["x", "y"],
        cache_salt="s",
    )
    assert [s.sampling.n for s in specs] == [2, 1]
    assert [s.return_logprob for s in specs] == [True, True]  # top logprobs imply logprobs
    assert [s.rid for s in specs] == ["x", "y"] and all(s.namespace == '["s", null]' for s in specs)
    single = split_prompts(None, [5, 6], encode)
    shared = SamplingParams(max_new_tokens=3)
    (spec,) = build_specs(single, sampling_params=[shared])  # a one-item list for a single prompt
    assert spec.sampling is shared and spec.logprob_start_len == -1 and spec.field == "input_ids"
    cases = [
        (batch, dict(sampling_params=[{}, {}, {}]), "sampling_params"),
        (batch, dict(sampling_params={"top_p": 0}), "sampling_params"),
        (batch, dict(sampling_params=3), "sampling_params"),
        (single, dict(return_logprob="yes"), "return_logprob"),
        (single, dict(top_logprobs_num=-1), "top_logprobs_num"),
        (single, dict(logprob_start_len=1.5), "logprob_start_len"),
        (batch, dict(rid=["x", "x"]), "rid"),
        (single, dict(rid=["x"]), "rid"),
        (single, dict(rid=""), "rid"),
        (single, dict(return_text_in_logprobs=None), "return_text_in_logprobs"),
        (single, dict(cache_salt=1), "cache_salt"),
    ]
    for prompts, kwargs, param in cases:
        with pytest.raises(RequestError) as ei:
            build_specs(prompts, **kwargs)
        assert ei.value.param == param, (kwargs, ei.value.message)
        assert isinstance(ei.value, ValueError)


def test_extra_key_and_per_prompt_salts_name_namespaces():
    """SGLang's ``extra_key`` separates caches as ``cache_salt`` does (a namespace of its own per
    distinct triple), and either takes one value per prompt of a batch."""
    batch = split_prompts(["a", "b"], None, encode)
    specs = build_specs(batch, cache_salt=["s", None], extra_key="k")
    assert [s.namespace for s in specs] == ['["s", null, "k"]', '[null, null, "k"]']
    (plain,) = build_specs(split_prompts("a", None, encode), cache_salt="s")
    assert plain.namespace == '["s", null]'  # namespaces named before extra_key keep their names
    names = {
        build_specs(split_prompts("a", None, encode), **kw)[0].namespace
        for kw in (dict(extra_key="x"), dict(cache_salt="x"), dict(prompt_cache_key="x"), {})
    }
    assert len(names) == 4 and None in names
    for kwargs, param in ((dict(extra_key=3), "extra_key"), (dict(extra_key=["x"]), "extra_key")):
        with pytest.raises(RequestError) as ei:
            build_specs(split_prompts("a", None, encode), **kwargs)
        assert ei.value.param == param
    with pytest.raises(RequestError, match="'cache_salt' has 1 entries for 2 prompts"):
        build_specs(batch, cache_salt=["s"])


def test_a_batch_takes_one_rid_per_prompt_or_one_to_number():
    """As SGLang: one string for a batch names its prompts ``<rid>_<i>``."""
    batch = split_prompts(["a", "b"], None, encode)
    assert [s.rid for s in build_specs(batch, rid="x")] == ["x_0", "x_1"]
    with pytest.raises(RequestError, match="unique"):
        build_specs(batch, rid=["x", "x"])
    assert [s.rid for s in build_specs(split_prompts(["a"], None, encode), rid="x")] == ["x"]


def test_validation_against_limits():
    ok = SamplingParams()
    validate_prompt([1, 2, 3], ok, LIMITS)
    cases = [
        ([], ok, "empty", "text"),
        (list(range(16)), ok, "context length is 16", "text"),
        (list(range(12)), ok, "needs one more for its output; the KV pool holds 12", "text"),
        ([1, 100], ok, "vocabulary [0, 100): [100]", "input_ids"),
        ([1, -1], ok, "vocabulary", "input_ids"),
        ([1], SamplingParams(logit_bias={"150": 1.0}), "", "sampling_params"),
        ([1], SamplingParams(regex="(ab"), "regex", "regex"),
    ]
    for ids, sp, mention, param in cases:
        with pytest.raises(RequestError) as ei:
            validate_prompt(ids, sp, LIMITS, field="text")
        assert mention in ei.value.message and ei.value.param == param, ei.value.message
    with pytest.raises(RequestError) as ei:
        validate_spec(RequestSpec([1, 2], ok, return_logprob=True, logprob_start_len=3), LIMITS)
    assert ei.value.param == "logprob_start_len"
    validate_spec(RequestSpec([1, 2], ok, return_logprob=True, logprob_start_len=2), LIMITS)  # none of the prompt's
    validate_spec(RequestSpec([1, 2], ok, logprob_start_len=2), LIMITS)  # no logprobs: start is unused
    with pytest.raises(RequestError) as ei:
        validate_spec(RequestSpec([1, 2], ok, top_logprobs_num=-1), LIMITS)
    assert ei.value.param == "top_logprobs_num"


def test_ids_and_logprob_flags():
    assert sample_rids("r", 1) == ["r"] and sample_rids("r", 3) == ["r-0", "r-1", "r-2"]
    new = RidAllocator()
    assert len({new() for _ in range(1000)}) == 1000
    assert RidAllocator()() != RidAllocator()()
    assert resolve_logprob(False, 2) and resolve_logprob(True, 0) and not resolve_logprob(None, 0)
    spec = RequestSpec([1], SamplingParams(n=2), top_logprobs_num=1, namespace="c")
    req = spec.to_generate_req("abc", stream=True)
    assert (req.rid, req.return_logprob, req.top_logprobs_num, req.stream, req.namespace) == ("abc", True, 1, True, "c")
    assert PromptBatch([[1]], [None], False, "messages").field == "messages"


def test_finish_reason_wire_shape_and_transport():
    assert FinishReason.stop("x").to_dict() == {"type": "stop", "matched": "x"}
    assert FinishReason.stop(7).to_dict() == {"type": "stop", "matched": 7}
    assert FinishReason.length(4).to_dict() == {"type": "length", "length": 4}
    assert FinishReason.abort("gone").to_dict() == {"type": "abort", "message": "gone"}
    assert list(FinishReason.abort("bad", 400).to_dict().items()) == [
        ("type", "abort"),
        ("message", "bad"),
        ("status_code", 400),
    ]
    for fr in (FinishReason.stop("x"), FinishReason.length(0), FinishReason.abort("m", 400)):
        assert FinishReason.from_dict(fr.to_dict()) == fr
        assert pickle.loads(pickle.dumps(fr)) == fr
        assert fr.get("type") == fr.type
    assert FinishReason.abort("m").is_abort and not FinishReason.length(1).is_abort
    out = TokenOutput("r", [1], 1, 1, 0, {"type": "length", "length": 1})  # a wire dict is converted
    assert out.finish_reason == FinishReason.length(1) and out.finished
    back = pickle.loads(pickle.dumps(TokenBatch([out, TokenOutput("s", [], 1, 0, 0)])))
    assert back.outputs[0].finish_reason == FinishReason.length(1) and not back.outputs[1].finished
    with pytest.raises(ValueError):
        FinishReason.from_dict({"type": "nope"})


def test_cache_namespaces_are_distinct_for_distinct_salt_and_key_pairs():
    pairs = [
        ("a", "b"),
        ("a\x00b", None),
        (None, "a\x00b"),
        ("a", None),
        (None, "a"),
        ("a", ""),
        ("", "a"),
        ('["a", "b"]', None),
        ("a", '"b"]'),
        ('a", "b', None),
    ]
    spaces = [cache_namespace(*p) for p in pairs]
    assert len(set(spaces)) == len(pairs) and None not in spaces
    assert cache_namespace(None, None) is None
    # a salt means the same namespace on every route, with or without a (None) key
    assert cache_namespace("s") == cache_namespace("s", None)


def test_cache_info_modes():
    assert [cache_info_mode(v) for v in (None, False, True, "full")] == ["", "", "own", "full"]
    for bad in (1, 0, "yes", "Full", "own"):
        with pytest.raises(RequestError, match="return_cache_info"):
            cache_info_mode(bad)


def test_token_ids_logprob_is_one_list_for_every_prompt_or_one_per_prompt():
    one = PromptBatch([[1, 2]], ["a"], False, "text")
    two = PromptBatch([[1, 2], [3]], ["a", "b"], True, "text")
    assert [s.token_ids_logprob for s in build_specs(one, token_ids_logprob=[4, 5])] == [(4, 5)]
    assert build_specs(one, token_ids_logprob=[4])[0].return_logprob  # asking for them returns logprobs
    assert [s.token_ids_logprob for s in build_specs(two, token_ids_logprob=[4])] == [(4,), (4,)]
    assert [s.token_ids_logprob for s in build_specs(two, token_ids_logprob=[[4], None])] == [(4,), ()]
    assert not build_specs(two)[1].return_logprob
    for bad in ([[4]], "4", [True], [[4], [5], [6]]):
        with pytest.raises(RequestError, match="token_ids_logprob"):
            build_specs(two if bad != [[4]] else one, token_ids_logprob=bad)
