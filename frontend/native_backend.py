"""Backends speaking SGLang's native ``/generate`` protocol.

Requests are dicts in the ``/generate`` body shape (``text`` or
``input_ids``, ``sampling_params``, ``return_logprob``,
``logprob_start_len``, ``top_logprobs_num``, ``return_text_in_logprobs``,
``stream``); responses are ``{"text", "output_ids", "meta_info"}``. The
in-process engine backend and the HTTP endpoint only differ in how a request
travels (:meth:`NativeBackend._request` / :meth:`_request_stream`).
"""

from __future__ import annotations

import math
from typing import Any, Iterator, Optional

from .backend import PLAIN_ROLE_MARKERS, BaseBackend
from .choices import ChoicesDecision, token_length_normalized
from .errors import BackendError
from .sampling_params import SglSamplingParams

# How many prompt tokens before a choice are re-scored, to catch a choice whose
# first token merges with the end of the prompt ("...: " + "Paris" -> ": Paris").
SELECT_BOUNDARY_TOKENS = 2


def _check(resp: Any) -> Any:
    items = resp if isinstance(resp, list) else [resp]
    for r in items:
        if not isinstance(r, dict):
            raise BackendError(f"unexpected response from backend: {r!r}")
        if "error" in r and "text" not in r:
            raise BackendError(f"backend error: {r['error']}")
        fr = (r.get("meta_info") or {}).get("finish_reason")
        if isinstance(fr, dict) and fr.get("type") == "abort":
            raise BackendError(f"request aborted: {fr.get('message', fr)}")
    return resp


def _known_mean(entries: list[list[Any]]) -> float:
    """The mean logprob of a choice's tokens that have one: a choice whose text merges with
    the prompt's first token has none there (nothing precedes it), and an unknown is no
    evidence (it scored 0.0, the best possible, and won). -inf when none is known."""
    known = [float(e[0]) for e in entries if e[0] is not None]
    return sum(known) / len(known) if known else -math.inf


class _StreamFold:
    """Folds a ``/generate`` stream's events into cumulative results.

    Events are cumulative (SGLang's default) or hold only what is new (a
    server run with ``--incremental-streaming-output``). An incremental event
    after the first has fewer ``output_ids`` than its running
    ``completion_tokens``; a cumulative one has as many. (The first event is
    the same either way.)"""

    _OUTPUT_LISTS = ("output_token_logprobs", "output_top_logprobs")

    def __init__(self) -> None:
        self.text = ""
        self.lists: dict[str, list] = {k: [] for k in self._OUTPUT_LISTS}

    def add(self, chunk: dict[str, Any]) -> tuple[str, dict]:
        meta = dict(chunk.get("meta_info") or {})
        ids = chunk.get("output_ids")
        total = meta.get("completion_tokens")
        incremental = isinstance(ids, list) and isinstance(total, int) and len(ids) < total
        text = chunk.get("text") or ""
        self.text = self.text + text if incremental else text
        for key in self._OUTPUT_LISTS:
            if isinstance(meta.get(key), list):
                self.lists[key] = self.lists[key] + meta[key] if incremental else meta[key]
                meta[key] = self.lists[key]
        return self.text, meta


