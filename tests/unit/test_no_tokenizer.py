"""A runtime without a tokenizer (``skip_tokenizer_init``): what stands in for it, and what the front
door refuses (the Engine and the server: tests/e2e/test_skip_tokenizer_init.py)."""

from __future__ import annotations

import pytest

from radixrt.config.model_settings import ModelSettings
from radixrt.requests.errors import RequestError
from radixrt.requests.intake import Limits, RequestSpec, validate_spec
from radixrt.requests.no_tokenizer import TEXT_SAMPLING_FIELDS, NoTokenizer, has_text
from radixrt.requests.tokenizer_utils import load_decoder, load_tokenizer
from radixrt.sampling.params import SamplingParams

TOKEN_ONLY = Limits(context_length=64, kv_total_slots=256, vocab_size=100, text=False)


def test_no_folder_loads_a_no_tokenizer_and_a_folder_without_one_says_what_to_do(tmp_path):
    assert ModelSettings(skip_tokenizer_init=True, tokenizer_path=str(tmp_path)).tokenizer_source("/m") is None
    assert ModelSettings().tokenizer_source("/m") == "/m"
    assert ModelSettings(tokenizer_path=str(tmp_path)).tokenizer_source("/m") == str(tmp_path)
    assert isinstance(load_tokenizer(None), NoTokenizer) and isinstance(load_decoder(None), NoTokenizer)
    assert not has_text(load_tokenizer(None))
    with pytest.raises(ValueError, match="holds no tokenizer.*--tokenizer-path.*--skip-tokenizer-init"):
        load_tokenizer(str(tmp_path))


def test_no_tokenizer_gives_no_text_and_refuses_to_read_any():
    tok = NoTokenizer()
    assert tok.decode([1, 2, 3], skip_special_tokens=True) == "" and tok.get_vocab() == {}
    assert tok.eos_token_id is None and getattr(tok, "chat_template", None) is None  # a missing feature
    with pytest.raises(RequestError, match="--skip-tokenizer-init.*input_ids"):
        tok.encode("Hello")
    with pytest.raises(RequestError, match="'apply_chat_template'"):
        tok.apply_chat_template([{"role": "user", "content": "Hi"}])


def test_the_front_door_refuses_each_text_field_naming_it():
    validate_spec(RequestSpec([1, 2, 3], SamplingParams(max_new_tokens=4, stop_token_ids=[7])), TOKEN_ONLY)
    for field in TEXT_SAMPLING_FIELDS:
        sampling = SamplingParams(max_new_tokens=4, **{field: "a"})
        with pytest.raises(RequestError, match="--skip-tokenizer-init") as err:
            validate_spec(RequestSpec([1, 2, 3], sampling), TOKEN_ONLY)
        assert err.value.param == field
    validate_spec(RequestSpec([1, 2, 3], SamplingParams(max_new_tokens=4, stop="a")), Limits(64, 256, 100))  # text
    spec = RequestSpec([1, 2, 3], SamplingParams(max_new_tokens=4), return_logprob=True, return_text_in_logprobs=True)
    with pytest.raises(RequestError) as err:
        validate_spec(spec, TOKEN_ONLY)
    assert err.value.param == "return_text_in_logprobs"


def test_a_dp_front_routes_token_ids_without_a_tokenizer(make_tiny):
    """``--dp-size`` with KV events: the front reads the replicas' tokenizer for text prompts
    (``--tokenizer-path`` where given), and none under ``--skip-tokenizer-init``, whose folder may
    hold none (loading one failed the start)."""
    from radixrt.config import EngineConfig
    from radixrt.router.dp import _replica_events

    events = '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://127.0.0.1:5611"}'
    urls = ["http://127.0.0.1:1", "http://127.0.0.1:2"]
    model = make_tiny("llama", tokenizer=False, max_position_embeddings=8192)
    for flags, tokenizer in (({}, model), ({"tokenizer_path": "/"}, "/"), ({"skip_tokenizer_init": True}, None)):
        config = EngineConfig(model_path=model, kv_events_config=events, **flags)
        assert _replica_events(config, urls).tokenizer_path == tokenizer
