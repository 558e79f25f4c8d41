"""The GPU's segmented LoRA kernel (kernels/lora_triton.py) run under Triton's interpreter on
the CPU, against torch's products on the same adapters: segments longer than a row block,
scattered rows, rows without an adapter, ranks above a rank block, biases, a projection an
adapter leaves alone, float32 (exact) and float16 (the 16-bit path: the interpreter cannot
multiply bfloat16). The interpreter is chosen when Triton is imported, so each check runs in
a fresh interpreter process with ``TRITON_INTERPRET=1``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Optional

import pytest
import torch

from radixrt.executor.lora.adapter import LoRAAdapter
from radixrt.executor.lora.batch import LoRABatch
from tests.support.lora import IN, SLICES, every_delta, synthetic_adapter

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_under_the_interpreter() -> None:
    """Both checks below, in one fresh process (importing torch and Triton costs seconds)."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "RADIXRT_TRITON_LORA": "1"}
    checks = "check_the_kernel_adds_what_torch_adds", "check_which_steps_take_the_kernel"
    code = f"import tests.unit.test_lora_triton as t; t.{checks[0]}(); t.{checks[1]}()"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


def check_the_kernel_adds_what_torch_adds() -> None:
    from radixrt.executor.lora.segmented import SegmentedRows

    for dtype, tol in ((torch.float32, 1e-5), (torch.float16, 2e-2)):
        a = synthetic_adapter("a", 8, False, dtype, 1)
        b = synthetic_adapter("b", 24, True, dtype, 2)  # three parts of 24: 72 ranks, two rank blocks
        c = synthetic_adapter("c", 8, True, dtype, 3)
        # a run of 70 rows of one adapter (two row blocks), rows without one, scattered rows
        rows: list[Optional[LoRAAdapter]] = [a] * 70 + [None, b, c, None, b, a, c, c, b]
        gen = torch.Generator().manual_seed(0)
        x = {p: torch.randn(len(rows), IN[p], generator=gen).to(dtype) for p in SLICES}
        outs = {p: torch.randn(len(rows), sum(s), generator=gen).to(dtype) for p, s in SLICES.items()}
        fast = LoRABatch.build(rows, "cpu")
        slow = LoRABatch._build_torch(rows, "cpu")
        assert fast is not None and isinstance(fast.kernel, SegmentedRows), fast
        assert slow is not None and slow.kernel is None
        got, expected = every_delta(fast, x, outs), every_delta(slow, x, outs)
        for key in expected:
            torch.testing.assert_close(got[key].float(), expected[key].float(), atol=tol, rtol=tol, msg=str(key))
        assert torch.equal(got[(1, "o")], outs["o"]), "a projection no adapter adapts is left as it was"
        none_rows = [i for i, r in enumerate(rows) if r is None]
        assert torch.equal(got[(0, "qkv")][none_rows], outs["qkv"][none_rows]), "rows without an adapter are untouched"
        alone = every_delta(
            LoRABatch.build([b], "cpu"), {p: v[71:72] for p, v in x.items()}, {p: v[71:72] for p, v in outs.items()}
        )
        for key, out in alone.items():
            assert torch.equal(out, got[key][71:72]), f"{key}: a row gets what it gets alone"


def check_which_steps_take_the_kernel() -> None:
    from radixrt.executor.lora.segmented import SegmentedRows

    a = synthetic_adapter("a", 8, True, torch.float32, 1)
    batch = LoRABatch.build([a, None, a], "cpu")
    assert batch is not None and isinstance(batch.kernel, SegmentedRows)
    mixed = LoRABatch.build([a, synthetic_adapter("h", 8, False, torch.float16, 2)], "cpu")
    assert mixed is not None and mixed.kernel is None, "adapters of two dtypes: torch's products"
    x = torch.randn(3, IN["qkv"])
    base = torch.randn(3, sum(SLICES["qkv"]))
    by_kernel, strided = base.clone(), base.t().contiguous().t()  # the same values, columns strided
    assert not batch.kernel.accepts(x, strided) and not batch.kernel.accepts(x.double(), by_kernel.double())
    batch.add_delta(0, "qkv", x, by_kernel)
    batch.add_delta(0, "qkv", x, strided)  # an output the kernel does not take: torch's products
    torch.testing.assert_close(strided, by_kernel, atol=1e-5, rtol=1e-5)
    assert not torch.equal(by_kernel, base) and torch.equal(by_kernel[1], base[1])
    os.environ["RADIXRT_TRITON_LORA"] = "0"
    assert not isinstance(LoRABatch.build([a], "cpu").kernel, SegmentedRows)


def test_a_kernel_that_fails_its_check_leaves_the_steps_to_torch(monkeypatch, caplog) -> None:
    """Asked for on the CPU without the interpreter, the compiled kernel cannot run: its check on first
    use fails, a warning says so, and the steps take torch's products (no step ever raises)."""
    from radixrt.executor.lora import segmented

    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("the interpreter runs the kernel on the CPU")
    monkeypatch.setenv("RADIXRT_TRITON_LORA", "1")
    segmented._kernel.cache_clear()
    try:
        with caplog.at_level("WARNING", logger=segmented.__name__):
            batch = LoRABatch.build([synthetic_adapter("a", 8, False, torch.float32, 1), None], "cpu")
        assert batch is not None and not isinstance(batch.kernel, segmented.SegmentedRows)
        assert "failed its check" in caplog.text
    finally:
        segmented._kernel.cache_clear()
