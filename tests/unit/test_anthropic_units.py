"""Anthropic /v1/messages requests as the chat requests that answer them (no server)."""

from __future__ import annotations

import pytest

from radixrt.server.anthropic_input import to_chat_request
from radixrt.server.anthropic_protocol import MessagesRequest


@pytest.mark.parametrize(
    "thinking,separate,enable",
    [
        ({"type": "enabled", "budget_tokens": 1024}, True, True),
        ({"type": "disabled"}, False, False),
        (None, None, None),
    ],
)
def test_thinking_switches_the_reasoning_split_and_the_template(thinking, separate, enable):
    """disabled asked the server's parser anyway (separate_reasoning None): under deepseek-r1 the
    whole answer came back as a thinking block; it turns the split off."""
    body = {"model": "default", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
    if thinking is not None:
        body["thinking"] = thinking
    chat, _ = to_chat_request(MessagesRequest.model_validate(body))
    assert chat.separate_reasoning is separate
    assert (chat.chat_template_kwargs or {}).get("enable_thinking") is enable


def _chat(**fields):
    body = {"model": "default", "max_tokens": 8, **fields}
    return to_chat_request(MessagesRequest.model_validate(body))


def test_text_blocks_are_read_one_per_line():
    """Blocks were glued: a Claude Code reminder ran into the prompt, ["18C", "sunny"] became "18Csunny"."""
    call = {"type": "tool_use", "id": "toolu_1", "name": "weather", "input": {}}
    chat, _ = _chat(
        system=[{"type": "text", "text": "You are helpful."}, {"type": "text", "text": "Answer briefly."}],
        messages=[
            {
                "role": "user",
                "content": [{"type": "text", "text": "<r>Use tools.</r>"}, {"type": "text", "text": "Hi"}],
            },
            {"role": "assistant", "content": [call]},
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": t}]}
                    for t in ("18C",)
                ]
                + [{"type": "tool_result", "tool_use_id": "toolu_1", "is_error": True, "content": "18C\nsunny"}],
            },
        ],
    )
    contents = [m.content for m in chat.messages]
    assert contents[:2] == ["You are helpful.\nAnswer briefly.", "<r>Use tools.</r>\nHi"]
    assert contents[3:] == ["18C", "Error: 18C\nsunny"]  # is_error reaches the model as text


def test_an_empty_final_assistant_message_is_no_prefill():
    question = {"role": "user", "content": "List three colors."}
    for empty in ("", []):
        chat, _ = _chat(messages=[question, {"role": "assistant", "content": empty}])
        assert [(m.role, m.content) for m in chat.messages] == [("user", "List three colors.")]
        assert not chat.continue_final_message


def test_errors_of_the_chat_checks_name_anthropics_words():
    from radixrt.server.errors import ServerError

    _, t = _chat(messages=[{"role": "user", "content": "hi"}])
    for chat_words, anthropic_words in (
        ("'messages[0].tool_call_id' 'zz' matches no call", "'messages[0].tool_use_id' 'zz' matches no call"),
        ("'tool_choice' 'required' needs 'tools'", "'tool_choice' 'any' needs 'tools'"),
    ):
        assert t.renamed(ServerError(400, chat_words)).message == anthropic_words


def test_chat_and_responses_read_text_parts_one_per_line_too():
    """One rule for every front door (`join_text_parts`): chat's content parts and Responses' text parts."""
    from radixrt.server.openai_api import _chat_messages
    from radixrt.server.protocol import ChatCompletionRequest
    from radixrt.server.responses_input import content_text

    parts = [{"type": "text", "text": "Hello."}, {"type": "text", "text": "World."}]
    req = ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": parts}]})
    assert _chat_messages(req)[0]["content"] == "Hello.\nWorld."
    assert content_text([{**p, "type": "input_text"} for p in parts], "input[0]") == "Hello.\nWorld."


def test_a_streamed_thinking_block_is_signed_before_it_closes():
    """Anthropic's stream sends a signature_delta before a thinking block's content_block_stop (its
    SDK's accumulators expect one); here the signature is empty, as in the whole answer."""
    import json

    from radixrt.server.anthropic_render import _Blocks

    blocks = _Blocks()
    raw = blocks.feed({"reasoning_content": "hmm"}) + blocks.feed({"content": "Hi"}) + blocks.finish()
    events = [json.loads(e.split(b"data: ", 1)[1]) for e in raw]
    kinds = [(e["type"], (e.get("delta") or e.get("content_block") or {}).get("type")) for e in events]
    assert kinds == [
        ("content_block_start", "thinking"),
        ("content_block_delta", "thinking_delta"),
        ("content_block_delta", "signature_delta"),
        ("content_block_stop", None),
        ("content_block_start", "text"),
        ("content_block_delta", "text_delta"),
        ("content_block_stop", None),
    ]
    assert events[2]["delta"]["signature"] == "" and events[2]["index"] == events[3]["index"] == 0
