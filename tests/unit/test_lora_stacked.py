"""The stacked form of a mixed batch's LoRA products (executor/lora/stacked.py) against
the per-adapter segments, for adapters that adapt only some parts of a fused projection:
the leading part only (``q_proj`` of ``qkv``, ``gate_proj`` of ``gate_up``), a trailing
one only, or different parts each."""

from __future__ import annotations

import pytest
import torch

from radixrt.executor.lora.adapter import LoRAAdapter, Part, ProjectionDelta
from radixrt.executor.lora.batch import LoRABatch, Segment

SLICES = {"qkv": [48, 16, 16], "gate_up": [96, 96]}
IN = {"qkv": 48, "gate_up": 48}


def _adapter(name: str, adapted: dict[str, list[int]], seed: int, bias: bool = False) -> LoRAAdapter:
    """An adapter of rank 4 per part whose projections adapt only the parts ``adapted`` names."""
    gen = torch.Generator().manual_seed(seed)
    w = lambda *s: torch.randn(*s, generator=gen) * 0.3  # noqa: E731
    adapter = LoRAAdapter(name, "/nowhere", f"{name}-{seed}-{adapted}-{bias}", 4, ("q_proj",))
    for projection, indices in adapted.items():
        slices = SLICES[projection]
        parts = [
            Part(sum(slices[:i]), (4 * j, 4 * j + 4), w(4, slices[i]), w(slices[i]) if bias else None)
            for j, i in enumerate(indices)
        ]
        adapter.layers[(0, projection)] = ProjectionDelta(w(IN[projection], 4 * len(indices)), parts)
    return adapter


MIXES = {
    "q only, both": [{"qkv": [0]}, {"qkv": [0]}],
    "gate only, both": [{"gate_up": [0]}, {"gate_up": [0]}],
    "q and v / gate": [{"qkv": [0, 2]}, {"gate_up": [0]}],
    "v only / q only": [{"qkv": [2]}, {"qkv": [0]}],
}


@pytest.mark.parametrize("mix", sorted(MIXES))
@pytest.mark.parametrize("bias", [False, True])
def test_stacked_deltas_span_the_whole_projection(mix: str, bias: bool) -> None:
    adapters = [_adapter(f"a{i}", adapted, seed=i + 1, bias=bias) for i, adapted in enumerate(MIXES[mix])]
    rows = [adapters[0]] * 40 + [adapters[1]] * 40 + [None] * 3
    stacked = LoRABatch._build_torch(rows, "cpu")  # the form of a large mixed step (a prefill; any GPU step)
    segments = LoRABatch([Segment(adapters[0], 0, 40), Segment(adapters[1], 40, 80)], None)
    assert stacked is not None and stacked.stacked is not None
    gen = torch.Generator().manual_seed(0)
    for projection, slices in SLICES.items():
        x = torch.randn(len(rows), IN[projection], generator=gen)
        base = torch.randn(len(rows), sum(slices), generator=gen)
        got, want = base.clone(), base.clone()
        stacked.add_delta(0, projection, x, got)
        segments.add_delta(0, projection, x, want)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        assert torch.equal(got[80:], base[80:]), "rows without an adapter are untouched"
