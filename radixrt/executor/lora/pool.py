"""`LoRAPool`: the adapters a runner knows (registered by name) and those it
holds in memory (loaded), with least-recently-used unloading.

Registering reads the adapter's config and hashes its weights file (its
``digest``, the radix namespace of its requests); loading reads the weights
into the model's dtype and device, on the pool's loader thread, so a request
whose adapter is not loaded waits for it (held by the scheduler) while the
others run. At most ``max_loaded`` adapters are held; loading one more
unloads the least recently used adapter that no request holds.
A step holds references to the adapters of its rows, so unloading never
pulls weights from under a running forward.

Loading at run time (`read`, then `install`) checks and reads the folder on
the loader thread too, so a large or slow adapter never pauses the step loop.

Threads: every method runs on the scheduler's thread except the reading
itself (`load`'s and `read`'s jobs, on the loader thread, and
`describe_folder`), which touches only its own result.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Collection, Optional

import torch

from radixrt.config.lora import LoRASettings, parse_lora_paths, target_modules
from radixrt.executor.lora.adapter import (
    LoRAAdapter,
    adapter_digest,
    load_adapter,
    projection_inputs,
    read_config,
    weight_modules,
    weights_file,
)
from radixrt.executor.lora.batch import LoRAContext, install

logger = logging.getLogger(__name__)


# names the pool knows (each listed in /v1/models; the loaded ones are --max-loaded-loras)
MAX_REGISTERED_ADAPTERS = 1024
MAX_ADAPTER_NAME_CHARS = 128


@dataclass
class Registered:
    name: str
    path: str
    digest: str
    rank: int
    invocation_tokens: Optional[tuple[int, ...]] = None  # activated LoRA


class LoRAPool:
    def __init__(
        self,
        sizes: dict[str, list[int]],
        dtype: torch.dtype,
        device: Any,
        max_loaded: Optional[int],
        max_rank: int,
        allowed_modules: Optional[Collection[str]] = None,
        *,
        num_layers: int,
    ) -> None:
        self.sizes = sizes
        self.dtype = dtype
        self.device = device
        self.max_loaded = max_loaded
        self.max_rank = max_rank
        self.target_modules = set(allowed_modules) if allowed_modules else None  # None: any
        self.num_layers = num_layers
        self.max_weights_bytes = weights_bound(sizes, num_layers, max_rank)
        self.registered: dict[str, Registered] = {}
        self.loaded: OrderedDict[str, LoRAAdapter] = OrderedDict()  # least recently used first
        self.loading: dict[str, Future[LoRAAdapter]] = {}
        self._loader = ThreadPoolExecutor(1, thread_name_prefix="radixrt-lora-loader")
        self.loads = 0
        self.unloads = 0

    # -------------------------------------------------------------- registry
    def register(self, name: str, path: str) -> Registered:
        """Know adapter ``name`` at ``path`` (ValueError for a bad folder or name);
        a name registered again with other weights is a new adapter (new digest)."""
        return self._add(self.describe_folder(name, path))

    def describe_folder(self, name: str, path: str) -> Registered:
        """Check the adapter folder at ``path`` for this pool and hash its weights
        (ValueError for a bad folder or name). ``--lora-target-modules`` bounds the modules
        whose weights the file holds (whatever its config's ``target_modules`` says: PEFT
        saves ``all-linear`` as full module names, and a config may list fewer modules than
        its file adapts); weights of a module radixrt does not adapt are refused by name,
        before the size bound. Reads the disk, changes nothing: any thread."""
        if not name or ":" in name or "/" in name or len(name) > MAX_ADAPTER_NAME_CHARS:
            raise ValueError(
                f"LoRA adapter name {name[:80]!r} must be 1-{MAX_ADAPTER_NAME_CHARS} characters, without ':' or '/'"
            )
        folder = Path(path).expanduser()
        cfg = read_config(folder)
        rank = int(cfg.get("r", 8))
        if rank > self.max_rank:
            raise ValueError(f"LoRA adapter {name!r} has rank {rank} > --max-lora-rank {self.max_rank}")
        modules = weight_modules(name, folder)  # the header only: names unsupported modules before the size bound
        if self.target_modules is not None and modules - self.target_modules:
            extra = sorted(modules - self.target_modules)
            raise ValueError(f"LoRA adapter {name!r} adapts {extra}, outside --lora-target-modules")
        size = weights_file(folder).stat().st_size
        if size > self.max_weights_bytes:  # before reading it whole to hash it
            raise ValueError(
                f"LoRA adapter {name!r}: its weights file holds {size} bytes, more than any adapter of rank "
                f"<= --max-lora-rank {self.max_rank} of this model can ({self.max_weights_bytes})"
            )
        inv = cfg.get("alora_invocation_tokens")
        return Registered(name, str(folder), adapter_digest(folder), rank, tuple(int(t) for t in inv) if inv else None)

    def _add(self, reg: Registered) -> Registered:
        if reg.name not in self.registered and len(self.registered) >= MAX_REGISTERED_ADAPTERS:
            raise ValueError(f"{MAX_REGISTERED_ADAPTERS} LoRA adapters are registered already; unload one first")
        old = self.registered.get(reg.name)
        if old is not None and old.digest != reg.digest:
            self._drop(reg.name)
        self.registered[reg.name] = reg
        return reg

    def unregister(self, name: str) -> None:
        if name not in self.registered:
            raise ValueError(f"unknown LoRA adapter {name!r}")
        del self.registered[name]
        self._drop(name)

    def _drop(self, name: str) -> None:
        if self.loaded.pop(name, None) is not None:
            self.unloads += 1
        self.loading.pop(name, None)

    # --------------------------------------------------------------- loading
    def get(self, name: str) -> Optional[LoRAAdapter]:
        """The loaded adapter (marked as just used), or None."""
        adapter = self.loaded.get(name)
        if adapter is not None:
            self.loaded.move_to_end(name)
        return adapter

    def load(self, name: str) -> "Future[LoRAAdapter]":
        """Start loading a registered adapter (or join the load under way)."""
        future = self.loading.get(name)
        if future is None:
            reg = self.registered[name]
            future = self._loader.submit(
                load_adapter, name, reg.path, self.sizes, self.dtype, self.device, self.max_rank, self.num_layers
            )
            self.loading[name] = future
        return future

    def read(self, name: str, path: str) -> "Future[tuple[Registered, LoRAAdapter]]":
        """Check and read the adapter folder at ``path`` on the loader thread (a load at
        run time, ``/load_lora_adapter``); `install` puts the result in the pool."""

        def job() -> tuple[Registered, LoRAAdapter]:
            reg = self.describe_folder(name, path)
            return reg, load_adapter(
                name, reg.path, self.sizes, self.dtype, self.device, self.max_rank, self.num_layers
            )

        return self._loader.submit(job)

    def install(self, reg: Registered, adapter: LoRAAdapter, in_use: set[str]) -> None:
        """Register and hold an adapter `read` returned (replacing one of the same name),
        then unload as `finish_load` does."""
        if adapter.digest != reg.digest:
            raise ValueError(f"LoRA adapter {reg.name!r} changed while it loaded; load it again")
        self._add(reg)
        self.loaded[reg.name] = self._shared(adapter)
        self.loaded.move_to_end(reg.name)
        self.loads += 1
        self.trim(in_use | {reg.name})

    def finish_load(self, name: str, in_use: set[str]) -> LoRAAdapter:
        """Put a finished load in the pool (unloading the least recently used
        adapters no request holds, ``in_use``, past ``max_loaded``); raises the
        load's error."""
        future = self.loading.pop(name)
        adapter = future.result()
        if self.registered.get(name) is None or self.registered[name].digest != adapter.digest:
            raise ValueError(
                f"LoRA adapter {name!r} no longer has the weights it was registered with (its folder changed on "
                "disk after it was loaded, or it was reloaded meanwhile); load it again with /load_lora_adapter"
            )
        self.loaded[name] = adapter = self._shared(adapter)
        self.loads += 1
        self.trim(in_use | {name})
        return adapter

    def _shared(self, adapter: LoRAAdapter) -> LoRAAdapter:
        """``adapter``, holding the weights of a loaded adapter with the same digest (the same
        folder under another name) rather than a second copy of them."""
        twin = next((a for a in self.loaded.values() if a.digest == adapter.digest and a.name != adapter.name), None)
        return adapter if twin is None else replace(adapter, layers=twin.layers, kernel_form=twin.kernel_form)

    @property
    def over_limit(self) -> bool:
        return self.max_loaded is not None and len(self.loaded) > self.max_loaded

    def trim(self, in_use: set[str]) -> None:
        """Unload least recently used adapters not ``in_use`` while past ``max_loaded``
        (a limit the adapters of queued requests may exceed until they finish)."""
        while self.over_limit:
            victim = next((n for n in self.loaded if n not in in_use), None)
            if victim is None:
                return
            self._drop(victim)

    def close(self) -> None:
        self._loader.shutdown(wait=False, cancel_futures=True)

    def describe(self) -> list[dict[str, Any]]:
        """The registered adapters, for /v1/models and server info."""
        return [
            {"name": r.name, "path": r.path, "rank": r.rank, "digest": r.digest[:16], "loaded": r.name in self.loaded}
            for r in self.registered.values()
        ]

    def stats(self) -> dict[str, Any]:
        return {
            "registered": len(self.registered),
            "loaded": len(self.loaded),
            "loads": self.loads,
            "unloads": self.unloads,
        }


