"""The CPU paged decode kernel (`radixrt.kernels.cpu_decode`, float32 and
bfloat16 pools) against dense float64 attention, its build and fallbacks, and the engine's greedy tokens
with the kernel and with the torch path."""

from __future__ import annotations

import logging
import os
import shlex
import shutil
from collections.abc import Iterator

import pytest
import torch

from radixrt.config import EngineConfig
from radixrt.kernels import cpu_decode
from radixrt.scheduler.scheduler import Scheduler
from tests.support.scheduling import greedy_together


@pytest.fixture(scope="module")
def kernel() -> cpu_decode.NativeDecode:
    native = cpu_decode.load()
    if native is None:
        compiler = shlex.split(os.environ.get("CC") or "cc")[0]
        assert shutil.which(compiler) is None, "a C compiler is here, so the kernel must build (see the warning)"
        pytest.skip(f"no C compiler ({compiler}) on this machine: the torch path is used")
    return native


def _dense(q, k_cache, v_cache, table, lens, scale):
    """float64 attention of each request's first lens[b] slots of table row b."""
    group = q.shape[1] // k_cache.shape[1]
    out = []
    for b in range(q.shape[0]):
        slots = table[b, : int(lens[b])]
        k = k_cache[slots].double().repeat_interleave(group, dim=1)  # [len, Hq, D]
        v = v_cache[slots].double().repeat_interleave(group, dim=1)
        p = (torch.einsum("hd,thd->ht", q[b].double(), k) * scale).softmax(-1)
        out.append(torch.einsum("ht,thd->hd", p, v))
    return torch.stack(out)


@pytest.mark.parametrize(
    "batch,hkv,group,head_dim",
    [
        (1, 1, 1, 8),
        (5, 2, 3, 16),
        (7, 3, 3, 64),
        (3, 1, 8, 128),
        (4, 2, 2, 24),
        (2, 4, 1, 256),
    ],
)
def test_kernel_matches_dense_attention(kernel, batch, hkv, group, head_dim) -> None:
    gen = torch.Generator().manual_seed(batch * 1000 + head_dim)
    num_slots, max_kv = 300, 37
    k_cache = torch.randn(num_slots, hkv, head_dim, generator=gen)
    v_cache = torch.randn(num_slots, hkv, head_dim, generator=gen)
    # slot 0 holds huge values: the padding points at it, so reading padding would show
    k_cache[0], v_cache[0] = 1e4, 1e4
    lens = torch.randint(1, max_kv + 1, (batch,), generator=gen)
    lens[0] = max_kv
    table = torch.zeros(batch, max_kv, dtype=torch.int64)
    for b in range(batch):
        table[b, : int(lens[b])] = torch.randperm(num_slots - 1, generator=gen)[: int(lens[b])] + 1
    q = torch.randn(batch, hkv * group, head_dim, generator=gen)
    scale = head_dim**-0.5
    out = kernel.forward(q, k_cache, v_cache, table, lens, scale)
    assert out.shape == q.shape and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), _dense(q, k_cache, v_cache, table, lens, scale), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("batch,hkv,group,head_dim", [(1, 1, 1, 8), (5, 2, 3, 16), (7, 3, 3, 64), (3, 1, 8, 128)])
def test_bfloat16_pool_matches_dense_attention_of_its_values(kernel, batch, hkv, group, head_dim) -> None:
    """A bfloat16 pool and query: each value is widened exactly, the sums run
    in float32, and the output is the dense answer rounded to bfloat16."""
    gen = torch.Generator().manual_seed(batch * 77 + head_dim)
    num_slots, max_kv = 300, 53
    k_cache = torch.randn(num_slots, hkv, head_dim, generator=gen).bfloat16()
    v_cache = torch.randn(num_slots, hkv, head_dim, generator=gen).bfloat16()
    lens = torch.randint(1, max_kv + 1, (batch,), generator=gen)
    table = torch.stack([torch.randperm(num_slots, generator=gen)[:max_kv] for _ in range(batch)])
    q = torch.randn(batch, hkv * group, head_dim, generator=gen).bfloat16()
    scale = head_dim**-0.5
    out = kernel.forward(q, k_cache, v_cache, table, lens, scale)
    assert out.shape == q.shape and out.dtype == torch.bfloat16
    expected = _dense(q, k_cache, v_cache, table, lens, scale)
    # within one bfloat16 rounding of the float64 answer (8 bits of mantissa)
    torch.testing.assert_close(out.double(), expected, atol=1e-2, rtol=2**-7)
    assert (out.double() - expected).abs().max() < 0.02
    # an element that is not a bfloat16 pool takes the torch path instead
    assert kernel.supports(q, k_cache) and not kernel.supports(q.float(), k_cache)
    assert not kernel.supports(q.half(), k_cache.half())


