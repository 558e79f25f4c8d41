"""The segmented Triton LoRA kernel (kernels/lora_triton.py) compiled for a GPU, against torch's
products on the same device: a batch mixing three adapters (ranks 8 and 64, biases) with rows
without one, in float32 (the exact product) and bfloat16 (the tensor cores')."""

from __future__ import annotations

import pytest
import torch

from radixrt.executor.lora.adapter import Part, ProjectionDelta
from radixrt.executor.lora.batch import LoRABatch
from radixrt.executor.lora.segmented import SegmentedRows
from tests.support.lora import IN, SLICES, every_delta, synthetic_adapter


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_segmented_lora_kernel_on_gpu_adds_what_torch_adds(dtype: torch.dtype) -> None:
    adapters = [
        synthetic_adapter(n, r, b, dtype, s)
        for n, r, b, s in (("a", 8, False, 1), ("b", 64, True, 2), ("c", 8, True, 3))
    ]
    for adapter in adapters:
        for key, d in adapter.layers.items():
            parts = [Part(p.offset, p.ranks, p.b_t.cuda(), None if p.bias is None else p.bias.cuda()) for p in d.parts]
            adapter.layers[key] = ProjectionDelta(d.a_t.cuda(), parts)
    a, b, c = adapters
    rows = [a] * 70 + [None, b, c, None, b, a, c, c, b]
    gen = torch.Generator().manual_seed(0)
    x = {p: torch.randn(len(rows), IN[p], generator=gen).to("cuda", dtype) for p in SLICES}
    outs = {p: torch.randn(len(rows), sum(w), generator=gen).to("cuda", dtype) for p, w in SLICES.items()}
    fast = LoRABatch.build(rows, "cuda")
    assert fast is not None and isinstance(fast.kernel, SegmentedRows), "a GPU step takes the kernel"
    got, want = every_delta(fast, x, outs), every_delta(LoRABatch._build_torch(rows, "cuda"), x, outs)
    for key in want:
        err = float((got[key].float() - want[key].float()).norm() / want[key].float().norm())
        assert err < (1e-5 if dtype == torch.float32 else 1e-2), (key, err)
    none_rows = [i for i, r in enumerate(rows) if r is None]
    assert torch.equal(got[(0, "qkv")][none_rows], outs["qkv"][none_rows])
