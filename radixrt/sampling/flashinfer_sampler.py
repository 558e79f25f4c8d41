"""Optional GPU sampling with FlashInfer's fused top-k/top-p kernels.

The default sampler (`radixrt.sampling.sampler.Sampler`) draws each request's token from
a counter-based hash of (seed, output index): a request gives the same tokens
whatever batch it runs in, on CPU and GPU alike. That is the reproducible
path and stays the default (``EngineConfig.sampling_backend = "radixrt"``).

``sampling_backend = "flashinfer"`` trades that for speed on CUDA: rows that
sample (temperature > 0) without ``min_p`` draw with
``flashinfer.sampling.top_k_top_p_sampling_from_probs`` (rejection sampling
in one kernel, no sort). Everything before the draw is the default sampler's
(logit_bias, penalties, min_new_tokens and grammar masks, greedy rows, raw
logprobs); rows with ``min_p`` keep the default draw. Each row's Philox
stream is keyed by its request seed and output index, so a fixed batch
replays identically, but FlashInfer also mixes in the row's position in the
batch: the same request in another batch draws differently, and results do
not match the CPU path. The distribution is the same (top-k first, then top-p
over the renormalized top-k set).
"""

from __future__ import annotations

from typing import Any, Iterable, Optional

import torch

from radixrt.sampling.rows import SamplingRow
from radixrt.sampling.sampler import Sampler

_SEED_MASK = (1 << 63) - 1


class FlashInferSampler(Sampler):
    """`Sampler` whose top-k/top-p draws run FlashInfer's sampling kernel."""

    def __init__(
        self, vocab_size: int, eos_token_ids: Iterable[int], flashinfer_module: Any = None, require_cuda: bool = True
    ) -> None:
        super().__init__(vocab_size, eos_token_ids)
        if flashinfer_module is None:
            from radixrt.kernels.flashinfer_backend import import_flashinfer

            flashinfer_module = import_flashinfer()
        self.fi = flashinfer_module
        self.require_cuda = require_cuda  # False: let the CPU emulation in the tests run the path
        self.kernel_rows = 0  # rows drawn by the kernel (tests, stats)

    def _draw(self, x: torch.Tensor, rows: list[SamplingRow], sampled: list[int]) -> torch.Tensor:
        if self.require_cuda and x.device.type != "cuda":
            return super()._draw(x, rows, sampled)
        params = [rows[i].params for i in sampled]
        fast = [j for j, p in enumerate(params) if p.min_p <= 0.0]
        if not fast:
            return super()._draw(x, rows, sampled)
        device = x.device
        V = x.shape[1]
        idx = torch.tensor([sampled[j] for j in fast], dtype=torch.long, device=device)
        logits = x.index_select(0, idx).float()
        temps = torch.tensor([params[j].temperature for j in fast], dtype=torch.float32, device=device)
        probs = torch.softmax(logits / temps.unsqueeze(1), dim=1)
        top_k = torch.tensor(
            [params[j].top_k if 0 < params[j].top_k < V else V for j in fast], dtype=torch.int32, device=device
        )
        top_p = torch.tensor([params[j].top_p for j in fast], dtype=torch.float32, device=device)
        seeds = torch.tensor([rows[sampled[j]].seed & _SEED_MASK for j in fast], dtype=torch.int64, device=device)
        offsets = torch.tensor([rows[sampled[j]].output_index for j in fast], dtype=torch.int64, device=device)
        drawn = self.fi.sampling.top_k_top_p_sampling_from_probs(
            probs, top_k, top_p, deterministic=True, seed=seeds, offset=offsets
        ).to(torch.long)
        self.kernel_rows += len(fast)
        if len(fast) == len(sampled):
            return drawn
        tokens = torch.empty(len(sampled), dtype=torch.long, device=device)
        tokens[torch.tensor(fast, dtype=torch.long, device=device)] = drawn
        fast_set = set(fast)
        slow = [j for j in range(len(sampled)) if j not in fast_set]
        tokens[torch.tensor(slow, dtype=torch.long, device=device)] = super()._draw(x, rows, [sampled[j] for j in slow])
        return tokens


def create_sampler(
    backend: str, vocab_size: int, eos_token_ids: Iterable[int], device: str, flashinfer_module: Optional[Any] = None
) -> Sampler:
    """``"radixrt"`` (default, reproducible) or ``"flashinfer"`` (CUDA only; on CPU the default)."""
    if backend == "flashinfer" and (device.startswith("cuda") or flashinfer_module is not None):
        return FlashInferSampler(vocab_size, eos_token_ids, flashinfer_module, require_cuda=flashinfer_module is None)
    if backend not in ("radixrt", "flashinfer"):
        raise ValueError(f"unknown sampling_backend {backend!r}; choose radixrt or flashinfer")
    return Sampler(vocab_size, eos_token_ids)