def test_kernel_reads_query_rows_of_a_wider_tensor(kernel) -> None:
    """q may be a view of the fused q/k/v projection: rows apart, heads contiguous."""
    gen = torch.Generator().manual_seed(3)
    k_cache, v_cache = torch.randn(50, 2, 16, generator=gen), torch.randn(50, 2, 16, generator=gen)
    qkv = torch.randn(4, 8, 16, generator=gen)
    q = qkv[:, :4]  # [4, 4, 16], row stride 8 * 16
    assert not q.is_contiguous()
    table = torch.arange(40).view(4, 10)
    lens = torch.tensor([10, 3, 7, 1])
    out = kernel.forward(q, k_cache, v_cache, table, lens, 0.25)
    torch.testing.assert_close(out, kernel.forward(q.contiguous(), k_cache, v_cache, table, lens, 0.25))
    torch.testing.assert_close(out.double(), _dense(q, k_cache, v_cache, table, lens, 0.25), atol=1e-5, rtol=1e-5)


def _thread_counts(*counts: int) -> Iterator[int]:
    """Each of ``counts`` as torch's (and the kernel's) thread count in turn; restored after."""
    threads = torch.get_num_threads()
    try:
        for n in counts:
            torch.set_num_threads(n)
            yield n
    finally:
        torch.set_num_threads(threads)


def test_large_batches_split_over_threads(kernel, monkeypatch) -> None:
    """Rows split over the torch thread count give each request's own answer."""
    gen = torch.Generator().manual_seed(5)
    batch, hkv, group, d, num_slots = 9, 2, 2, 32, 400
    k_cache, v_cache = torch.randn(num_slots, hkv, d, generator=gen), torch.randn(num_slots, hkv, d, generator=gen)
    lens = torch.randint(1, 41, (batch,), generator=gen)
    table = torch.stack([torch.randperm(num_slots, generator=gen)[:40] for _ in range(batch)])
    q = torch.randn(batch, hkv * group, d, generator=gen)
    one_thread = kernel.forward(q, k_cache, v_cache, table, lens, 0.2)
    monkeypatch.setattr(cpu_decode, "PARALLEL_MIN_PAIRS", 1)
    for _ in _thread_counts(2, 4):
        split = kernel.forward(q, k_cache, v_cache, table, lens, 0.2)
        assert torch.equal(split, one_thread)  # each request is computed alone, whichever thread runs it
    torch.testing.assert_close(one_thread.double(), _dense(q, k_cache, v_cache, table, lens, 0.2), atol=1e-5, rtol=1e-5)


def test_loading_the_kernel_keeps_denormals(kernel) -> None:
    """Compiled with -ffast-math but linked without it: the process must not switch
    to flush-to-zero (gcc < 13 would, for a shared object linked with the flag)."""
    tiny = torch.tensor([1e-40], dtype=torch.float32)  # a float32 subnormal
    assert tiny.item() != 0.0
    assert (tiny * 1.0).item() != 0.0 and (tiny + tiny).item() != 0.0


def test_build_is_cached_per_machine(kernel) -> None:
    assert cpu_decode.load() is kernel  # one build per process
    assert kernel.path.exists() and kernel.path.parent.name == "kernels"
    assert kernel.path.name.startswith("paged_decode_cpu-") and kernel.path.suffix == ".so"


def test_turned_off_by_environment(monkeypatch) -> None:
    monkeypatch.setenv(cpu_decode.DISABLE_ENV, "0")
    assert cpu_decode.load() is None


def test_no_compiler_falls_back_with_a_warning(monkeypatch, tmp_path, caplog) -> None:
    monkeypatch.setenv("RADIXRT_HOME", str(tmp_path))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    with caplog.at_level(logging.WARNING, logger=cpu_decode.__name__):
        assert cpu_decode.load() is None
    assert "torch path" in caplog.text and "no-such-cc" in caplog.text


def _greedy(model_path: str) -> tuple[list[list[int]], bool]:
    """Greedy tokens of six requests decoding together, and whether the kernel was used."""
    sched = Scheduler(EngineConfig(model_path=model_path, max_running_requests=8, max_total_tokens=2048))
    try:
        prompts = [[(11 * i + j) % 300 + 3 for j in range(5 + 9 * i)] for i in range(6)]
        return greedy_together(sched, prompts, 24), sched.runner.backend._native is not None
    finally:
        sched.close()


