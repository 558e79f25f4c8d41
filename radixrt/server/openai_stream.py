"""How a request group's engine updates become a streamed OpenAI-style answer: each choice's
news since its last chunk (`take_update`), and the SSE body built from a renderer of those
updates (`stream_choices`). The renderers (openai_render, responses_render, anthropic_render)
decide what a chunk says; this module decides when chunks go out and how a stream ends."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, Optional

from radixrt.requests.finish import LENGTH, STOP
from radixrt.requests.router import ReqGroup, ReqState
from radixrt.server.errors import error_body
from radixrt.server.http_utils import SSE_DONE, group_error, sse, status_abort


def finish_reason(st: ReqState) -> Optional[str]:
    """OpenAI's finish_reason: "stop", "length", "abort", or None while running."""
    fr = st.acc.finish_reason
    if fr is None:
        return None
    return fr.type if fr.type in (STOP, LENGTH) else "abort"


@dataclass
class ChoiceUpdate:
    """What one choice of a streamed response produced since its last chunk."""

    index: int  # the choice's index (its state's position in the group)
    state: ReqState
    delta: str  # text not sent yet
    start_lp: int  # position of the first output logprob not sent yet
    start_id: int  # position of the first output id not sent yet
    finish_reason: Optional[str]

    def new_ids(self) -> list[int]:
        """The output ids produced since the choice's last chunk."""
        return list(self.state.acc.output_ids[self.start_id :])


def take_update(group: ReqGroup, st: ReqState) -> ChoiceUpdate:
    """``st``'s news since its last chunk; marks its text, logprobs and ids as sent (a
    renderer that asks for logprobs or ids sends a chunk whenever there are new ones)."""
    text = st.acc.text
    delta = text[st.sent_text :] if len(text) > st.sent_text else ""
    start_lp, start_id = st.sent_logprobs, st.sent_ids
    st.sent_text = max(st.sent_text, len(text))
    st.sent_logprobs = len(st.acc.output_token_logprobs)
    st.sent_ids = len(st.acc.output_ids)
    return ChoiceUpdate(group.states.index(st), st, delta, start_lp, start_id, finish_reason(st))


async def choice_updates(group: ReqGroup) -> AsyncIterator[list[ChoiceUpdate]]:
    """The group's news as choice updates (`take_update`), batch by batch, until it ends or a
    sample fails on the server (`group_error`)."""
    async for news in group.updates():
        if group_error(group) is not None:
            return
        yield [take_update(group, st) for st in news]


def output_deltas(output: Any, plain: bool, u: ChoiceUpdate) -> list[dict]:
    """A choice's chat deltas for update ``u``: its new text as content (``plain``: no tool
    calls or reasoning to read), else what ``output`` (a `ChoiceOutput`) reads from its text."""
    if plain:
        return [{"content": u.delta}] if u.delta else []
    return output.deltas(u.state.acc.text, u.finish_reason is not None)


def sse_chunk(head: dict, choices: list, usage_body: Optional[dict] = None, usage_key: bool = False) -> bytes:
    """One chunk of a streamed response as an SSE event: ``head`` (its id,
    object, created and model fields), then ``choices``, then ``usage`` when given
    (or with ``usage_key``, as null: OpenAI's chunks before the last under ``include_usage``)."""
    d = {**head, "choices": choices}
    if usage_body is not None or usage_key:
        d["usage"] = usage_body
    return sse(d)


async def stream_choices(
    group: ReqGroup,
    head: dict,
    render: Callable[[ChoiceUpdate], list[dict]],
    usage_fn: Optional[Callable[[], dict]],
    opening: Optional[list[dict]] = None,
    continuous_usage: bool = False,
    opening_head: Optional[dict] = None,
) -> AsyncIterator[bytes]:
    """The SSE body of a streamed completion, one chunk per choice entry.

    First the ``opening`` entries (one write; their chunks under ``opening_head`` when given).
    Then, for each batch of engine updates, the entries ``render`` makes of every choice's update
    (it may make none), in one write, each with the usage so far when ``continuous_usage``; a
    request error, or an abort with an HTTP status (`status_abort`: after its choice's last
    entry), ends the stream with an error event. Then, unless an error ended it, a chunk with no
    choices and ``usage_fn()`` when ``usage_fn`` is given; last ``[DONE]``.
    """
    key = usage_fn is not None  # every chunk has "usage" (null but in the last) under include_usage
    if opening:
        first = usage_fn() if (continuous_usage and usage_fn is not None) else None
        yield b"".join(sse_chunk(opening_head or head, [c], first, key) for c in opening)
    async for news in group.updates():
        err = group_error(group)
        if err is not None:
            yield sse(error_body(503, err))
            break
        entries = [c for st in news for c in render(take_update(group, st))]
        so_far = usage_fn() if (continuous_usage and usage_fn is not None and entries) else None
        out = [sse_chunk(head, [c], so_far, key) for c in entries]
        if out:
            yield b"".join(out)
        aborted = status_abort(group)
        if aborted is not None:
            yield sse(error_body(*aborted))
            break
    if usage_fn is not None and group_error(group) is None and status_abort(group) is None:
        yield sse_chunk(head, [], usage_fn())
    yield SSE_DONE
