"""OpenAI response bodies: completion and chat choices (whole or streamed as
SSE chunks), logprobs, usage and finish reasons, from a request group's states."""

from __future__ import annotations

import codecs
import time
import uuid
from typing import Any, AsyncIterator, Callable, Optional

from radixrt.requests.finish import STOP
from radixrt.requests.hidden_states import last_row
from radixrt.requests.intake import PromptBatch
from radixrt.requests.reasoning import reasoning_token_count
from radixrt.requests.router import ReqGroup, ReqState
from radixrt.server.openai_stream import ChoiceUpdate, finish_reason, output_deltas, stream_choices
from radixrt.server.prompt_logprobs import prompt_logprob_entries
from radixrt.server.protocol import ChatCompletionRequest, CompletionRequest
from radixrt.server.token_texts import TokenTexts
from radixrt.server.tools import ChoiceOutput, ToolCallParser, reasoning_fields


def matched_stop(st: ReqState) -> Any:
    """SGLang's ``matched_stop`` of a choice: the stop string, stop pattern or stop token id that
    ended it; None for any other finish (or while running)."""
    fr = st.acc.finish_reason
    return fr.matched if fr is not None and fr.type == STOP else None


def content_logprobs(st: ReqState) -> int:
    """How many of ``st``'s output logprobs belong to its text: all but a stop token that ended
    it (EOS, ``stop_token_ids``), whose text is not in the answer (nor in OpenAI's logprobs)."""
    acc = st.acc
    n = len(acc.output_token_logprobs)
    fr = acc.finish_reason
    if fr is not None and fr.type == STOP and isinstance(fr.matched, int) and n:
        if acc.output_token_logprobs[-1][1] == fr.matched:
            return n - 1
    return n


def usage(group: ReqGroup, n: int, prompt_lens: list[int]) -> dict:
    """Token usage of a group of ``len(prompt_lens)`` prompts with ``n`` samples
    each; a prompt's cached tokens are its best sample's."""
    prompt_tokens = sum(prompt_lens)
    completion = sum(st.acc.completion_tokens for st in group.states)
    cached = 0
    for p in range(len(prompt_lens)):
        subs = group.states[p * n : (p + 1) * n]
        cached += max((min(st.acc.cached_tokens, prompt_lens[p]) for st in subs), default=0)
    body: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": prompt_tokens + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }
    # return_cache_info (radixrt's extension): each prompt's explanation, from its first sample
    infos = [group.states[p * n].acc.cache_info for p in range(len(prompt_lens)) if p * n < len(group.states)]
    if any(info is not None for info in infos):
        body["cache_info"] = infos
    return body


def reasoning_tokens(group: ReqGroup, mode: str, tokenizer: Any, skip_special_tokens: Optional[bool]) -> int:
    """The output tokens the thinking blocks of ``group``'s samples took (`reasoning_token_count`)."""
    skip = skip_special_tokens
    return sum(reasoning_token_count(st.acc.output_ids, tokenizer, mode, skip, st.acc.text) for st in group.states)


def logprob_entries(tt: TokenTexts, st: ReqState, start: int, top_n: Optional[int] = None) -> list[dict]:
    """Chat's (and the Responses API's) logprobs ``content`` entries for ``st``'s output
    tokens from ``start`` (to `content_logprobs`), each with its first ``top_n`` top entries
    (None: all computed; a request that also asked for prompt logprobs may have more)."""
    out = []
    tops = st.acc.output_top_logprobs
    for i, (lp, tid) in enumerate(st.acc.output_token_logprobs[start : content_logprobs(st)], start):
        top = (tops[i] if i < len(tops) and tops[i] is not None else [])[:top_n]
        out.append(
            {
                "token": tt(tid),
                "logprob": lp,
                "bytes": list(tt.token_bytes(tid)),
                "top_logprobs": [{"token": tt(t), "logprob": v, "bytes": list(tt.token_bytes(t))} for v, t in top],
            }
        )
    return out


def _head(prefix: str, obj: str, model: str, group: ReqGroup) -> dict:
    """An answer's id, object, created and model fields. The id holds its first request's rid (the
    client's, or the one assigned), which the request log names: a client's id finds its log lines."""
    rid = group.rids[0] if group.rids else uuid.uuid4().hex
    head = {"id": f"{prefix}-{rid}", "object": obj, "created": int(time.time()), "model": model}
    return {**head, "system_fingerprint": None}  # OpenAI's field: nothing to fingerprint here