class NativeBackend(BaseBackend):
    def __init__(self) -> None:
        self._markers: dict[str, tuple[str, str]] = dict(PLAIN_ROLE_MARKERS)
        self._default_system: Optional[str] = None

    # transport -----------------------------------------------------------------
    def _request(self, payload: dict[str, Any]) -> Any:
        raise NotImplementedError

    def _request_stream(self, payload: dict[str, Any]) -> Iterator[dict[str, Any]]:
        raise NotImplementedError

    def raw_generate(self, payload: dict[str, Any]) -> Any:
        """Send one ``/generate`` body and return the checked response."""
        return _check(self._request(payload))

    # chat template -------------------------------------------------------------
    def get_role_markers(self) -> dict[str, tuple[str, str]]:
        return dict(self._markers)

    def get_default_system_prompt(self) -> Optional[str]:
        return self._default_system

    # generation ----------------------------------------------------------------
    @staticmethod
    def _payload(text: str, sampling: SglSamplingParams, stream: bool = False) -> dict[str, Any]:
        p: dict[str, Any] = {"text": text, "sampling_params": sampling.to_wire()}
        p.update(sampling.logprob_kwargs())
        if sampling.lora is not None:
            p["lora_path"] = sampling.lora
        if stream:
            p["stream"] = True
        return p

    def generate(self, s: Any, sampling: SglSamplingParams) -> tuple[Any, Any]:
        resp = self.raw_generate(self._payload(s.text_, sampling))
        if isinstance(resp, list):  # n > 1
            return [r["text"] for r in resp], [r.get("meta_info", {}) for r in resp]
        return resp["text"], resp.get("meta_info", {})

    def generate_stream(self, s: Any, sampling: SglSamplingParams) -> Iterator[tuple[str, dict]]:
        """(cumulative text, meta info with cumulative output logprobs) per event."""
        fold = _StreamFold()
        for chunk in self._request_stream(self._payload(s.text_, sampling, stream=True)):
            _check(chunk)
            yield fold.add(chunk)

    def cache_prefix(self, prefix: str) -> None:
        self.raw_generate({"text": prefix, "sampling_params": {"max_new_tokens": 0, "temperature": 0.0}})

    # select ----------------------------------------------------------------------
    def select(
        self, s: Any, choices: list[str], temperature: float, choices_method: Any, lora: Optional[str] = None
    ) -> ChoicesDecision:
        """Score each choice by the log-probabilities of its tokens and of the prompt's
        last token before it (SGLang's select scores the same, so a program picks the
        same choice on either), with prefill-only requests: the prompt is prefilled first (so it
        is computed once and cached), then one ``max_new_tokens=0`` request per
        choice asks for prompt logprobs from just before the choice. ``lora``: the LoRA adapter
        that scores them (None: the base model)."""
        method = choices_method or token_length_normalized
        adapter = {} if lora is None else {"lora_path": lora}
        prefix = s.text_
        head = self.raw_generate(
            {"text": prefix, "sampling_params": {"max_new_tokens": 0, "temperature": 0.0}, **adapter}
        )
        prefix_len = int(head["meta_info"]["prompt_tokens"])
        start = max(prefix_len - SELECT_BOUNDARY_TOKENS, 0)
        texts = [prefix] + [prefix + c for c in choices]
        resps = self.raw_generate(
            {
                "text": texts,
                "sampling_params": {"max_new_tokens": 0, "temperature": 0.0},
                "return_logprob": True,
                "logprob_start_len": start,
                "return_text_in_logprobs": True,
                **adapter,
            }
        )
        tail = [e[1] for e in resps[0]["meta_info"]["input_token_logprobs"]]
        choice_lps: list[list[Any]] = []
        for r in resps[1:]:
            entries = r["meta_info"]["input_token_logprobs"]
            j = 0
            while j < len(entries) and j < len(tail) and entries[j][1] == tail[j]:
                j += 1
            # as SGLang's select: the prompt's last token before the choice counts in its mean too
            choice_lps.append([list(e) for e in entries[max(j - 1, 0) :]])
        normalized = [_known_mean(lps) for lps in choice_lps]

        unconditional = None
        if getattr(method, "requires_unconditional_logprobs", False):
            ids = [[e[1] for e in lps] for lps in choice_lps]
            todo = [i for i, x in enumerate(ids) if x]
            unconditional = [[] for _ in choices]
            if todo:
                ur = self.raw_generate(
                    {
                        "input_ids": [ids[i] for i in todo],
                        "sampling_params": {"max_new_tokens": 0, "temperature": 0.0},
                        "return_logprob": True,
                        "logprob_start_len": 0,
                        "return_text_in_logprobs": True,
                        **adapter,
                    }
                )
                for i, r in zip(todo, ur if isinstance(ur, list) else [ur]):
                    unconditional[i] = [list(e) for e in r["meta_info"]["input_token_logprobs"]]

        decision = method(
            choices=choices,
            normalized_prompt_logprobs=normalized,
            input_token_logprobs=choice_lps,
            output_token_logprobs=[[] for _ in choices],
            unconditional_token_logprobs=unconditional,
        )
        decision.meta_info.setdefault("prompt_tokens", prefix_len)
        decision.meta_info["cached_tokens"] = [r["meta_info"].get("cached_tokens") for r in resps[1:]]
        decision.meta_info["prefix_cached_tokens"] = head["meta_info"].get("cached_tokens")
        return decision
