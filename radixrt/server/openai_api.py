"""OpenAI-compatible routes: /v1/models, /v1/completions, /v1/chat/completions."""
from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable, Optional

from fastapi import FastAPI, Request
from starlette.responses import Response

from radixrt.sampling.grammar import check_grammar
from radixrt.sampling.params import SamplingParams
from radixrt.server.protocol import ChatCompletionRequest, CompletionRequest
from radixrt.server.tokenizer_manager import ReqGroup, ReqSpec, ReqState, bad_request

if TYPE_CHECKING:
    from radixrt.server.http_server import ServerContext


def _finish_reason(st: ReqState) -> Optional[str]:
    fr = st.acc.finish_reason
    if fr is None:
        return None
    kind = fr.get("type")
    return kind if kind in ("stop", "length") else "abort"


class _TokenTexts:
    """Per-request cache of single-token texts (for logprobs)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.cache: dict[int, str] = {}

    def __call__(self, tid: int) -> str:
        s = self.cache.get(tid)
        if s is None:
            s = self.cache[tid] = self.tokenizer.decode([tid])
        return s


def _usage(group: ReqGroup, n: int, prompt_lens: list[int]) -> dict:
    prompt_tokens = sum(prompt_lens)
    completion = sum(st.acc.completion_tokens for st in group.states)
    cached = 0
    for p in range(len(prompt_lens)):
        subs = group.states[p * n:(p + 1) * n]
        cached += max((min(st.acc.cached_tokens, prompt_lens[p]) for st in subs), default=0)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": prompt_tokens + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def _sampling(req: Any, max_new_tokens: Optional[int], extra: Optional[dict] = None) -> SamplingParams:
    d = req.sampling_dict(max_new_tokens)
    if extra:
        d.update(extra)
    try:
        return SamplingParams.from_dict(d)
    except ValueError as e:
        msg = str(e)
        param = None
        for name in ("max_new_tokens", "min_new_tokens"):
            if f"'{name}'" in msg:
                param = "max_tokens" if name == "max_new_tokens" else "min_tokens"
        if param is None:
            import re

            m = re.search(r"'(\w+)'", msg)
            param = m.group(1) if m else None
        raise bad_request(msg.replace("max_new_tokens", "max_tokens"), param) from None


def _check_stream_error(group: ReqGroup) -> Optional[str]:
    for st in group.states:
        if st.error is not None:
            return st.error
    return None


@dataclass
class _ChoiceUpdate:
    """What one choice of a streamed response produced since its last chunk."""

    index: int  # the choice's index (its state's position in the group)
    state: ReqState
    delta: str  # text not sent yet
    start_lp: int  # position of the first output logprob not sent yet
    finish_reason: Optional[str]


def _take_update(group: ReqGroup, st: ReqState) -> _ChoiceUpdate:
    """``st``'s news since its last chunk; marks its text and logprobs as sent."""
    text = st.acc.text
    delta = text[st.sent_text:] if len(text) > st.sent_text else ""
    start_lp = st.sent_logprobs
    st.sent_text = max(st.sent_text, len(text))
    st.sent_logprobs = len(st.acc.output_token_logprobs)
    return _ChoiceUpdate(group.states.index(st), st, delta, start_lp, _finish_reason(st))


def _sse_chunk(head: dict, choices: list, usage: Optional[dict] = None) -> bytes:
    """One chunk of a streamed response as an SSE event: ``head`` (its id,
    object, created and model fields), then ``choices``, then ``usage`` when given."""
    from radixrt.server.http_server import sse

    d = {**head, "choices": choices}
    if usage is not None:
        d["usage"] = usage
    return sse(d)


async def _stream_choices(group: ReqGroup, head: dict, render: Callable[[_ChoiceUpdate], list[dict]],
                          usage: Optional[Callable[[], dict]], opening: Optional[list[dict]] = None,
                          ) -> AsyncIterator[bytes]:
    """The SSE body of a streamed completion, one chunk per choice entry.

    First the ``opening`` entries (one write). Then, for each batch of engine
    updates, the entries ``render`` makes of every choice's update (it may make
    none), in one write; a request error ends the stream with an error event.
    Then, unless an error ended it, a chunk with no choices and ``usage()``
    when ``usage`` is given; last ``[DONE]``.
    """
    from radixrt.server.http_server import SSE_DONE, error_body, sse

    if opening:
        yield b"".join(_sse_chunk(head, [c]) for c in opening)
    async for news in group.updates():
        err = _check_stream_error(group)
        if err is not None:
            yield sse(error_body(503, err))
            break
        out = [_sse_chunk(head, [c]) for st in news for c in render(_take_update(group, st))]
        if out:
            yield b"".join(out)
    if usage is not None and _check_stream_error(group) is None:
        yield _sse_chunk(head, [], usage())
    yield SSE_DONE


