"""Batched next-token sampling.

One call of ``Sampler.sample`` turns the last-position logits of a batch of
requests (``[B, V]`` float32, any device) into one token per row. Each row
carries its own ``SamplingParams``, seed, prompt and output so far.

Pipeline, in this order (each stage runs only when some row needs it):

1. ``logit_bias``: ``logit[t] += bias[t]``.
2. Penalties. Repetition (Hugging Face semantics, over the ids of prompt and
   output): for every seen token, a positive logit is divided by the penalty
   and a negative one multiplied by it. Frequency and presence (OpenAI
   semantics, over output tokens only):
   ``logit[t] -= frequency * count[t] + presence * (count[t] > 0)``.
3. ``min_new_tokens``: while ``output_index < min_new_tokens`` the eos ids
   and the row's ``stop_token_ids`` are set to ``-inf`` (whatever
   ``ignore_eos`` says); so are the tokens outside ``allowed_token_ids`` and
   those ``bad_words_ids`` ban at this position (token_filters.py).
3b. Grammar masks (constrained decoding, see grammar.py): rows given a token
   bitmask get ``-inf`` on every token their grammar disallows. The grammar
   wins: a row left with no finite logit (its grammar allows only tokens that
   ``logit_bias`` or ``min_new_tokens`` removed) samples from its raw logits
   under the grammar mask alone.
4. Greedy rows (``params.is_greedy``) take the argmax of the result.
5. Other rows: divide by temperature; top-k keeps the tokens whose logit is
   at least the k-th largest; top-p keeps the smallest head of the sorted
   distribution whose mass reaches ``top_p`` (computed on the top-k-filtered
   distribution); min-p drops tokens with ``prob < min_p * max_prob``. The
   kept sets are defined by value thresholds, so tokens tied at a boundary are
   all kept and the set does not depend on how a sort breaks ties.

Reproducibility. The randomness of row ``r`` at output index
``i = r.output_index`` comes from a counter-based hash of
``(r.seed, i, attempt)`` computed in Python (``draw_uniform``): it depends on
nothing else, so a request gives the same tokens whatever the batch it runs in
and when it is recomputed after being retracted, and the draws are the same on
CPU and GPU (bit-identical tokens still need bit-identical logits, and a
different float rounding can move a token that sits exactly on a boundary).
A draw is one uniform number ``u`` per row, turned into a token by inverse-CDF
sampling over the kept weights in token-id order: exact, vectorized, and with
no per-row noise tensor. Over the full vocabulary it runs in two levels
(256-wide block sums, then a cumsum inside one block) because a full-width
cumsum is the slowest op on CPU.

Two paths, chosen per row from its own parameters only:

* ``0 < top_k <= candidate_top_k``: one ``topk`` gives the candidates;
  softmax, top-p (exact, by cumsum over the sorted candidates) and min-p run
  on those k values alone. If the k-th and (k+1)-th logits tie, the set is
  ambiguous and the row takes the full path (tie-inclusive).
* otherwise (the full path): softmax over the vocabulary, min-p and top-k as
  value thresholds, and top-p by rejection instead of a full sort (a sort of
  ``[32, 49152]`` costs tens of milliseconds on CPU): draw from the current
  candidates; if the token lies outside the nucleus (the mass of strictly
  more probable tokens is >= top_p), drop it and every token no more probable
  than it, and draw again with the next ``attempt``. Accepted tokens follow
  exactly the renormalized nucleus distribution; one or two rounds are
  typical, and after ``max_rejection_rounds`` the remaining rows fall back to
  an exact sort.

``Sampler.sampling_probs`` states the resulting distribution row by row with a
plain sort; the tests hold the fast paths to it.

Logprobs are those of the RAW logits (``log_softmax`` before bias, penalties,
temperature and filtering), as vLLM reports them by default; columns beyond
``vocab_size`` are ignored (see below). ``top_logprobs`` are the top-N
``(logprob, token_id)`` pairs of that same raw distribution.

The logits may have more columns than ``vocab_size`` (models pad their
embedding); only the first ``vocab_size`` columns are used, so padding ids are
never sampled.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional, Sequence, Union

import torch

from radixrt.sampling.draws import TokenDrawer, draw_uniform, nucleus_mask
from radixrt.sampling.logit_processing import apply_grammar, process_logits
from radixrt.sampling.rows import SamplingRow, long_tensor

# SamplingRow (rows.py) and draw_uniform (draws.py) are re-exported: callers import them from here
__all__ = ["SamplingRow", "SampleResult", "Sampler", "token_logprobs", "draw_uniform"]


@dataclass
class SampleResult:
    token_ids: list[int]
    # Raw logprob of each chosen token when any row asked (return_logprob or
    # top_logprobs_num > 0); None for the rows that did not ask.
    logprobs: Optional[list[Optional[float]]]
    # Per row: top-N (logprob, token_id) of the raw distribution, best first;
    # None for rows with top_logprobs_num == 0.
    top_logprobs: list[Optional[list[tuple[float, int]]]]
    # Per row: a beam search row's best continuations, (logprob, token_id) best first (see
    # `beam_candidates`); None for other rows, or for all when no row is a beam's.
    beam_candidates: Optional[list[Optional[list[tuple[float, int]]]]] = None
    # Per row: (logprob, token_id) of each of the row's ``token_ids_logprob``, in its order; None for
    # other rows, or for all when no row asked.
    token_ids_logprobs: Optional[list[Optional[list[tuple[float, int]]]]] = None


class Sampler(TokenDrawer):
    """Samples one token per row. No state carries from one call to the next
    (everything a draw depends on is in the rows), but on CPU it keeps a few
    [B, V] float32 work buffers (see ``TokenDrawer._workspace``), so one
    Sampler must not be used from two threads at once."""

    def __init__(self, vocab_size: int, eos_token_ids: Iterable[int]):
        super().__init__()
        self.vocab_size = int(vocab_size)
        self.eos_token_ids = tuple(sorted({int(t) for t in eos_token_ids}))

    def sample(
        self,
        logits: torch.Tensor,
        rows: list[SamplingRow],
        token_bitmask: Optional[torch.Tensor] = None,
        masked_rows: Optional[list[int]] = None,
    ) -> SampleResult:
        """One token per row. ``token_bitmask`` (int32 ``[len(masked_rows), ceil(V/32)]``,
        xgrammar's packed layout, any device) restricts rows ``masked_rows`` to
        the tokens their grammar allows (stage 3b)."""
        raw = self._raw(logits, rows)
        B = raw.shape[0]
        if B == 0:
            return SampleResult([], None, [])
        x = self._process(raw, rows)
        if masked_rows:
            x = apply_grammar(raw, x, token_bitmask, masked_rows)
        device = x.device

        greedy = [i for i, r in enumerate(rows) if r.params.is_greedy]
        if len(greedy) == B:
            # the first maximum of each row, as argmax gives, but faster on the CPU for B > 1
            tokens = x.max(dim=1).indices
        else:
            sampled = [i for i, r in enumerate(rows) if not r.params.is_greedy]
            drawn = self._draw(x, rows, sampled)
            if not greedy:
                tokens = drawn
            else:
                tokens = torch.empty(B, dtype=torch.long, device=device)
                g_t = long_tensor(greedy, device)
                tokens[g_t] = x.index_select(0, g_t).argmax(dim=1)
                tokens[long_tensor(sampled, device)] = drawn
        token_ids = tokens.tolist()

        want = [i for i, r in enumerate(rows) if r.return_logprob or r.top_logprobs_num > 0]
        logprobs: Optional[list[Optional[float]]] = None
        top: list[Optional[list[tuple[float, int]]]] = [None] * B
        by_id: Optional[list[Optional[list[tuple[float, int]]]]] = None
        if want:
            w_t = long_tensor(want, device)
            sub = raw if len(want) == B else raw.index_select(0, w_t)
            lp = torch.log_softmax(sub, dim=1)
            chosen = lp.gather(1, tokens.index_select(0, w_t).unsqueeze(1)).squeeze(1).tolist()
            logprobs = [None] * B
            for i, v in zip(want, chosen):
                logprobs[i] = v
            n_top = min(max(rows[i].top_logprobs_num for i in want), lp.shape[1])
            if n_top > 0:
                vals, ids = lp.topk(n_top, dim=1)
                vals, ids = vals.tolist(), ids.tolist()
                for j, i in enumerate(want):
                    n = rows[i].top_logprobs_num
                    if n > 0:
                        top[i] = list(zip(vals[j][:n], ids[j][:n]))
            by_id = _token_ids_logprobs(lp, rows, want)
        beams = [i for i, r in enumerate(rows) if r.beam_candidates > 0]
        result = SampleResult(token_ids, logprobs, top, token_ids_logprobs=by_id)
        if beams:
            result.beam_candidates = beam_candidates(raw, x, rows, beams)
        return result

    def process_logits(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """Stages 1-3 (logit_bias, penalties, min_new_tokens): a fresh float32
        [B, V] tensor (V = min(vocab_size, logits columns))."""
        raw = self._raw(logits, rows)
        x = self._process(raw, rows)
        return x.clone() if x is raw else x

    def sampling_probs(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """The exact distribution each row's next token is drawn from, [B, V]
        (one-hot at the argmax for greedy rows), computed row by row with a
        full sort for top-p. The reference for tests, not the hot path."""
        raw = self._raw(logits, rows)
        x = self._process(raw, rows)
        B, V = x.shape
        out = torch.zeros(B, V, dtype=torch.float32, device=x.device)
        for i, r in enumerate(rows):
            p = r.params
            if p.is_greedy:
                out[i, x[i].argmax()] = 1.0
                continue
            s = x[i : i + 1] / p.temperature
            if 0 < p.top_k < V:
                kth = s.topk(p.top_k, dim=1).values[:, -1:]
                s = s.masked_fill(s < kth, float("-inf"))
            q = torch.softmax(s, dim=1)
            keep = torch.ones_like(q, dtype=torch.bool)
            if p.top_p < 1.0:
                keep &= nucleus_mask(q, torch.tensor([p.top_p], device=q.device))
            if p.min_p > 0.0:
                keep &= q >= p.min_p * q.max()
            w = q * keep
            out[i] = (w / w.sum())[0]
        return out

    def _raw(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(f"logits must be [B, V] with B = {len(rows)} rows, got {tuple(logits.shape)}")
        V = min(self.vocab_size, logits.shape[1])
        raw = logits[:, :V] if V < logits.shape[1] else logits
        return raw if raw.dtype == torch.float32 else raw.float()

    def _process(self, raw: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        return process_logits(raw, rows, self.eos_token_ids)


def beam_candidates(
    raw: torch.Tensor, processed: torch.Tensor, rows: list[SamplingRow], beams: list[int]
) -> list[Optional[list[tuple[float, int]]]]:
    """For the beam rows ``beams``: the ``beam_candidates`` best continuations of
    each, as (logprob, token_id) best first. A logprob is the raw
    distribution's (``log_softmax`` of the model's logits, as transformers'
    beam search scores); tokens the processed logits exclude (a grammar's mask,
    ``min_new_tokens``) get ``-inf`` and come last."""
    out: list[Optional[list[tuple[float, int]]]] = [None] * len(rows)
    idx = long_tensor(beams, raw.device)
    lp = torch.log_softmax(raw.index_select(0, idx), dim=1)
    if processed is not raw:
        lp = lp.masked_fill(torch.isneginf(processed.index_select(0, idx)), float("-inf"))
    k = min(max(rows[i].beam_candidates for i in beams), lp.shape[1])
    vals, ids = lp.topk(k, dim=1)
    for j, (v, t) in enumerate(zip(vals.tolist(), ids.tolist())):
        n = rows[beams[j]].beam_candidates
        out[beams[j]] = list(zip(v[:n], t[:n]))
    return out


def _token_ids_logprobs(
    lp: torch.Tensor, rows: list[SamplingRow], want: list[int]
) -> Optional[list[Optional[list[tuple[float, int]]]]]:
    """Each row's ``token_ids_logprob`` read from ``lp`` (the log-softmax of the ``want`` rows, in
    that order); None when no row asks."""
    asking = [(j, i) for j, i in enumerate(want) if rows[i].token_ids_logprob]
    if not asking:
        return None
    out: list[Optional[list[tuple[float, int]]]] = [None] * len(rows)
    for j, i in asking:
        ids = rows[i].token_ids_logprob
        out[i] = list(zip(lp[j, list(ids)].tolist(), ids))
    return out


def token_logprobs(
    logits: torch.Tensor,
    target_ids: Union[torch.Tensor, Sequence[int]],
    top_k: int,
    chunk_elems: int = 1 << 22,
    token_ids: Sequence[int] = (),
) -> tuple[list[float], Optional[list[list[tuple[float, int]]]], Optional[list[list[tuple[float, int]]]], list[int]]:
    """Logprob of ``target_ids[t]`` under ``log_softmax(logits[t])`` for each of
    the T rows (prompt logprobs), the top-``top_k`` (logprob, token_id)
    pairs per row when ``top_k > 0`` (else None), the (logprob, token_id) of
    each of ``token_ids`` per row when any is given (else None), and each target's
    rank (1 + the number of tokens more likely: vLLM's ``rank``). Works in row
    chunks of about ``chunk_elems`` values so long prompts do not allocate a [T, V] copy."""
    T, V = logits.shape
    targets = torch.as_tensor(target_ids, dtype=torch.long).to(logits.device)
    if targets.shape != (T,):
        raise ValueError(f"target_ids must have {T} entries, got {tuple(targets.shape)}")
    step = max(1, chunk_elems // max(V, 1))
    lps: list[float] = []
    ranks: list[int] = []
    tops: Optional[list[list[tuple[float, int]]]] = [] if top_k > 0 else None
    by_id: Optional[list[list[tuple[float, int]]]] = [] if token_ids else None
    k = min(top_k, V)
    for start in range(0, T, step):
        lp = torch.log_softmax(logits[start : start + step].float(), dim=1)
        target_lp = lp.gather(1, targets[start : start + step].unsqueeze(1))
        lps.extend(target_lp.squeeze(1).tolist())
        ranks.extend(((lp > target_lp).sum(dim=1) + 1).tolist())
        if tops is not None:
            vals, ids = lp.topk(k, dim=1)
            tops.extend(list(zip(v, i)) for v, i in zip(vals.tolist(), ids.tolist()))
        if by_id is not None:
            by_id.extend(list(zip(v, token_ids)) for v in lp[:, list(token_ids)].tolist())
    return lps, tops, by_id, ranks