def _include_usage(req: Any) -> bool:
    return bool(req.stream_options and req.stream_options.include_usage)


def _continuous_usage(req: Any) -> bool:
    """vLLM's stream_options.continuous_usage_stats (with include_usage): usage in every chunk."""
    return _include_usage(req) and req.stream_options.continuous_usage_stats


# ---------------------------------------------------------------------- /v1/completions
class CompletionView:
    """The answer to one /v1/completions request, whole or streamed."""

    def __init__(
        self, req: CompletionRequest, group: ReqGroup, prompts: PromptBatch, tokenizer: Any, model: str
    ) -> None:
        self.req, self.group, self.prompts, self.tokenizer = req, group, prompts, tokenizer
        self.head = _head("cmpl", "text_completion", model, group)
        self.tt = TokenTexts(tokenizer, req.return_tokens_as_token_ids)
        self.opened: set[int] = set()  # streamed choices that sent their first chunk (the echo, the prompt ids)
        # streamed choices: the text_offset their next logprob starts at (the text sent before it), and
        # the decoder holding a character begun but not yet whole
        self.next_offset: dict[int, tuple[int, Any]] = {}

    def prompt_text(self, i: int) -> str:
        """Prompt ``i`` as text (decoded once when it was given as ids)."""
        if self.prompts.texts[i] is None:
            self.prompts.texts[i] = self.tokenizer.decode(self.prompts.ids[i])
        return self.prompts.texts[i]

    def logprobs(self, st: ReqState, start: int, echo: bool, index: Optional[int] = None) -> dict:
        """OpenAI's legacy logprobs object for output logprobs from ``start``
        (preceded by the prompt's with ``echo``). ``index``: a streamed choice's, whose
        text offsets go on from where its previous chunk's ended."""
        acc, top_n = st.acc, self.req.logprobs
        pairs: list = list(acc.input_token_logprobs) if echo else []
        top_lists: list = (list(acc.input_top_logprobs) or [None] * len(acc.input_token_logprobs)) if echo else []
        end = content_logprobs(st)
        pairs += acc.output_token_logprobs[start:end]
        top_lists += acc.output_top_logprobs[start:end] or [None] * len(acc.output_token_logprobs[start:end])
        tokens, lps, tops, offsets = [], [], [], []
        # a token's offset: the characters of the text before it (a partial character counts once whole)
        fresh = (0, codecs.getincrementaldecoder("utf-8")("replace"))
        pos, chars = fresh if index is None else self.next_offset.get(index, fresh)
        for i, (lp, tid) in enumerate(pairs):
            tokens.append(self.tt(tid))
            lps.append(lp)
            offsets.append(pos)
            pos += len(chars.decode(self.tt.token_bytes(tid)))  # the characters it completes
            top = top_lists[i] if i < len(top_lists) else None
            if top_n:  # the chosen token too, where it is not among the top (OpenAI's up to logprobs + 1)
                alternatives = None if top is None else {self.tt(t): v for v, t in top[:top_n]}
                if alternatives is not None and lp is not None:
                    alternatives.setdefault(self.tt(tid), lp)
                tops.append(alternatives)
        if index is not None:
            self.next_offset[index] = (pos, chars)
        return {
            "tokens": tokens,
            "token_logprobs": lps,
            "top_logprobs": tops if top_n else None,
            "text_offset": offsets,
        }

    def _choice(
        self, index: int, st: ReqState, text: str, start_lp: int, echo: bool, finish: Optional[str], streamed: bool
    ) -> dict:
        choice = {"index": index, "text": text, "logprobs": None, "finish_reason": finish}
        if finish is not None:
            choice["matched_stop"] = matched_stop(st)
        if self.req.logprobs is not None:
            choice["logprobs"] = self.logprobs(st, start_lp, echo, index if streamed else None)
        if self.req.prompt_logprobs is not None and not streamed:  # vLLM's: each choice's
            choice["prompt_logprobs"] = prompt_logprob_entries(st.acc, self.req.prompt_logprobs, self.tt)
        if self.req.return_hidden_states and finish is not None:
            choice["hidden_states"] = last_row(st.acc.hidden_states or [])
        if self.req.return_token_ids and not streamed:
            choice["prompt_token_ids"] = list(self.prompts.ids[index // self.req.n])
            choice["token_ids"] = list(st.acc.output_ids)
        return choice

    def usage(self) -> dict:
        return usage(self.group, self.req.n, [len(x) for x in self.prompts.ids])

    def response(self) -> dict:
        """The whole answer, once every choice finished."""
        echo = self.req.echo
        choices = [
            self._choice(
                i,
                st,
                (self.prompt_text(i // self.req.n) if echo else "") + st.acc.text,
                0,
                echo,
                finish_reason(st),
                streamed=False,
            )
            for i, st in enumerate(self.group.states)
        ]
        return {**self.head, "choices": choices, "usage": self.usage()}

    def render(self, u: ChoiceUpdate) -> list[dict]:
        """A streamed choice's chunk entries for one update (none when it has no news). With
        ``return_token_ids`` the choice's first chunk has the prompt's ids, and each its new ids."""
        first = u.index not in self.opened
        echo_now = self.req.echo and first
        prefix = self.prompt_text(u.index // self.req.n) if echo_now else ""
        # tokens whose text is held back (a partial character, a possible stop) still send their logprobs
        new_logprobs = self.req.logprobs is not None and len(u.state.acc.output_token_logprobs) > u.start_lp
        ids = u.new_ids() if self.req.return_token_ids else []
        if not u.delta and not prefix and u.finish_reason is None and not new_logprobs and not ids:
            return []
        self.opened.add(u.index)
        choice = self._choice(u.index, u.state, prefix + u.delta, u.start_lp, echo_now, u.finish_reason, streamed=True)
        if self.req.return_token_ids:
            if first:
                choice["prompt_token_ids"] = list(self.prompts.ids[u.index // self.req.n])
            choice["token_ids"] = ids
        return [choice]

    def stream(self) -> AsyncIterator[bytes]:
        usage = self.usage if _include_usage(self.req) else None
        return stream_choices(self.group, self.head, self.render, usage, None, _continuous_usage(self.req))


# ---------------------------------------------------------------------- /v1/chat/completions
class ChatView:
    """The answer to one /v1/chat/completions request, whole or streamed.

    With ``parser`` (tool calls are on) each choice's text is read for calls:
    a choice that made any has ``message.tool_calls`` (streamed as
    ``delta.tool_calls``) and ``finish_reason: "tool_calls"``. With
    ``reasoning`` the ``<think>`` block goes to ``reasoning_content`` and ``reasoning``.
    ``remember`` sees each finished choice's text and tokens
    (radixrt/server/tools/turns.py)."""

    def __init__(
        self,
        req: ChatCompletionRequest,
        group: ReqGroup,
        prompt_len: int,
        tokenizer: Any,
        model: str,
        parser: Optional[ToolCallParser] = None,
        reasoning: str = "",
        remember: Optional[Callable[[str, list[int]], None]] = None,
    ) -> None:
        self.req, self.group, self.prompt_len = req, group, prompt_len
        self.head = _head("chatcmpl", "chat.completion", model, group)
        self.tt = TokenTexts(tokenizer, req.return_tokens_as_token_ids)
        self.plain = parser is None and not reasoning  # text passes through as content
        self.outputs = [ChoiceOutput(parser, reasoning) for _ in group.states]
        self.remember = remember  # called with each finished choice's text and output ids
        self.reasoning, self.tokenizer = reasoning, tokenizer

    def usage(self) -> dict:
        body = usage(self.group, self.req.n, [self.prompt_len])
        if all(st.acc.finish_reason is not None for st in self.group.states):
            # OpenAI's and SGLang's counts of the reasoning tokens (0 where the output is not split)
            count = reasoning_tokens(self.group, self.reasoning, self.tokenizer, self.req.skip_special_tokens)
            body["completion_tokens_details"] = {"reasoning_tokens": count}
            body["reasoning_tokens"] = count
        return body

    @staticmethod
    def _finish(st: ReqState, calls: bool) -> Optional[str]:
        fr = finish_reason(st)
        return "tool_calls" if calls and fr == "stop" else fr

    def response(self) -> dict:
        """The whole answer, once every choice finished."""
        choices = []
        for i, st in enumerate(self.group.states):
            if self.remember is not None and st.acc.finish_reason is not None:
                self.remember(st.acc.text, list(st.acc.output_ids))
            if self.plain:
                message, calls = {"role": "assistant", "content": st.acc.text, **reasoning_fields(None)}, False
            else:
                message, calls = self.outputs[i].message(st.acc.text)
            choice = {
                "index": i,
                "message": message,
                "logprobs": {"content": self._entries(st, 0)} if self.req.logprobs else None,
                "finish_reason": self._finish(st, calls and self.outputs[i].has_whole_calls(st.acc.text)),
                "matched_stop": matched_stop(st),  # SGLang's
            }
            if self.req.return_hidden_states:
                choice["hidden_states"] = last_row(st.acc.hidden_states or [])
            choices.append({**choice, **self._token_fields(st)})
        body = {**self.head, "choices": choices, "usage": self.usage()}
        if self.req.return_token_ids:
            body["prompt_token_ids"] = self._prompt_ids()
        if self.req.prompt_logprobs is not None and self.group.states:  # vLLM's: the response's
            body["prompt_logprobs"] = prompt_logprob_entries(
                self.group.states[0].acc, self.req.prompt_logprobs, self.tt
            )
        return body

    def _entries(self, st: ReqState, start: int) -> list[dict]:
        return logprob_entries(self.tt, st, start, self.req.top_logprobs or 0)

    def _prompt_ids(self) -> list[int]:
        return list(self.group.states[0].input_ids) if self.group.states else []

    def _token_fields(self, st: ReqState) -> dict:
        """A whole choice's ids and metadata where asked: vLLM's ``token_ids``,
        SGLang's ``prompt_token_ids`` and ``meta_info`` (its /generate meta_info)."""
        out: dict[str, Any] = {}
        if self.req.return_token_ids:
            out["token_ids"] = list(st.acc.output_ids)
        if self.req.return_prompt_token_ids:
            out["prompt_token_ids"] = list(st.input_ids)
        if self.req.return_meta_info:
            out["meta_info"] = st.acc.to_dict()["meta_info"]
        return out

    def render(self, u: ChoiceUpdate) -> list[dict]:
        """Content / reasoning / tool-call deltas (the first with the logprobs and, with
        ``return_token_ids``, the new output ids; the others with none) and a closing
        entry with the finish reason."""
        out = []
        lp = {"content": self._entries(u.state, u.start_lp)} if self.req.logprobs else None
        ids = u.new_ids() if self.req.return_token_ids else None
        deltas = output_deltas(self.outputs[u.index], self.plain, u)
        if not self.plain and not self.req.stream_reasoning:
            deltas = self.outputs[u.index].hold_reasoning(deltas, u.finish_reason is not None)
        if not deltas and ((lp and lp["content"]) or ids):
            deltas = [{"content": ""}]
        for j, d in enumerate(deltas):
            d = {**d, **reasoning_fields(d.get("reasoning_content"))}  # always keys, null without any (SGLang's)
            entry = {"index": u.index, "delta": d, "logprobs": lp if j == 0 else None, "finish_reason": None}
            if ids is not None:
                entry["token_ids"] = ids if j == 0 else []
            out.append(entry)
        if u.finish_reason is not None:
            if self.remember is not None:
                self.remember(u.state.acc.text, list(u.state.acc.output_ids))
            calls = not self.plain and self.outputs[u.index].has_whole_calls(u.state.acc.text)
            finish = self._finish(u.state, calls)
            closing = {
                "index": u.index,
                "delta": reasoning_fields(None),
                "logprobs": None,
                "finish_reason": finish,
                "matched_stop": matched_stop(u.state),
            }
            if ids is not None:
                closing["token_ids"] = []
            out.append(closing)
            if self.req.return_hidden_states:  # SGLang's: an entry of its own after the choice's last
                row = last_row(u.state.acc.hidden_states or [])
                out.append({"index": u.index, "delta": {"hidden_states": row}, "logprobs": None, "finish_reason": None})
        return out

    def stream(self) -> AsyncIterator[bytes]:
        head = {**self.head, "object": "chat.completion.chunk"}
        opening = [
            {
                "index": i,
                "delta": {"role": "assistant", "content": "", **reasoning_fields(None)},
                "logprobs": None,
                "finish_reason": None,
            }
            for i in range(self.req.n)
        ]
        usage = self.usage if _include_usage(self.req) else None
        first_head = {**head, "prompt_token_ids": self._prompt_ids()} if self.req.return_token_ids else None
        return stream_choices(self.group, head, self.render, usage, opening, _continuous_usage(self.req), first_head)
