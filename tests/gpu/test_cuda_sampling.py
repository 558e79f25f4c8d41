"""FlashInfer sampling (optional backend): the glue around the kernel checked on CPU
through the emulation (temperature, per-row top-k/top-p, greedy and min_p rows
left to the default sampler, row order), and the real kernel's distribution on CUDA."""

from __future__ import annotations

import pytest
import torch

from radixrt.sampling.flashinfer_sampler import FlashInferSampler, create_sampler
from radixrt.sampling.params import SamplingParams
from radixrt.sampling.sampler import Sampler, SamplingRow
from tests.support import fake_flashinfer

V = 40


def _row(seed: int, out_len: int = 0, **params) -> SamplingRow:
    return SamplingRow(params=SamplingParams(**params), seed=seed, output_ids=[7] * out_len, prompt_ids=[1, 2])


def _tv(samples: torch.Tensor, probs: torch.Tensor) -> float:
    freq = torch.bincount(samples, minlength=probs.numel()).double() / samples.numel()
    return 0.5 * float((freq - probs.double()).abs().sum())


def _sampler(device: str = "cpu", module=fake_flashinfer) -> FlashInferSampler:
    return FlashInferSampler(V, [2], flashinfer_module=module, require_cuda=(device != "cpu"))


def test_kernel_draws_follow_the_reference_distribution():
    torch.manual_seed(0)
    logits = torch.randn(1, V) * 2
    params = dict(temperature=0.7, top_k=12, top_p=0.85)
    exact = Sampler(V, [2]).sampling_probs(logits, [_row(0, **params)])[0]
    n = 3000
    rows = [_row(s, **params) for s in range(n)]
    s = _sampler()
    res = s.sample(logits.expand(n, V).contiguous(), rows)
    assert s.kernel_rows == n
    toks = torch.tensor(res.token_ids)
    assert bool((exact[toks] > 0).all())  # never outside the top-k/top-p set
    assert _tv(toks, exact) < 0.06


def test_mixed_rows_keep_order_and_default_paths():
    torch.manual_seed(1)
    logits = torch.randn(6, V)
    rows = [
        _row(1, temperature=0.0),  # greedy: argmax
        _row(2, temperature=0.9, top_k=5),  # kernel
        _row(3, temperature=1.0, min_p=0.2),  # default draw (min_p)
        _row(4, 3, temperature=1.2, top_p=0.5),  # kernel
        _row(5, temperature=0.0),
        _row(6, 1, temperature=0.8, min_p=0.05, top_k=7),  # default draw
    ]
    fi = _sampler().sample(logits, rows)
    ref = Sampler(V, [2]).sample(logits, rows)
    for i in (0, 2, 4, 5):
        assert fi.token_ids[i] == ref.token_ids[i]
    for i in (1, 3):
        allowed = Sampler(V, [2]).sampling_probs(logits[i : i + 1], [rows[i]])[0] > 0
        assert bool(allowed[fi.token_ids[i]])
    calls = [c for c in fake_flashinfer.calls if c[0] == "sampling.top_k_top_p"]
    assert calls[-1][1]["rows"] == 2


def test_kernel_draws_are_reproducible_for_a_fixed_batch():
    logits = torch.randn(4, V)
    rows = [_row(10 + i, i, temperature=1.0, top_p=0.9) for i in range(4)]
    a = _sampler().sample(logits, rows).token_ids
    b = _sampler().sample(logits, rows).token_ids
    assert a == b


def test_create_sampler_choices():
    assert type(create_sampler("radixrt", V, [2], "cuda")) is Sampler
    assert type(create_sampler("flashinfer", V, [2], "cpu")) is Sampler  # CPU: the default path
    assert isinstance(create_sampler("flashinfer", V, [2], "cpu", flashinfer_module=fake_flashinfer), FlashInferSampler)
    with pytest.raises(ValueError):
        create_sampler("fast", V, [2], "cpu")


@pytest.mark.gpu  # FlashInfer sampling kernels
def test_flashinfer_sampling_kernel_distribution_on_gpu():
    fi = pytest.importorskip("flashinfer")
    torch.manual_seed(0)
    logits = (torch.randn(1, V) * 2).cuda()
    params = dict(temperature=0.7, top_k=12, top_p=0.85)
    exact = Sampler(V, [2]).sampling_probs(logits.cpu(), [_row(0, **params)])[0]
    n = 8192
    s = FlashInferSampler(V, [2], flashinfer_module=fi)
    res = s.sample(logits.expand(n, V).contiguous(), [_row(i, **params) for i in range(n)])
    toks = torch.tensor(res.token_ids)
    assert bool((exact[toks] > 0).all())
    assert _tv(toks, exact) < 0.03