def test_engine_greedy_tokens_same_with_and_without_the_kernel(kernel, tiny_llama, monkeypatch) -> None:
    with_kernel, used = _greedy(tiny_llama)
    monkeypatch.setenv(cpu_decode.DISABLE_ENV, "0")
    torch_path, used_after = _greedy(tiny_llama)
    assert used and not used_after
    assert with_kernel == torch_path
    assert all(len(t) == 24 for t in with_kernel)


@pytest.mark.parametrize("dtype,d", [(torch.float32, 32), (torch.bfloat16, 64), (torch.float32, 128)])
def test_rows_sharing_slots_are_read_together_with_the_same_results(kernel, monkeypatch, dtype, d) -> None:
    """Rows that share their first slots (a draft's, chains and trees) give, bit for bit, what
    each gives alone, groups longer than the kernel's 16 rows and several threads included
    (a group's rows take another loop than a lone row's: head sizes below, at and above the 64
    floats it keeps in registers at once, and a bfloat16 pool)."""
    gen = torch.Generator().manual_seed(8)
    hkv, group, num_slots = 2, 3, 600
    k_cache, v_cache = torch.randn(num_slots, hkv, d, generator=gen), torch.randn(num_slots, hkv, d, generator=gen)
    k_cache, v_cache = k_cache.to(dtype), v_cache.to(dtype)
    prefix = torch.randperm(num_slots, generator=gen)[:200]
    tables, lens, shared = [], [], []
    for j in range(20):  # one request's 20-token chain: row j sees 180 + j + 1 keys
        tables.append(prefix)
        lens.append(181 + j)
        shared.append(0 if j == 0 else 180 + j)
    for j in range(3):  # a tree's rows: the same 150 keys, then each its own path
        row = prefix.clone()
        row[150 : 150 + j + 1] = torch.randperm(num_slots, generator=gen)[: j + 1]
        tables.append(row)
        lens.append(151 + j)
        shared.append(0 if j == 0 else 150)
    tables.append(torch.randperm(num_slots, generator=gen)[:200])  # another request alone
    lens.append(77)
    shared.append(0)
    table, lens_t = torch.stack(tables).contiguous(), torch.tensor(lens)
    q = torch.randn(len(lens), hkv * group, d, generator=gen).to(dtype)
    apart = kernel.forward(q, k_cache, v_cache, table, lens_t, 0.2)
    monkeypatch.setattr(cpu_decode, "PARALLEL_MIN_PAIRS", 1)
    for _ in _thread_counts(1, 2):
        together = kernel.forward(q, k_cache, v_cache, table, lens_t, 0.2, torch.tensor(shared))
        assert torch.equal(together, apart)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    dense = _dense(q.float(), k_cache.float(), v_cache.float(), table, lens_t, 0.2)
    torch.testing.assert_close(apart.double(), dense, atol=tol, rtol=tol)


def test_the_backend_groups_a_drafts_rows_without_changing_them() -> None:
    """Short extends and a draft tree through the torch backend: the kernel is told which rows
    share slots, and the answer is bit for bit the one without that."""
    from radixrt.kernels import AttentionMetadata, LayerKVCache, torch_ref

    gen = torch.Generator().manual_seed(9)
    kv_lens, q_lens = [300, 120, 90, 64], [6, 1, 4, 3]
    tree = [None, None, None, [-1, 0, 0]]  # the last request verifies a tree: a root and two children
    seq_slots, base = [], 0
    for n in kv_lens:
        seq_slots.append(list(range(base, base + n)))
        base += n
    meta = AttentionMetadata.build(seq_slots, q_lens, tree=tree)
    k_cache, v_cache = torch.randn(base, 3, 16, generator=gen), torch.randn(base, 3, 16, generator=gen)
    t = meta.num_tokens
    q, k, v = torch.randn(t, 9, 16, generator=gen), torch.randn(t, 3, 16, generator=gen), torch.randn(t, 3, 16)

    def run(group_shared_rows: bool) -> tuple[torch.Tensor, list]:
        backend = torch_ref.TorchReferenceBackend(group_shared_rows=group_shared_rows)
        backend.plan(meta)
        out = backend.forward(q, k, v, LayerKVCache(k_cache.clone(), v_cache.clone()), 0.25)
        return out, [dec.shared for dec in backend._decode]

    grouped, shared = run(True)
    assert any(s is not None and int(s.max()) > 0 for s in shared)  # rows were grouped
    apart, shared = run(False)
    assert all(s is None for s in shared)
    assert torch.equal(grouped, apart)
