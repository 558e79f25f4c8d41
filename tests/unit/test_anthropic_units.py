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
