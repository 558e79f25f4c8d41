"""The CPU LoRA kernel (kernels/csrc/lora_cpu.c) against torch's products on the
same adapters: mixed slots, rows without an adapter, fused projections with
several parts and biases, ranks 8 and 64, more rows of one adapter than a
row block, both dtypes; and which form a step's batch takes."""

from __future__ import annotations

import os
import shlex
import shutil
from typing import Optional

import pytest
import torch

from radixrt.executor.lora import native
from radixrt.executor.lora.adapter import LoRAAdapter, Part, ProjectionDelta
from radixrt.executor.lora.batch import LoRABatch
from radixrt.kernels import lora_cpu

K, SLICES = 48, {"qkv": [48, 16, 16], "o": [48], "gate_up": [96, 96], "down": [48]}
IN = {"qkv": K, "o": K, "gate_up": K, "down": 96}

kernel = lora_cpu.load()
_compiler = shlex.split(os.environ.get("CC") or "cc")[0]
pytestmark = pytest.mark.skipif(
    kernel is None and shutil.which(_compiler) is None, reason=f"no C compiler ({_compiler}): no kernel to test"
)


def test_the_kernel_builds_where_there_is_a_compiler() -> None:
    assert kernel is not None, "a C compiler is here: the kernel must build and pass its self-check (see the warning)"


def _adapter(name: str, rank: int, bias: bool, dtype: torch.dtype, seed: int, layers: int = 2) -> LoRAAdapter:
    gen = torch.Generator().manual_seed(seed)
    w = lambda *s: (torch.randn(*s, generator=gen) * 0.3).to(dtype)  # noqa: E731
    adapter = LoRAAdapter(name, "/nowhere", f"{name}-{seed}-{rank}-{bias}-{dtype}", rank, ("q_proj",))
    for layer in range(layers):
        for projection, slices in SLICES.items():
            if projection == "o" and layer == 1:
                continue  # a projection this adapter leaves alone
            parts, offset = [], 0
            for i, width in enumerate(slices):
                parts.append(Part(offset, (i * rank, (i + 1) * rank), w(rank, width), w(width) if bias else None))
                offset += width
            adapter.layers[(layer, projection)] = ProjectionDelta(w(IN[projection], rank * len(slices)), parts)
    return adapter


def _deltas(batch: LoRABatch, x: dict[str, torch.Tensor], outs: dict[str, torch.Tensor]) -> dict:
    result = {}
    for layer in range(2):
        for projection in SLICES:
            out = outs[projection].clone()
            batch.add_delta(layer, projection, x[projection], out)
            result[(layer, projection)] = out
    return result


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernel_adds_what_torch_adds(dtype: torch.dtype) -> None:
    adapters = [_adapter("a", 8, False, dtype, 1), _adapter("b", 64, True, dtype, 2), _adapter("c", 8, True, dtype, 3)]
    a, b, c = adapters
    # a run of 6 rows of one adapter (more than a row block), rows without one, scattered rows
    rows: list[Optional[LoRAAdapter]] = [a] * 6 + [None, b, c, None, b, a, c, c, b]
    gen = torch.Generator().manual_seed(0)
    x = {p: torch.randn(len(rows), IN[p], generator=gen).to(dtype) for p in SLICES}
    outs = {p: torch.randn(len(rows), sum(s), generator=gen).to(dtype) for p, s in SLICES.items()}
    fast = LoRABatch.build(rows, "cpu")
    slow = LoRABatch._build_torch(rows, "cpu")
    assert fast is not None and fast.native is not None and slow is not None and slow.native is None
    got, expected = _deltas(fast, x, outs), _deltas(slow, x, outs)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    for key in expected:
        torch.testing.assert_close(got[key].float(), expected[key].float(), atol=tol, rtol=tol, msg=str(key))
        if key[1] == "o" and key[0] == 1:
            assert torch.equal(got[key], outs["o"]), "a projection no adapter adapts is left as it was"
    none_rows = [i for i, r in enumerate(rows) if r is None]
    assert torch.equal(got[(0, "qkv")][none_rows], outs["qkv"][none_rows]), "rows without an adapter are untouched"


def test_small_cpu_steps_take_the_kernel_and_prefills_torch() -> None:
    a = _adapter("a", 8, False, torch.float32, 1)
    assert LoRABatch.build([a, None] * (native.MAX_ROWS // 2), "cpu").native is not None
    big = LoRABatch.build([a] * (native.MAX_ROWS + 1), "cpu")
    assert big is not None and big.native is None
    assert LoRABatch.build([None, None], "cpu") is None
    mixed = [a, _adapter("b", 8, False, torch.bfloat16, 2)]
    assert LoRABatch.build(mixed, "cpu").native is None, "adapters of two dtypes: torch's products"


def test_inputs_the_kernel_does_not_take_fall_back_to_torch() -> None:
    a = _adapter("a", 8, True, torch.float32, 1)
    batch = LoRABatch.build([a, None, a], "cpu")
    assert batch is not None and batch.native is not None
    x = torch.randn(IN["qkv"], 3).t()  # rows whose elements are not contiguous: the kernel refuses them
    assert not batch.native.accepts(x, torch.zeros(3, 1))
    base = torch.randn(3, sum(SLICES["qkv"]))
    by_torch, by_kernel = base.clone(), base.clone()
    batch.add_delta(0, "qkv", x, by_torch)
    batch.add_delta(0, "qkv", x.contiguous(), by_kernel)
    torch.testing.assert_close(by_torch, by_kernel, atol=1e-5, rtol=1e-5)
    assert not torch.equal(by_torch, base) and torch.equal(by_torch[1], base[1])
