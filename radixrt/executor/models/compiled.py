"""``--enable-torch-compile``: the decoder layers compiled with inductor.

`enable_compile` gives a `LlamaForCausalLM` a compiled version of its layer
stack (`LlamaForCausalLM.run_layers`: every decoder layer and the final norm),
which its forward then runs for every batch except those that need the eager
path (KV-budget scoring, batch-invariant padding). The embeddings, the rotary
tables and the LM head stay eager.

Two calls of a layer cannot be traced: the paged attention (the backend plans
each batch in Python and may call a C kernel) and the quantized linear product
(a C kernel through ctypes). They are custom ops, ``radixrt::paged_attention``
and ``radixrt::quant_linear``, opaque to inductor, which fuses the small
elementwise ops between them (norms, rotary, activations, residual adds) into
a few generated C++ loops. The attention op finds the batch's backend and KV
pool in the forward context that `attention_context` sets around the compiled
call (what vLLM's compiled models do); the modules branch to the ops only while
`torch.compiler.is_compiling()`, so the eager path pays nothing.

Inductor runs with ``freezing``: the layers' float weights become constants
it may pack for oneDNN (a second copy of the float linear weights; quantized
layers keep theirs in the custom op).

`warm_up`, run by the scheduler when it starts, compiles both graphs before
the first request.

Shapes: a one-token batch (a single decode) gets its own graph; every other
token count shares one graph with a dynamic first dimension, so serving
compiles at most twice. Inductor caches its generated code on disk
(``$TORCHINDUCTOR_CACHE_DIR``, default ``$RADIXRT_HOME/inductor``), so a
restart with the same model and torch compiles from the cache.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
import time
import weakref
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

import torch
from torch import Tensor

logger = logging.getLogger(__name__)


@dataclass
class _ForwardContext:
    kv_pool: Any
    backend: Any


_local = threading.local()  # .ctx: the forward context of the thread running compiled layers
_quantized: list[Any] = []  # weakrefs to QuantizedLinear modules, by their compile key


@contextmanager
def attention_context(kv_pool: Any, backend: Any) -> Iterator[None]:
    """Run the compiled layers against this batch's KV pool and planned backend."""
    outer = getattr(_local, "ctx", None)
    _local.ctx = _ForwardContext(kv_pool, backend)
    try:
        yield
    finally:
        _local.ctx = outer


def register_quantized(module: Any) -> int:
    """A key under which ``radixrt::quant_linear`` finds ``module`` (held weakly)."""
    _quantized.append(weakref.ref(module))
    return len(_quantized) - 1


@torch.library.custom_op("radixrt::paged_attention", mutates_args=())
def paged_attention(q: Tensor, k: Tensor, v: Tensor, layer_id: int, scale: float) -> Tensor:
    """The context's backend on layer ``layer_id``: stores ``k``/``v`` at the batch's slots
    (the pool is not an argument: no graph tensor is mutated) and returns [T, Hq * D]."""
    ctx: Optional[_ForwardContext] = getattr(_local, "ctx", None)
    assert ctx is not None, "compiled layers called outside attention_context"
    return ctx.backend.forward(q, k, v, ctx.kv_pool.layer_cache(layer_id), scale)


@paged_attention.register_fake
def _(q: Tensor, k: Tensor, v: Tensor, layer_id: int, scale: float) -> Tensor:
    return q.new_empty((q.shape[0], q.shape[1] * q.shape[2]))


@torch.library.custom_op("radixrt::quant_linear", mutates_args=())
def quant_linear(x: Tensor, key: int, out_features: int) -> Tensor:
    """``QuantizedLinear`` number ``key``'s eager product of ``x`` [T, in_features]."""
    module = _quantized[key]()
    assert module is not None, "a compiled graph outlived its quantized layer"
    return module.eager_forward(x)


@quant_linear.register_fake
def _(x: Tensor, key: int, out_features: int) -> Tensor:
    return x.new_empty((*x.shape[:-1], out_features))


def inductor_cache_dir() -> str:
    """Where inductor keeps its generated code: ``$TORCHINDUCTOR_CACHE_DIR`` when set."""
    from radixrt.executor.model_store import radixrt_home

    return os.environ.get("TORCHINDUCTOR_CACHE_DIR") or str(radixrt_home() / "inductor")


def cxx_compiler() -> Optional[str]:
    """The C++ compiler inductor's CPU code would be built with, or None."""
    names = [os.environ.get("CXX") or "g++", "c++", "clang++"]
    return next((path for path in map(shutil.which, names) if path), None)


def enable_compile(model: Any) -> None:
    """Give ``model`` (a `LlamaForCausalLM`) its compiled layer stack (compiled on first call).
    RuntimeError without a C++ compiler."""
    if cxx_compiler() is None:
        raise RuntimeError("--enable-torch-compile needs a C++ compiler (g++, c++ or $CXX) for inductor's code")
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", inductor_cache_dir())
    import torch._inductor.config as inductor_config

    # the weights are constants to inductor: it packs them for oneDNN's CPU products (a bfloat16
    # model decoded 1.15x slower compiled without it than eager; docs/benchmarks.md)
    inductor_config.freezing = True
    model.compiled_layers = CompiledLayers(torch.compile(model.run_layers, fullgraph=True))


def warm_up(runner: Any, allocator: Any) -> None:
    """Compile (or load) both graphs of ``runner``'s model now, if it has them, so that neither
    the first request nor a timing of the forward (speculation's cost probes) pays for it: two
    forwards of one and two tokens on free slots of ``allocator``, freed again (what they
    wrote there is never read)."""
    if getattr(runner.model, "compiled_layers", None) is None:
        return
    slots = allocator.alloc_slots_for(3)
    if slots is None:
        return
    try:
        runner.forward([0], [slots[:1]], [1])
        runner.forward([0, 0], [slots[1:]], [2])
    finally:
        allocator.free_slots(slots)


class CompiledLayers:
    """The compiled ``run_layers(h, cos, sin)``: one-token batches static, the rest dynamic.
    The first call of each kind compiles (or loads inductor's cache) and logs its seconds."""

    def __init__(self, fn: Callable[..., Tensor]) -> None:
        self.fn = fn
        self.compile_s: dict[str, float] = {}  # "one token" / "many tokens": the first call's seconds

    def __call__(self, h: Tensor, cos: Tensor, sin: Tensor, kv_pool: Any, backend: Any) -> Tensor:
        kind = "one token" if h.shape[0] == 1 else "many tokens"
        if kind == "many tokens":
            for t in (h, cos, sin):
                torch._dynamo.mark_dynamic(t, 0)
        first = kind not in self.compile_s
        clock = time.perf_counter()
        with attention_context(kv_pool, backend):
            out = self.fn(h, cos, sin)
        if first:
            self.compile_s[kind] = time.perf_counter() - clock
            logger.info(
                "torch.compile: the %s graph took %.1f s (compiled, or loaded from inductor's cache)",
                kind,
                self.compile_s[kind],
            )
        return out
