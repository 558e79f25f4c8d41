"""LoRA deltas of a mixed-adapter batch on the CPU, as a small C kernel.

Each token row reads only its own adapter's weights (a gathered
matrix-vector product per row: ``csrc/lora_cpu.c``), so a decode step's LoRA
cost follows its rows and ranks, not how many adapters the batch mixes.
`describe` turns one adapter's projection (its stacked ``A`` and its parts'
``B`` and bias) into the int64 descriptor the kernel reads; the descriptor
holds raw addresses, so whoever keeps it must keep the tensors it names
alive (`Descriptor.tensors`). `NativeLoRA.add` adds a projection's deltas to
its output in place.

Build and fallback as the other CPU kernels (`native_build`): compiled on
first use with ``-O3 -march=native -ffast-math -fopenmp``, checked against
torch on a small case, None (and torch's batched products) where that fails;
``RADIXRT_NATIVE_LORA=0`` turns it off.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

import torch

from .native_build import load_kernel

SOURCE = Path(__file__).with_name("csrc") / "lora_cpu.c"
COMPILE_FLAGS = ["-O3", "-march=native", "-ffast-math", "-fPIC", "-std=c11", "-fopenmp"]
LINK_FLAGS = ["-shared", "-fopenmp"]
DISABLE_ENV = "RADIXRT_NATIVE_LORA"
MAX_RANK = 1024  # as csrc/lora_cpu.c
PARALLEL_MIN_MACS = 1 << 16
DTYPES = (torch.float32, torch.bfloat16)


@dataclass
class PartWeights:
    """One adapted module of a projection: its ranks of ``A``, output columns, ``B`` and bias."""

    ranks: tuple[int, int]
    col0: int
    b: torch.Tensor  # [r1 - r0, width], scaled, contiguous
    bias: Optional[torch.Tensor] = None  # [width], scaled


@dataclass
class Descriptor:
    """A projection's weights as the kernel reads them (``words``), and the tensors its addresses name."""

    words: torch.Tensor  # int64, layout in csrc/lora_cpu.c
    tensors: list[torch.Tensor]


def describe(a_t: torch.Tensor, parts: Sequence[PartWeights]) -> Descriptor:
    """The descriptor of a projection whose stacked ``A`` transposed is ``a_t`` [K, R]."""
    a = a_t.t().contiguous()
    words = [a.shape[0], len(parts), a.data_ptr()]
    tensors = [a]
    for p in parts:
        b = p.b.contiguous()
        bias = None if p.bias is None else p.bias.contiguous()
        words += [p.ranks[0], p.ranks[1], p.col0, b.shape[1], b.data_ptr(), 0 if bias is None else bias.data_ptr()]
        tensors += [b] if bias is None else [b, bias]
    return Descriptor(torch.tensor(words, dtype=torch.int64), tensors)


class NativeLoRA:
    """The compiled kernel (module docstring)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        lib = ctypes.CDLL(str(path))
        ptr, i64 = ctypes.c_void_p, ctypes.c_int64
        argtypes = [ptr, i64, i64, i64, ptr, i64, i64, ptr, ptr, i64, i64]
        self._fns = {}
        for dtype, name in ((torch.float32, "radixrt_lora_add_f32"), (torch.bfloat16, "radixrt_lora_add_bf16")):
            fn = getattr(lib, name)  # ctypes releases the GIL for the call
            fn.restype, fn.argtypes = ctypes.c_int, argtypes
            self._fns[dtype] = fn

    @staticmethod
    def accepts(x: torch.Tensor, out: torch.Tensor) -> bool:
        """Whether `add` takes these tensors (CPU, float32 or bfloat16, elements contiguous)."""
        return (
            x.device.type == "cpu"
            and x.dtype in DTYPES
            and out.dtype == x.dtype
            and x.dim() == 2
            and x.stride(1) == 1
            and out.stride(1) == 1
        )

    def add(self, x: torch.Tensor, out: torch.Tensor, slots: torch.Tensor, descs: torch.Tensor) -> None:
        """``out[i] +=`` the delta of adapter ``slots[i]`` (int32, -1: none) for row ``x[i]``;
        ``descs`` [slots] int64: each slot's descriptor address for this projection (0: none).
        Every weight a descriptor names must be in ``x``'s dtype."""
        assert self.accepts(x, out) and slots.dtype == torch.int32 and descs.dtype == torch.int64
        m, k = x.shape
        code = self._fns[x.dtype](
            x.data_ptr(),
            x.stride(0),
            m,
            k,
            out.data_ptr(),
            out.stride(0),
            out.shape[1],
            slots.data_ptr(),
            descs.data_ptr(),
            descs.numel(),
            PARALLEL_MIN_MACS,
        )
        if code:
            raise RuntimeError("LoRA kernel: " + ("no scratch memory" if code == -1 else f"rank above {MAX_RANK}"))


def load() -> Optional[NativeLoRA]:
    """The kernel for this machine, built on first call; None when it cannot be built or is
    turned off. Safe to call from several threads and processes."""
    return load_kernel(
        "lora_cpu",
        SOURCE,
        COMPILE_FLAGS,
        LINK_FLAGS,
        NativeLoRA,
        _self_check,
        DISABLE_ENV,
        "LoRA products use torch's batched matmuls",
    )


def _self_check(kernel: NativeLoRA) -> None:
    """Two adapters (one with two parts and a bias) and a row without one, both dtypes."""
    gen = torch.Generator().manual_seed(0)
    for dtype in DTYPES:

        def w(*shape: int, dtype: torch.dtype = dtype) -> torch.Tensor:
            return torch.randn(*shape, generator=gen).to(dtype)

        x, out = w(3, 40), w(3, 70)
        first = describe(w(40, 6), [PartWeights((0, 4), 0, w(4, 30), w(30)), PartWeights((4, 6), 50, w(2, 20))])
        second = describe(w(40, 3), [PartWeights((0, 3), 10, w(3, 60))])
        expected = out.float().clone()
        xa = x[0].float() @ first.tensors[0].float().t()
        expected[0, 0:30] += xa[0:4] @ first.tensors[1].float() + first.tensors[2].float()
        expected[0, 50:70] += xa[4:6] @ first.tensors[3].float()
        expected[2, 10:70] += (x[2].float() @ second.tensors[0].float().t()) @ second.tensors[1].float()
        slots = torch.tensor([0, -1, 1], dtype=torch.int32)
        descs = torch.tensor([first.words.data_ptr(), second.words.data_ptr()], dtype=torch.int64)
        kernel.add(x, out, slots, descs)
        tol = 1e-4 if dtype == torch.float32 else 2e-2
        if not torch.allclose(out.float(), expected, atol=tol, rtol=tol):
            raise RuntimeError(f"self-check of the LoRA kernel in {dtype} failed")
