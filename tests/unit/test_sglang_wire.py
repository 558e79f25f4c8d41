"""What SGLang's own clients post to ``/generate`` is accepted (no model, no
server: the route's body parser). SGLang's request fields that radixrt does
not implement are accepted while unset and named in a 400 once set; pure
hints (logging, tracing, routing) are ignored whatever their value."""

from __future__ import annotations

import pytest

from radixrt.requests.intake import Limits
from radixrt.server.native_routes import parse_generate
from radixrt.server.tokenizer_manager import ServerError


class _TM:
    """The two things parse_generate asks of the tokenizer manager."""

    limits = Limits(context_length=4096, kv_total_slots=8192, vocab_size=256)

    def encode(self, text: str, field: object = None) -> list[int]:
        return [ord(c) % 200 + 1 for c in text] or [1]


def _parse(body: dict):
    return parse_generate(body, _TM())


def _sglang_sampling_params(**kw) -> dict:
    """What SGLang's RuntimeEndpoint puts in ``sampling_params`` (its own code
    when SGLang is installed, else the same keys written out)."""
    try:
        from sglang.lang.ir import SglSamplingParams
    except ImportError:
        d = {
            "max_new_tokens": 128,
            "min_new_tokens": 0,
            "n": 1,
            "stop": [],
            "stop_token_ids": [],
            "stop_regex": [],
            "temperature": 1.0,
            "top_p": 1.0,
            "top_k": -1,
            "min_p": 0.0,
            "frequency_penalty": 0.0,
            "presence_penalty": 0.0,
            "ignore_eos": False,
            "regex": None,
            "json_schema": None,
        }
        d.update(kw)
    else:
        d = SglSamplingParams(**kw).to_srt_kwargs()
    return {"skip_special_tokens": True, "spaces_between_special_tokens": True, **d}


def test_runtime_endpoint_generate_bodies():
    sp = _sglang_sampling_params(max_new_tokens=8, stop_regex=[r"\d+"], stop=["\n"])
    specs, batch, stream = _parse(
        {
            "text": "Hi",
            "sampling_params": sp,
            "return_logprob": True,
            "logprob_start_len": 0,
            "top_logprobs_num": 2,
            "return_text_in_logprobs": True,
            "stream": True,
        }
    )
    assert not batch and stream
    assert specs[0].sampling.stop_regex == [r"\d+"] and specs[0].sampling.stop == ["\n"]
    assert specs[0].top_logprobs_num == 2
    # select(): a batch of prefill-only requests with prompt logprobs
    specs, batch, _ = _parse(
        {
            "text": ["Hi a", "Hi b"],
            "sampling_params": {"max_new_tokens": 0, "temperature": 0},
            "return_logprob": True,
            "return_text_in_logprobs": True,
            "logprob_start_len": 1,
        }
    )
    assert batch and len(specs) == 2


def test_runtime_generate_sends_unset_extras():
    # sglang.Runtime.generate posts every key, unset ones as null
    specs, _, _ = _parse(
        {
            "text": "Hi",
            "sampling_params": None,
            "return_logprob": False,
            "logprob_start_len": None,
            "top_logprobs_num": None,
            "lora_path": None,
            "session_id": None,
        }
    )
    assert specs[0].sampling.max_new_tokens == 128


def test_lora_path_is_read_per_prompt():
    specs, _, _ = _parse({"text": ["a", "b"], "lora_path": ["x", None]})
    assert [s.lora for s in specs] == ["x", None]
    with pytest.raises(ServerError) as ei:
        _parse({"text": "Hi", "lora_path": 7})
    assert ei.value.status == 400 and ei.value.param == "lora_path"


@pytest.mark.parametrize(
    "field, value",
    [
        ("session_id", "s1"),
        ("custom_logit_processor", "x"),
        ("image_data", "x.png"),
        ("return_sampling_mask", True),
        ("return_entropy", True),
        ("require_reasoning", True),
        ("bootstrap_room", 7),
    ],
)
def test_set_unsupported_fields_are_named(field, value):
    with pytest.raises(ServerError) as ei:
        _parse({"text": "Hi", field: value})
    assert ei.value.status == 400 and ei.value.param == field
    assert "not supported" in ei.value.message


@pytest.mark.parametrize(
    "field, value",
    [
        ("log_metrics", False),
        ("no_logs", True),
        ("routing_key", "r"),
        ("external_trace_header", {"a": "b"}),
        ("received_time", 1.5),
        ("data_parallel_rank", 0),
        ("modalities", []),
        ("session_id", None),
    ],
)
def test_hints_and_unset_fields_are_accepted(field, value):
    _parse({"text": "Hi", field: value})


def test_unknown_field_is_still_refused():
    with pytest.raises(ServerError) as ei:
        _parse({"text": "Hi", "sampling_param": {}})
    assert ei.value.param == "sampling_param"
