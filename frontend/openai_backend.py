"""Any OpenAI-compatible server, through the official ``openai`` package.

Chat models (the default) receive the program's *messages*: a ``gen`` must
sit at the start of an assistant turn. Completion models
(``is_chat_model=False``) receive the program's text. What the OpenAI API
cannot express raises :class:`UnsupportedByBackendError` with the reason:

* ``regex`` / ``ebnf`` / ``stop_regex`` constraints (``json_schema`` maps to
  ``response_format`` on chat models);
* prompt log-probabilities (``logprob_start_len``), and so ``select`` on chat
  models; on completion models ``select`` scores choices with
  ``echo=True, logprobs`` when the server supports it;
* images.

Sampling options outside the OpenAI schema (``top_k``, ``min_p``,
``repetition_penalty``, ``min_tokens``, ``ignore_eos``, ``stop_token_ids``)
travel in ``extra_body``, which OpenAI-compatible servers (radixrt, SGLang,
vLLM) accept and OpenAI itself rejects.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from typing import Any, Iterator, Optional

from .backend import PLAIN_ROLE_MARKERS, BaseBackend, normalize_markers
from .choices import ChoicesDecision, token_length_normalized
from .errors import BackendError, UnsupportedByBackendError
from .sampling_params import SglSamplingParams

_COMPLETION_ONLY_MODELS = ("gpt-3.5-turbo-instruct", "davinci-002", "babbage-002")


@dataclass
class TokenUsage:
    """SGLang's running count of the tokens an OpenAI backend's calls used (``backend.token_usage``)."""

    prompt_tokens: int = 0
    completion_tokens: int = 0

    def reset(self) -> None:
        self.prompt_tokens = self.completion_tokens = 0

    def add(self, usage: Any) -> None:
        self.prompt_tokens += getattr(usage, "prompt_tokens", 0) or 0
        self.completion_tokens += getattr(usage, "completion_tokens", 0) or 0


class OpenAI(BaseBackend):
    def __init__(
        self,
        model_name: str,
        base_url: Optional[str] = None,
        api_key: Optional[str] = None,
        is_chat_model: Optional[bool] = None,
        chat_template: Optional[dict] = None,
        client: Any = None,
        **client_kwargs: Any,
    ) -> None:
        try:
            import openai  # lazy: only this backend needs it
        except ImportError as e:  # pragma: no cover - depends on the environment
            raise ImportError("the OpenAI backend needs the `openai` package: pip install openai") from e
        self._openai = openai
        self.model_name = model_name
        if is_chat_model is None:
            is_chat_model = model_name not in _COMPLETION_ONLY_MODELS
        self.is_chat_model = bool(is_chat_model)
        if client is None:
            if api_key is None:
                api_key = os.environ.get("OPENAI_API_KEY") or ("EMPTY" if base_url else None)
            client = openai.OpenAI(base_url=base_url, api_key=api_key, **client_kwargs)
        self.client = client
        self.base_url = base_url
        self._markers = normalize_markers(chat_template) or dict(PLAIN_ROLE_MARKERS)
        self.token_usage = TokenUsage()  # every answer's usage, added up (SGLang's)

    def get_role_markers(self) -> dict[str, tuple[str, str]]:
        return dict(self._markers)

    # helpers ---------------------------------------------------------------------------
    def _check_expressible(self, sp: SglSamplingParams) -> None:
        what = []
        if sp.regex is not None:
            what.append("regex")
        if sp.ebnf is not None:
            what.append("ebnf")
        if sp.stop_regex is not None:
            what.append("stop_regex")
        if sp.logprob_start_len is not None and sp.return_logprob:
            what.append("prompt logprobs (logprob_start_len)")
        if sp.json_schema is not None and not self.is_chat_model:
            what.append("json_schema on a completion model")
        if sp.lora is not None:
            what.append(f"a LoRA adapter (lora={sp.lora[:64]!r})")
        if sp.dtype is not None and self.is_chat_model:  # as SGLang's backend (a completion model repairs it)
            what.append(
                f"a typed gen (dtype {getattr(sp.dtype, '__name__', sp.dtype)}, gen_int, gen_string) on a chat model"
            )
        if what:
            raise UnsupportedByBackendError(
                f"the OpenAI API cannot express {', '.join(what)}; use radixrt.Engine or RuntimeEndpoint "
                f"for constrained decoding, prompt logprobs and adapters"
            )

    def _common_kwargs(self, sp: SglSamplingParams) -> dict[str, Any]:
        kw: dict[str, Any] = {"model": self.model_name}
        if sp.max_new_tokens is not None:
            kw["max_tokens"] = sp.max_new_tokens
        if sp.temperature is not None:
            kw["temperature"] = sp.temperature
        if sp.top_p is not None:
            kw["top_p"] = sp.top_p
        if sp.stop:
            kw["stop"] = [sp.stop] if isinstance(sp.stop, str) else list(sp.stop)
        if sp.n and sp.n > 1:
            kw["n"] = sp.n
        if sp.frequency_penalty:
            kw["frequency_penalty"] = sp.frequency_penalty
        if sp.presence_penalty:
            kw["presence_penalty"] = sp.presence_penalty
        if sp.seed is not None:
            kw["seed"] = sp.seed
        extra: dict[str, Any] = {}
        if sp.top_k is not None and sp.top_k > 0:
            extra["top_k"] = sp.top_k
        if sp.min_p:
            extra["min_p"] = sp.min_p
        if sp.repetition_penalty not in (None, 1.0):
            extra["repetition_penalty"] = sp.repetition_penalty
        if sp.min_new_tokens:
            extra["min_tokens"] = sp.min_new_tokens
        if sp.ignore_eos:
            extra["ignore_eos"] = True
        if sp.stop_token_ids:
            extra["stop_token_ids"] = list(sp.stop_token_ids)
        for name in ("beam_width", "length_penalty", "early_stopping"):  # a radixrt server's beam search
            if getattr(sp, name) is not None:
                extra[name] = getattr(sp, name)
        if extra:
            kw["extra_body"] = extra
        return kw

    def _chat_messages(self, s: Any) -> list[dict[str, str]]:
        if s.cur_role != "assistant" or s.text_[s.cur_role_begin_pos :] != "":
            raise UnsupportedByBackendError(
                "with an OpenAI chat model, gen must come first in an assistant turn: "
                "write s += assistant(gen(...)) after the user turn"
            )
        return [dict(m) for m in s.messages_]

    def _call(self, fn: Any, **kw: Any) -> Any:
        try:
            resp = fn(**kw)
        except self._openai.OpenAIError as e:
            raise BackendError(f"OpenAI API error: {e}") from e
        if not kw.get("stream") and getattr(resp, "usage", None) is not None:  # a stream reports none here
            self.token_usage.add(resp.usage)
        return resp

    @staticmethod
    def _finish(reason: Optional[str]) -> dict:
        if reason in ("length",):
            return {"type": "length"}
        if reason is None:
            return None
        return {"type": "stop" if reason in ("stop", "tool_calls", "function_call") else reason}

    def _meta(self, resp: Any, choice: Any) -> dict[str, Any]:
        usage = getattr(resp, "usage", None)
        meta: dict[str, Any] = {
            "id": getattr(resp, "id", None),
            "prompt_tokens": getattr(usage, "prompt_tokens", None),
            "completion_tokens": getattr(usage, "completion_tokens", None),
            "cached_tokens": getattr(getattr(usage, "prompt_tokens_details", None), "cached_tokens", None),
            "finish_reason": self._finish(getattr(choice, "finish_reason", None)),
        }
        lp = getattr(choice, "logprobs", None)
        if lp is not None:
            if getattr(lp, "content", None) is not None:  # chat
                meta["output_token_logprobs"] = [[t.logprob, None, t.token] for t in lp.content]
                meta["output_top_logprobs"] = [
                    [[x.logprob, None, x.token] for x in (t.top_logprobs or [])] for t in lp.content
                ]
            elif getattr(lp, "token_logprobs", None) is not None:  # completions
                meta["output_token_logprobs"] = [[v, None, t] for v, t in zip(lp.token_logprobs, lp.tokens)]
        return meta

    # generation ------------------------------------------------------------------------
    def _request_kwargs(self, s: Any, sp: SglSamplingParams, stream: bool) -> tuple[Any, dict[str, Any]]:
        self._check_expressible(sp)
        kw = self._common_kwargs(sp)
        if stream:
            kw["stream"] = True
        if self.is_chat_model:
            kw["messages"] = self._chat_messages(s)
            if sp.return_logprob:
                kw["logprobs"] = True
                if sp.top_logprobs_num:
                    kw["top_logprobs"] = sp.top_logprobs_num
            if sp.json_schema is not None:
                schema = json.loads(sp.json_schema) if isinstance(sp.json_schema, str) else sp.json_schema
                kw["response_format"] = {"type": "json_schema", "json_schema": {"name": "output", "schema": schema}}
            return self.client.chat.completions.create, kw
        kw["prompt"] = s.text_
        if sp.return_logprob:
            kw["logprobs"] = max(1, sp.top_logprobs_num or 1)
        return self.client.completions.create, kw

    def generate(self, s: Any, sp: SglSamplingParams) -> tuple[Any, Any]:
        fn, kw = self._request_kwargs(s, sp, stream=False)
        resp = self._call(fn, **kw)
        texts, metas = [], []
        for c in resp.choices:
            texts.append((c.message.content or "") if self.is_chat_model else (c.text or ""))
            metas.append(self._meta(resp, c))
        if sp.n and sp.n > 1:
            return texts, metas
        return texts[0], metas[0]

    def generate_stream(self, s: Any, sp: SglSamplingParams) -> Iterator[tuple[str, dict]]:
        if sp.n and sp.n > 1:
            yield self.generate(s, sp)
            return
        fn, kw = self._request_kwargs(s, sp, stream=True)
        text = ""
        meta: dict[str, Any] = {}
        for chunk in self._call(fn, **kw):
            if not chunk.choices:
                continue
            c = chunk.choices[0]
            piece = (c.delta.content or "") if self.is_chat_model else (c.text or "")
            text += piece
            meta = {"id": chunk.id, "finish_reason": self._finish(getattr(c, "finish_reason", None))}
            yield text, meta

    # select ----------------------------------------------------------------------------
    def _echo_logprobs(self, prompts: list[str], starts: list[int], ends: list[int]) -> list[list[list[Any]]]:
        resp = self._call(
            self.client.completions.create,
            model=self.model_name,
            prompt=prompts,
            max_tokens=1,
            temperature=0.0,
            echo=True,
            logprobs=1,
        )
        out: list[list[list[Any]]] = [[] for _ in prompts]
        for c in resp.choices:
            lp = c.logprobs
            if lp is None or lp.text_offset is None:
                raise UnsupportedByBackendError("the server did not return echoed prompt logprobs; select needs them")
            i = c.index
            lo = max(starts[i] - 1, 0)  # from the token holding the prompt's last character on, as select scores
            offsets = list(lp.text_offset)
            for k, (tok, off, v) in enumerate(zip(lp.tokens, offsets, lp.token_logprobs)):
                # a token ends where the next begins (its label is no measure: "bytes:\\xe6\\x97" covers part
                # of one character), and covers at least the character it starts in
                end = max(offsets[k + 1] if k + 1 < len(offsets) else off, off + 1)
                if end > lo and off < ends[i]:
                    out[i].append([v, None, tok])
        return out

    def select(
        self, s: Any, choices: list[str], temperature: float, choices_method: Any, lora: Optional[str] = None
    ) -> ChoicesDecision:
        if lora is not None:
            raise UnsupportedByBackendError(
                f"the OpenAI API cannot express a LoRA adapter (lora={lora[:64]!r}); use radixrt.Engine or "
                "RuntimeEndpoint"
            )
        if self.is_chat_model:
            raise UnsupportedByBackendError(
                "select/choices need prompt log-probabilities, which the OpenAI chat API does not return; "
                "use OpenAI(..., is_chat_model=False) against a completions endpoint that supports "
                "echo+logprobs, or radixrt.Engine / RuntimeEndpoint"
            )
        method = choices_method or token_length_normalized
        prefix = s.text_
        cond = self._echo_logprobs(
            [prefix + c for c in choices], [len(prefix)] * len(choices), [len(prefix) + len(c) for c in choices]
        )
        normalized = [sum((e[0] or 0.0) for e in x) / len(x) if x else -math.inf for x in cond]
        uncond = None
        if getattr(method, "requires_unconditional_logprobs", False):
            uncond = self._echo_logprobs(list(choices), [0] * len(choices), [len(c) for c in choices])
        return method(
            choices=choices,
            normalized_prompt_logprobs=normalized,
            input_token_logprobs=cond,
            output_token_logprobs=[[] for _ in choices],
            unconditional_token_logprobs=uncond,
        )

    def get_server_info(self) -> dict:
        return {
            "backend": "openai",
            "model": self.model_name,
            "base_url": self.base_url,
            "is_chat_model": self.is_chat_model,
        }
