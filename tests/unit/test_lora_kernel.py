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
from radixrt.executor.lora.adapter import LoRAAdapter
from radixrt.executor.lora.batch import LoRABatch
from radixrt.executor.lora.native import NativeRows
from radixrt.kernels import lora_cpu
from tests.support.lora import IN, SLICES, every_delta, synthetic_adapter

kernel = lora_cpu.load()
_compiler = shlex.split(os.environ.get("CC") or "cc")[0]
pytestmark = pytest.mark.skipif(
    kernel is None and shutil.which(_compiler) is None, reason=f"no C compiler ({_compiler}): no kernel to test"
)


def test_the_kernel_builds_where_there_is_a_compiler() -> None:
    assert kernel is not None, "a C compiler is here: the kernel must build and pass its self-check (see the warning)"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernel_adds_what_torch_adds(dtype: torch.dtype) -> None:
    adapters = [
        synthetic_adapter("a", 8, False, dtype, 1),
        synthetic_adapter("b", 64, True, dtype, 2),
        synthetic_adapter("c", 8, True, dtype, 3),
    ]
    a, b, c = adapters
    # a run of 6 rows of one adapter (more than a row block), rows without one, scattered rows
    rows: list[Optional[LoRAAdapter]] = [a] * 6 + [None, b, c, None, b, a, c, c, b]
    gen = torch.Generator().manual_seed(0)
    x = {p: torch.randn(len(rows), IN[p], generator=gen).to(dtype) for p in SLICES}
    outs = {p: torch.randn(len(rows), sum(s), generator=gen).to(dtype) for p, s in SLICES.items()}
    fast = LoRABatch.build(rows, "cpu")
    slow = LoRABatch._build_torch(rows, "cpu")
    assert fast is not None and isinstance(fast.kernel, NativeRows) and slow is not None and slow.kernel is None
    got, expected = every_delta(fast, x, outs), every_delta(slow, x, outs)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    for key in expected:
        torch.testing.assert_close(got[key].float(), expected[key].float(), atol=tol, rtol=tol, msg=str(key))
        if key[1] == "o" and key[0] == 1:
            assert torch.equal(got[key], outs["o"]), "a projection no adapter adapts is left as it was"
    none_rows = [i for i, r in enumerate(rows) if r is None]
    assert torch.equal(got[(0, "qkv")][none_rows], outs["qkv"][none_rows]), "rows without an adapter are untouched"


def test_small_cpu_steps_take_the_kernel_and_prefills_torch() -> None:
    a = synthetic_adapter("a", 8, False, torch.float32, 1)
    assert isinstance(LoRABatch.build([a, None] * (native.MAX_ROWS // 2), "cpu").kernel, NativeRows)
    big = LoRABatch.build([a] * (native.MAX_ROWS + 1), "cpu")
    assert big is not None and big.kernel is None
    assert LoRABatch.build([None, None], "cpu") is None
    mixed = [a, synthetic_adapter("b", 8, False, torch.bfloat16, 2)]
    assert LoRABatch.build(mixed, "cpu").kernel is None, "adapters of two dtypes: torch's products"


def test_inputs_the_kernel_does_not_take_fall_back_to_torch() -> None:
    a = synthetic_adapter("a", 8, True, torch.float32, 1)
    batch = LoRABatch.build([a, None, a], "cpu")
    assert batch is not None and isinstance(batch.kernel, NativeRows)
    x = torch.randn(IN["qkv"], 3).t()  # rows whose elements are not contiguous: the kernel refuses them
    assert not batch.kernel.accepts(x, torch.zeros(3, 1))
    base = torch.randn(3, sum(SLICES["qkv"]))
    by_torch, by_kernel = base.clone(), base.clone()
    batch.add_delta(0, "qkv", x, by_torch)
    batch.add_delta(0, "qkv", x.contiguous(), by_kernel)
    torch.testing.assert_close(by_torch, by_kernel, atol=1e-5, rtol=1e-5)
    assert not torch.equal(by_torch, base) and torch.equal(by_torch[1], base[1])