def add_routes(app: FastAPI, ctx: "ServerContext") -> None:
    from radixrt.server.http_server import JSON, raise_state_errors, stream_response, wait_group

    tm = ctx.tm

    @app.get("/v1/models")
    async def list_models() -> Response:
        return JSON({"object": "list", "data": [{
            "id": ctx.served_model_name, "object": "model", "created": int(ctx.started), "owned_by": "radixrt",
            "root": ctx.resolved_model_path, "max_model_len": tm.context_length,
        }]})

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str) -> Response:
        ctx.check_model(model_id)
        return JSON({"id": ctx.served_model_name, "object": "model", "created": int(ctx.started),
                     "owned_by": "radixrt"})

    # ------------------------------------------------------------------ completions
    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request) -> Response:
        ctx.check_model(req.model)
        tm.check_alive()
        if req.suffix:
            raise bad_request("'suffix' is not supported.", "suffix")
        if req.best_of is not None and req.best_of != req.n:
            raise bad_request("'best_of' other than n is not supported.", "best_of")
        p = req.prompt
        if isinstance(p, str):
            prompts: list[Any] = [p]
        elif isinstance(p, list) and p and all(isinstance(x, int) for x in p):
            prompts = [p]
        elif isinstance(p, list) and p:
            prompts = list(p)
        else:
            raise bad_request("'prompt' must not be empty.", "prompt")
        ids_list, prompt_texts = [], []
        for x in prompts:
            if isinstance(x, str):
                ids_list.append(tm.encode(x) if x else [])
                prompt_texts.append(x)
            else:
                ids_list.append(list(x))
                prompt_texts.append(None)
        want_lp = req.logprobs is not None
        specs = []
        for ids in ids_list:
            sp = _sampling(req, req.max_tokens if req.max_tokens is not None
                           else max(tm.context_length - len(ids), 0))
            specs.append(ReqSpec(
                input_ids=ids, sampling=sp, return_logprob=want_lp,
                logprob_start_len=0 if (want_lp and req.echo) else -1,
                top_logprobs_num=req.logprobs or 0, cache_salt=req.cache_salt,
                rid=req.rid if len(ids_list) == 1 else None, field="prompt",
            ))
        group = tm.submit(specs)
        n = req.n
        cid = f"cmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        tt = _TokenTexts(tm.tokenizer)

        def prompt_text(i: int) -> str:
            if prompt_texts[i] is None:
                prompt_texts[i] = tm.tokenizer.decode(ids_list[i])
            return prompt_texts[i]

        def logprobs_obj(st: ReqState, start: int, echo: bool, offset0: int) -> dict:
            tokens, lps, tops, offsets = [], [], [], []
            pos = offset0
            pairs: list = []
            top_lists: list = []
            if echo:
                pairs += list(st.acc.input_token_logprobs)
                top_lists += list(st.acc.input_top_logprobs) or [None] * len(st.acc.input_token_logprobs)
            pairs += st.acc.output_token_logprobs[start:]
            top_lists += st.acc.output_top_logprobs[start:] or [None] * len(st.acc.output_token_logprobs[start:])
            for i, (lp, tid) in enumerate(pairs):
                s = tt(tid)
                tokens.append(s)
                lps.append(lp)
                offsets.append(pos)
                pos += len(s)
                top = top_lists[i] if i < len(top_lists) else None
                if req.logprobs:
                    tops.append(None if top is None else {tt(t): v for v, t in top})
            return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops if req.logprobs else None,
                    "text_offset": offsets}

        if req.stream:
            echoed: set[int] = set()  # choices whose prompt was sent (with echo, in their first chunk)

            def render(u: _ChoiceUpdate) -> list[dict]:
                echo_now = req.echo and u.index not in echoed
                echoed.add(u.index)
                prefix = prompt_text(u.index // n) if echo_now else ""
                if not u.delta and not prefix and u.finish_reason is None:
                    return []
                choice = {"index": u.index, "text": prefix + u.delta, "logprobs": None,
                          "finish_reason": u.finish_reason}
                if want_lp:
                    choice["logprobs"] = logprobs_obj(u.state, u.start_lp, echo_now, 0)
                return [choice]

            def usage() -> dict:
                return _usage(group, n, [len(x) for x in ids_list])

            head = {"id": cid, "object": "text_completion", "created": created, "model": ctx.served_model_name}
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return stream_response(tm, group, _stream_choices(group, head, render, usage if include_usage else None))

        if not await wait_group(request, tm, group):
            return Response(status_code=499)
        raise_state_errors(group)
        choices = []
        for idx, st in enumerate(group.states):
            prefix = prompt_text(idx // n) if req.echo else ""
            choice = {"index": idx, "text": prefix + st.acc.text, "logprobs": None,
                      "finish_reason": _finish_reason(st)}
            if want_lp:
                choice["logprobs"] = logprobs_obj(st, 0, req.echo, 0)
            choices.append(choice)
        return JSON({"id": cid, "object": "text_completion", "created": created, "model": ctx.served_model_name,
                     "choices": choices, "usage": _usage(group, n, [len(x) for x in ids_list])})

    # ------------------------------------------------------------------ chat
    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, request: Request) -> Response:
        ctx.check_model(req.model)
        tm.check_alive()
        from radixrt.requests.tokenizer_utils import apply_chat_template

        messages = []
        for i, m in enumerate(req.messages):
            content = m.content
            if isinstance(content, list):
                parts = []
                for part in content:
                    if part.type != "text" or part.text is None:
                        raise bad_request(f"messages[{i}].content: only text parts are supported by this model "
                                          f"(got a '{part.type}' part).", f"messages.{i}.content")
                    parts.append(part.text)
                content = "".join(parts)
            msg: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": content or ""}
            if m.name:
                msg["name"] = m.name
            if m.tool_calls:
                msg["tool_calls"] = m.tool_calls
            if m.tool_call_id:
                msg["tool_call_id"] = m.tool_call_id
            messages.append(msg)
        if req.top_logprobs and not req.logprobs:
            raise bad_request("'top_logprobs' requires 'logprobs': true.", "top_logprobs")
        cont = req.continue_final_message and messages[-1]["role"] == "assistant"
        extra_tpl = dict(req.chat_template_kwargs or {})
        if req.tools:
            extra_tpl["tools"] = req.tools
        try:
            prompt = apply_chat_template(tm.tokenizer, messages, continue_final_message=cont, extra=extra_tpl)
        except Exception as e:  # noqa: BLE001 - a template may reject a conversation
            raise bad_request(f"The chat template cannot render these messages: {e}", "messages") from None
        bos = getattr(tm.tokenizer, "bos_token", None)
        if bos and prompt.startswith(bos):
            ids = list(tm.tokenizer.encode(prompt, add_special_tokens=False))
        else:
            ids = tm.encode(prompt)
        extra: dict[str, Any] = {}
        rf = req.response_format
        if rf is not None and rf.type != "text":
            if req.regex or req.json_schema or req.ebnf:
                raise bad_request("'response_format' cannot be combined with regex, json_schema or ebnf.",
                                  "response_format")
            if rf.type == "json_object":
                extra["json_schema"] = json.dumps({"type": "object"})
            else:
                if rf.json_schema is None or rf.json_schema.schema_ is None:
                    raise bad_request("response_format json_schema needs a 'json_schema.schema'.",
                                      "response_format")
                extra["json_schema"] = json.dumps(rf.json_schema.schema_)
            try:
                check_grammar(("json_schema", extra["json_schema"]))
            except ValueError as e:
                raise bad_request(f"'response_format' holds an unusable JSON schema: "
                                  f"{str(e).split(': ', 1)[-1]}", "response_format") from None
        max_new = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        if max_new is None:
            max_new = max(tm.context_length - len(ids), 0)
        sp = _sampling(req, max_new, extra)
        spec = ReqSpec(input_ids=ids, sampling=sp, return_logprob=req.logprobs,
                       top_logprobs_num=(req.top_logprobs or 0) if req.logprobs else 0,
                       cache_salt=req.cache_salt, rid=req.rid, field="messages")
        group = tm.submit([spec])
        n = req.n
        cid = f"chatcmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        tt = _TokenTexts(tm.tokenizer)

        def lp_entries(st: ReqState, start: int) -> list[dict]:
            out = []
            tops = st.acc.output_top_logprobs
            for i, (lp, tid) in enumerate(st.acc.output_token_logprobs[start:], start):
                s = tt(tid)
                top = tops[i] if i < len(tops) and tops[i] is not None else []
                out.append({"token": s, "logprob": lp, "bytes": list(s.encode("utf-8")),
                            "top_logprobs": [{"token": tt(t), "logprob": v, "bytes": list(tt(t).encode("utf-8"))}
                                             for v, t in top]})
            return out

        if req.stream:
            def render(u: _ChoiceUpdate) -> list[dict]:
                out = []
                lp = {"content": lp_entries(u.state, u.start_lp)} if req.logprobs else None
                if u.delta or (lp and lp["content"]):
                    out.append({"index": u.index, "delta": {"content": u.delta}, "logprobs": lp,
                                "finish_reason": None})
                if u.finish_reason is not None:
                    out.append({"index": u.index, "delta": {}, "logprobs": None, "finish_reason": u.finish_reason})
                return out

            def usage() -> dict:
                return _usage(group, n, [len(ids)])

            head = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": ctx.served_model_name}
            opening = [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                        "finish_reason": None} for i in range(n)]
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return stream_response(tm, group, _stream_choices(group, head, render, usage if include_usage else None,
                                                              opening))

        if not await wait_group(request, tm, group):
            return Response(status_code=499)
        raise_state_errors(group)
        choices = []
        for idx, st in enumerate(group.states):
            choices.append({
                "index": idx,
                "message": {"role": "assistant", "content": st.acc.text},
                "logprobs": {"content": lp_entries(st, 0)} if req.logprobs else None,
                "finish_reason": _finish_reason(st),
            })
        return JSON({"id": cid, "object": "chat.completion", "created": created, "model": ctx.served_model_name,
                     "choices": choices, "usage": _usage(group, n, [len(ids)])})
