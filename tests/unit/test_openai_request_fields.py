"""What an OpenAI-route request's fields become (no server): the model's sampling defaults fill
what a request leaves unset, ``model`` may be left out, and fields of vLLM's and SGLang's that
these routes do not implement are refused rather than ignored."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from radixrt.requests.generation_defaults import generation_defaults
from radixrt.server.openai_checks import sampling_of
from radixrt.server.protocol import ChatCompletionRequest, CompletionRequest

CHAT = {"messages": [{"role": "user", "content": "hi"}]}


def test_the_models_generation_config_fills_what_a_request_leaves_unset(tmp_path):
    """SGLang's --sampling-defaults model (its default) and vLLM's --generation-config auto:
    a Qwen3-like file asked for top_k 20 and temperature 0.6; radixrt sampled at 1.0, no top-k."""
    (tmp_path / "generation_config.json").write_text(
        json.dumps({"do_sample": True, "temperature": 0.6, "top_k": 20, "top_p": 0.95, "eos_token_id": 2})
    )
    defaults = generation_defaults(str(tmp_path))
    assert defaults == {"temperature": 0.6, "top_k": 20, "top_p": 0.95}
    unset = sampling_of(ChatCompletionRequest.model_validate(CHAT), 8, defaults=defaults)
    assert (unset.temperature, unset.top_k, unset.top_p) == (0.6, 20, 0.95)
    greedy = sampling_of(ChatCompletionRequest.model_validate({**CHAT, "temperature": 0}), 8, defaults=defaults)
    assert (greedy.temperature, greedy.top_k) == (0.0, 20)  # the request's own field wins
    assert generation_defaults(str(tmp_path / "none")) == {}
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": -1}))
    with pytest.raises(ValueError, match="generation_config.json holds sampling settings that are not valid"):
        generation_defaults(str(tmp_path))


def test_model_may_be_left_out_as_in_sglang_and_vllm():
    assert ChatCompletionRequest.model_validate(CHAT).model is None
    assert CompletionRequest.model_validate({"prompt": "hi"}).model is None


@pytest.mark.parametrize(
    "field,value,says",
    [
        ("logits_processors", ["my_pkg:Processor"], "vLLM's"),
        ("custom_logit_processor", "x", "SGLang's"),
    ],
)
def test_fields_these_routes_do_not_implement_are_refused(field, value, says):
    """They were unknown fields, ignored: the answer silently lacked what was asked."""
    for model, body in ((ChatCompletionRequest, CHAT), (CompletionRequest, {"prompt": "hi"})):
        with pytest.raises(ValidationError) as e:
            model.model_validate({**body, field: value})
        assert e.value.errors()[0]["loc"] == (field,) and says in str(e.value)
        assert getattr(model.model_validate({**body, field: None}), field) is None


def test_a_legacy_function_call_in_the_history_is_the_call_its_function_message_answers():
    """The assistant turn that made a deprecated function_call reached the template empty, while
    the function message answering it was rendered: a result that answered nothing."""
    from radixrt.server.openai_api import _chat_messages

    call = {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    req = ChatCompletionRequest.model_validate(
        {
            "messages": [
                {"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": None, "function_call": call},
                {"role": "function", "name": "get_weather", "content": "sunny"},
            ]
        }
    )
    user, assistant, result = _chat_messages(req)
    (made,) = assistant["tool_calls"]
    assert made["function"] == call and made["type"] == "function"
    assert result == {"role": "tool", "name": "get_weather", "content": "sunny", "tool_call_id": made["id"]}


def test_an_assistants_refusal_part_is_its_text():
    from radixrt.server.openai_api import _chat_messages

    refusal = [{"type": "refusal", "refusal": "I can't help with that."}]
    req = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": refusal}]}
    )
    assert _chat_messages(req)[1]["content"] == "I can't help with that."


@pytest.mark.parametrize("field", ["functions", "function_call"])
def test_the_deprecated_functions_request_is_refused_naming_tools(field):
    """`functions` was an unknown field: the request ran without the tools it declared."""
    with pytest.raises(ValidationError, match="send 'tools'"):
        ChatCompletionRequest.model_validate({**CHAT, field: [{"name": "f"}] if field == "functions" else "auto"})


def test_a_function_message_answers_one_function_call_and_refusals_are_an_assistants():
    from radixrt.server.errors import ServerError
    from radixrt.server.openai_api import _chat_messages

    call = {"role": "assistant", "content": None, "function_call": {"name": "f", "arguments": "{}"}}
    answer = {"role": "function", "name": "f", "content": "42"}
    user = {"role": "user", "content": "hi"}
    for messages in ([user, answer], [user, call, answer, answer]):  # no call to answer; one answered twice
        with pytest.raises(ServerError, match="must answer the function_call"):
            _chat_messages(ChatCompletionRequest.model_validate({"messages": messages}))
    refused = {"role": "user", "content": [{"type": "refusal", "refusal": "x"}]}
    with pytest.raises(ServerError, match="belongs to an assistant message"):
        _chat_messages(ChatCompletionRequest.model_validate({"messages": [refused]}))


def test_an_empty_list_asks_for_nothing():
    """vLLM sends bad_words: [] (its default): that asks for nothing, so it is no 400."""
    from radixrt.server.openai_checks import bad_words_sampling

    req = ChatCompletionRequest.model_validate({**CHAT, "bad_words": [], "logits_processors": []})
    assert req.bad_words == [] and bad_words_sampling(req, tokenizer=None) == {}
    assert ChatCompletionRequest.model_validate({**CHAT, "prompt_logprobs": 0}).prompt_logprobs == 0  # asks


def test_model_defaults_leave_a_beam_search_alone_and_top_k_0_is_off(tmp_path):
    """A Qwen2.5-like repetition_penalty in the file made every beam search a 400; top_k 0 (no top-k
    in transformers and vLLM) stopped the server from starting."""
    (tmp_path / "generation_config.json").write_text(json.dumps({"repetition_penalty": 1.05, "top_k": 0}))
    defaults = generation_defaults(str(tmp_path))
    assert defaults == {"repetition_penalty": 1.05}
    beam = {**CHAT, "use_beam_search": True, "n": 2}
    assert sampling_of(ChatCompletionRequest.model_validate(beam), 8, defaults=defaults).beam_width == 2
