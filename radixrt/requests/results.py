"""Accumulates a request's TokenOutputs into SGLang's `/generate` result shape.

Shared by the in-process Engine and the HTTP server so both answer alike,
streams included (:meth:`ResultAccumulator.stream_chunk`). With
``return_logprob``, ``meta_info`` carries ``output_token_logprobs_length``
(the number of output logprobs so far), as SGLang's current release does.
"""

from __future__ import annotations

import time
from typing import Any, Optional, Sequence

from radixrt.requests.detokenizer import PROMPT_TAIL_TOKENS, IncrementalDetokenizer
from radixrt.requests.finish import FinishReason
from radixrt.requests.hidden_states import unpack_rows
from radixrt.requests.messages import TokenOutput
from radixrt.requests.no_tokenizer import has_text
from radixrt.sampling.params import SamplingParams


class ResultAccumulator:
    """Owns one request's cumulative text, output ids, meta info and logprobs."""

    def __init__(
        self,
        rid: str,
        tokenizer: Any,
        sampling: SamplingParams,
        return_logprob: bool = False,
        return_text_in_logprobs: bool = False,
        live_text: bool = True,
        token_ids_logprob: bool = False,
        prompt_ids: Sequence[int] = (),
        return_prompt_token_ids: bool = False,
    ) -> None:
        """``live_text`` False: ``text`` is made only when the request
        finishes (the final text is a plain decode of every output id, so it
        is the same); for a result nobody reads before it ends.
        ``token_ids_logprob``: the request named tokens whose logprobs it returns
        (``meta_info.input_token_ids_logprobs`` and ``output_token_ids_logprobs``).
        ``prompt_ids``: the prompt (its last ids are the detokenizer's ``prompt_tail``), in every
        result with ``return_prompt_token_ids`` (SGLang's)."""
        self.rid = rid
        self.live_text = live_text
        self._detok_ids = 0  # output ids handed to the detokenizer
        self.tokenizer = tokenizer
        self.return_logprob = return_logprob
        self.return_text_in_logprobs = return_text_in_logprobs
        self.detok = IncrementalDetokenizer(
            tokenizer,
            skip_special_tokens=sampling.skip_special_tokens,
            spaces_between_special_tokens=sampling.spaces_between_special_tokens,
            stop=sampling.stop or [],
            no_stop_trim=sampling.no_stop_trim,
            stop_regex=sampling.stop_regex or [],
            prompt_tail=prompt_ids[-PROMPT_TAIL_TOKENS:],
        )
        self.text = ""
        self.output_ids: list[int] = []
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.cached_tokens = 0
        self.spec_verify_ct: Optional[int] = None
        self.spec_drafts = (0, 0)  # draft tokens verified, and accepted
        self.kv_budget: Optional[dict[str, Any]] = None  # a request under a KV budget: its figures, at the end
        self.beam: Optional[dict[str, Any]] = None  # a beam search's output: its rank and score, at the end
        self.finish_reason: Optional[FinishReason] = None
        self.output_token_logprobs: list[tuple[float, int]] = []
        self.output_top_logprobs: list[list[tuple[float, int]]] = []
        self.input_token_logprobs: list[tuple[Optional[float], int]] = []
        self.input_top_logprobs: list[Optional[list[tuple[float, int]]]] = []
        self.input_token_ranks: list[Optional[int]] = []  # each prompt token's rank (vLLM's prompt_logprobs)
        # with token_ids_logprob: the named tokens' logprobs per position (None otherwise)
        self.output_token_ids_logprobs: Optional[list[list[tuple[float, int]]]] = [] if token_ids_logprob else None
        self.input_token_ids_logprobs: Optional[list[Optional[list[tuple[float, int]]]]] = (
            [] if token_ids_logprob else None
        )
        self._input_meta: Optional[tuple[list, list, Optional[list]]] = None  # built by _input_logprob_meta
        self.cache_info: Optional[dict[str, Any]] = None  # rendered meta_info.cache_info, once it arrived
        self._streamed = (0, 0, 0)  # text chars, output ids, output logprobs already sent incrementally
        self._started = time.monotonic()
        self.e2e_latency: Optional[float] = None  # seconds from intake to the finish (SGLang's meta_info field)
        self.prompt_token_ids: Optional[list[int]] = list(prompt_ids) if return_prompt_token_ids else None
        self.hidden_states: Optional[list[Any]] = None  # SGLang's return_hidden_states: with the last result
        self.weight_version: Optional[str] = None  # the weights that computed the latest output
        self.num_retractions = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def add(self, out: TokenOutput, text: Optional[str] = None) -> None:
        """Fold in one TokenOutput. ``text`` is the cumulative text when it was
        detokenized elsewhere (the server's detokenizer process)."""
        self.output_ids.extend(out.new_token_ids)
        self.prompt_tokens = out.prompt_tokens
        self.completion_tokens = out.completion_tokens
        self.cached_tokens = out.cached_tokens
        if out.spec_verify_ct is not None:
            self.spec_verify_ct = out.spec_verify_ct
            self.spec_drafts = out.spec_drafts or self.spec_drafts
        if out.kv_budget is not None:
            self.kv_budget = out.kv_budget
        if out.beam is not None:
            self.beam = out.beam
        if out.hidden_states is not None:
            self.hidden_states = unpack_rows(out.hidden_states)
        if out.weight_version is not None:
            self.weight_version = out.weight_version
        if out.num_retractions is not None:
            self.num_retractions = out.num_retractions
        self.finish_reason = out.finish_reason
        if out.finish_reason is not None and self.e2e_latency is None:
            self.e2e_latency = time.monotonic() - self._started
        if text is not None:
            self.text = text
        elif self.live_text or out.finish_reason is not None:
            self.text = self.detok.push(self.output_ids[self._detok_ids :], out.finish_reason)
            self._detok_ids = len(self.output_ids)
        self.output_token_logprobs.extend(out.output_token_logprobs)
        self.output_top_logprobs.extend(out.output_top_logprobs)
        if out.output_token_ids_logprobs and self.output_token_ids_logprobs is not None:
            self.output_token_ids_logprobs.extend(out.output_token_ids_logprobs)
        if out.cache_info is not None:
            from radixrt.memory.radix_explain import render_cache_info

            self.cache_info = render_cache_info(out.cache_info, self.tokenizer.decode)
        if out.input_token_logprobs is not None:
            self.take_input_logprobs(out)

    def take_input_logprobs(self, out: TokenOutput) -> None:
        """The prompt's logprobs ``out`` carries (its request's, or with n > 1 its first sample's:
        the first computes them for all, `ResultRouter`)."""
        assert out.input_token_logprobs is not None
        self.input_token_logprobs = list(out.input_token_logprobs)
        self.input_top_logprobs = list(out.input_top_logprobs or [])
        self.input_token_ranks = list(out.input_token_ranks or [])
        if self.input_token_ids_logprobs is not None:
            self.input_token_ids_logprobs = list(out.input_token_ids_logprobs or [])
        self._input_meta = None

    def _token_text(self, tid: int) -> str:
        cache = self.__dict__.setdefault("_text_cache", {})
        text = cache.get(tid)
        if text is None:
            text = cache[tid] = self.tokenizer.decode([tid])
        return text

    def _triples(self, pairs: Sequence[tuple[Optional[float], int]]) -> list[list]:
        if self.return_text_in_logprobs:
            return [[lp, tid, self._token_text(tid)] for lp, tid in pairs]
        return [[lp, tid, None] for lp, tid in pairs]

    def _input_logprob_meta(self) -> tuple[list, list, Optional[list]]:
        """Prompt logprob triples: the tokens', the top lists and the named tokens' lists (None
        without ``token_ids_logprob``), built once (streamed chunks repeat them)."""
        cached = self.__dict__.get("_input_meta")
        if cached is None:
            by_id = self.input_token_ids_logprobs
            cached = self._input_meta = (
                self._triples(self.input_token_logprobs),
                self._top_triples(self.input_top_logprobs),
                None if by_id is None else self._top_triples(by_id),
            )
        tokens, tops, by_id_lists = cached

        def copy(lists: list) -> list:
            return [None if t is None else [list(x) for x in t] for t in lists]

        return [list(t) for t in tokens], copy(tops), None if by_id_lists is None else copy(by_id_lists)

    def _top_triples(self, tops: list) -> list:
        return [None if t is None else self._triples(t) for t in tops]

    def stream_chunk(self, incremental: bool) -> dict[str, Any]:
        """The next event of a stream, in SGLang's format.

        Default: the result so far (cumulative ``text``, ``output_ids`` and
        output logprobs). ``incremental`` (SGLang's
        ``--incremental-streaming-output``): only what is new since this
        request's previous event: ``text``, ``output_ids``,
        ``output_token_logprobs`` and ``output_top_logprobs``; counts
        (``completion_tokens``, ``output_token_logprobs_length``) stay running
        totals and the prompt's logprobs are repeated in every event, as SGLang
        sends them."""
        if not incremental:
            return self.to_dict()
        out = self.to_dict(since=self._streamed)
        self._streamed = (len(self.text), len(self.output_ids), len(self.output_token_logprobs))
        return out

    def to_dict(self, since: tuple[int, int, int] = (0, 0, 0)) -> dict[str, Any]:
        """The result so far; ``since`` (text characters, output ids, output
        logprobs) leaves out what an incremental stream already sent."""
        chars, ids, lps = since
        meta: dict[str, Any] = {
            "id": self.rid,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "cached_tokens": self.cached_tokens,
            "finish_reason": None if self.finish_reason is None else self.finish_reason.to_dict(),
            "num_retractions": self.num_retractions,
        }
        if self.weight_version is not None:  # SGLang's: the weights' label (update_weights_from_*)
            meta["weight_version"] = self.weight_version
        if self.e2e_latency is not None:
            meta["e2e_latency"] = self.e2e_latency
        if self.spec_verify_ct is not None:  # SGLang's name; and the tokens each verification gave
            meta["spec_verify_ct"] = self.spec_verify_ct
            decoded = max(self.completion_tokens - 1, 0)  # the first token comes from the prefill
            meta["spec_accept_length"] = decoded / self.spec_verify_ct if self.spec_verify_ct else 0.0
            proposed, correct = self.spec_drafts  # SGLang's names: draft tokens verified, and accepted
            meta["spec_num_proposed_drafts"], meta["spec_num_correct_drafts"] = proposed, correct
            meta["spec_accept_rate"] = correct / proposed if proposed else 0.0
        if self.cache_info is not None:
            meta["cache_info"] = dict(self.cache_info)
        if self.kv_budget is not None:
            meta["kv_budget"] = dict(self.kv_budget)
        if self.beam is not None:
            meta["beam"] = dict(self.beam)
        if self.hidden_states is not None:
            meta["hidden_states"] = self.hidden_states
        if self.return_logprob:
            meta["input_token_logprobs"], meta["input_top_logprobs"], by_id = self._input_logprob_meta()
            meta["output_token_logprobs"] = self._triples(self.output_token_logprobs[lps:])
            meta["output_top_logprobs"] = self._top_triples(self.output_top_logprobs[lps:])
            meta["output_token_logprobs_length"] = len(self.output_token_logprobs)
            if self.output_token_ids_logprobs is not None:
                meta["input_token_ids_logprobs"] = by_id
                meta["output_token_ids_logprobs"] = self._top_triples(self.output_token_ids_logprobs[lps:])
        out = {"text": self.text[chars:], "output_ids": self.output_ids[ids:], "meta_info": meta}
        if not has_text(self.tokenizer):  # token ids only, as SGLang's --skip-tokenizer-init
            del out["text"]
        if self.prompt_token_ids is not None:
            out["prompt_token_ids"] = self.prompt_token_ids
        return out