def weights_bound(sizes: dict[str, list[int]], num_layers: int, max_rank: int) -> int:
    """The most bytes an adapter file of rank ``max_rank`` for this model can need: every
    module's ``A`` and ``B`` and a bias, in 8-byte numbers, and a megabyte of header."""
    inputs = projection_inputs(sizes)
    per_layer = sum(len(outs) * max_rank * inputs[p] + (max_rank + 1) * sum(outs) for p, outs in sizes.items())
    return num_layers * per_layer * 8 + (1 << 20)


@dataclass
class LoRARuntime:
    """What a runner holds for LoRA: the forward's context and the adapter pool."""

    context: LoRAContext
    pool: LoRAPool


def build_lora(settings: LoRASettings, runner: Any) -> Optional[LoRARuntime]:
    """Wrap the runner's model for LoRA and load ``--lora-paths`` (None when LoRA is off)."""
    if not settings.enable_lora:
        return None
    context = LoRAContext()
    sizes = install_lora(runner, context)
    pool = LoRAPool(
        sizes,
        runner.dtype,
        runner.device,
        settings.max_loaded_loras,
        settings.max_lora_rank,
        target_modules(settings.lora_target_modules),
        num_layers=len(runner.model.model.layers),
    )
    for name, path in parse_lora_paths(settings.lora_paths).items():
        pool.register(name, path)
        pool.load(name).result()
        pool.finish_load(name, set())
    logger.info("LoRA: %d adapter(s) loaded: %s", len(pool.loaded), ", ".join(pool.loaded) or "none")
    return LoRARuntime(context, pool)


def install_lora(runner: Any, context: LoRAContext) -> dict[str, list[int]]:
    """Wrap the linear layers of ``runner``'s model to add the adapters of ``context``; the
    sizes of the wrapped layers."""
    runner.disable_decode_stack()  # the native decode stack would run the linears without their adapters
    return install(runner.model, context)
