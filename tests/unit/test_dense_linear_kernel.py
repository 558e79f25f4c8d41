"""The float32 few-row linear kernel (kernels/csrc/dense_linear_cpu.c) against
torch's product: shapes with partial weight blocks, odd rows and K tails,
strided rows, bias or none; a row's bits alone equal its bits among any
number of others; and the layers a loaded model switches to it."""

from __future__ import annotations

import os
import shlex
import shutil

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from radixrt.executor.models.native_linear import NativeFewRowsLinear, use_native_linears
from radixrt.kernels import dense_linear_cpu
from radixrt.kernels.native_build import cpu_flags

kernel = dense_linear_cpu.load()
_compiler = shlex.split(os.environ.get("CC") or "cc")[0]
_avx2 = " avx2 " in f" {cpu_flags()} " and " fma " in f" {cpu_flags()} "
pytestmark = pytest.mark.skipif(
    kernel is None and (shutil.which(_compiler) is None or not _avx2),
    reason=f"no C compiler ({_compiler}) or no AVX2 and FMA: no kernel to test",
)


def test_the_kernel_builds_where_there_is_a_compiler_and_avx2() -> None:
    assert kernel is not None, "a C compiler and AVX2 are here: the kernel must build and pass its self-check"


@pytest.mark.parametrize("n,k", [(1, 8), (7, 13), (30, 64), (129, 576), (576, 1536)])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_torch(n: int, k: int, bias: bool) -> None:
    gen = torch.Generator().manual_seed(n * 1000 + k)
    w = torch.randn(n, k, generator=gen)
    b = torch.randn(n, generator=gen) if bias else None
    for m in (1, 2, 3, 9, dense_linear_cpu.MAX_ROWS - 1):
        x = torch.randn(m, k, generator=gen)
        torch.testing.assert_close(kernel.linear(x, w, b), F.linear(x, w, b), atol=1e-4 * k**0.5, rtol=1e-4)


def test_a_rows_bits_do_not_depend_on_the_other_rows() -> None:
    gen = torch.Generator().manual_seed(1)
    w, b = torch.randn(203, 579, generator=gen), torch.randn(203, generator=gen)
    x = torch.randn(17, 579, generator=gen)
    alone = torch.cat([kernel.linear(x[i : i + 1], w, b) for i in range(17)])
    for m in (2, 5, 16, 17):
        assert torch.equal(kernel.linear(x[:m], w, b), alone[:m])
    assert torch.equal(kernel.linear(x[4:11], w, b), alone[4:11])  # at another place in its block


def test_the_kernel_takes_up_to_128_rows_where_torch_multiplies_with_avx2_only(monkeypatch) -> None:
    """Where torch's CPU kernels have 256-bit FMAs only, as the kernel, the kernel stays ahead of
    the BLAS past 64 rows (prefill chunks); with 512-bit ones the BLAS takes over at 64."""
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    assert dense_linear_cpu._max_rows() == 128
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    assert dense_linear_cpu._max_rows() == 64


def test_strided_rows() -> None:
    gen = torch.Generator().manual_seed(2)
    w = torch.randn(40, 64, generator=gen)
    wide = torch.randn(5, 100, generator=gen)
    x = wide[:, 10:74]  # rows 100 apart
    assert not x.is_contiguous()
    assert torch.equal(kernel.linear(x, w), kernel.linear(x.contiguous(), w))


def test_a_model_switches_its_plain_float32_linears_and_keeps_ties() -> None:
    emb = nn.Embedding(50, 16)
    model = nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 16, bias=False), nn.Linear(16, 50, bias=False))
    model[2].weight = emb.weight  # a tied head
    model.add_module("bf16", nn.Linear(16, 16).to(torch.bfloat16))
    assert use_native_linears(model) == 3
    assert type(model.bf16) is nn.Linear  # bfloat16 keeps torch's product
    assert isinstance(model[0], NativeFewRowsLinear) and model[2].weight is emb.weight
    x = torch.randn(3, 16)
    few = model[2](model[1](model[0](x)))
    many = model[2](model[1](model[0](x.repeat(dense_linear_cpu.MAX_ROWS, 1))))  # torch's product
    torch.testing.assert_close(few, many[:3], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("quantization", [None, "int8", "int4"])
def test_bench_times_each_kernel_beside_torch(quantization):
    """``python -m radixrt.bench.dense_linear [--quantization ...]`` on a small shape: one row per
    row count, both times positive and the ratio their quotient."""
    from radixrt.bench.dense_linear import bench_shape

    rows = bench_shape(96, 64, [1, 3], calls=2, quantization=quantization)
    assert [r["rows"] for r in rows] == [1, 3] and all(r["shape"] == "96x64" for r in rows)
    for r in rows:
        assert r["torch_ms"] > 0 and r["kernel_ms"] > 0
        assert r["ratio"] == pytest.approx(r["torch_ms"] / r["kernel_ms"])
