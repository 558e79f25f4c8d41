"""SGLang's ``release_memory_occupation`` / ``resume_memory_occupation``: give memory back while idle.

RL frameworks (verl, slime, OpenRLHF) colocate the trainer with the rollout server and call these
between rollouts. `MemoryOccupation` answers both on the scheduler's thread. Tags (none: all):

* ``kv_cache``: the prefix cache is dropped (every tier) and the KV pool's pages are given back to
  the system (`KVPool.release_pages`: the pool keeps its addresses and reads as zeros, as a new
  one); resuming needs nothing more (pages come back as tokens are written).
* ``weights``: the model's tensors' pages are given back (their contents are lost); resuming reads
  the checkpoint being served again (the start's, or the last ``update_weights_from_disk``'s), as
  SGLang without a CPU backup: weights set by ``update_weights_from_tensor`` since must be sent
  again after resuming (RL loops do: resume the weights, update them, resume the KV cache). Weight
  updates are refused while the weights are released.
* ``cuda_graph``: taken; a CPU has none, so it is never held (nor listed as released).

Releasing needs no request running (SGLang's contract; pause generation or wait first); requests
waiting or arriving meanwhile wait, and run once everything is resumed. On CUDA devices and under
tensor parallelism these are refused (a clear error): the device's memory is not given back here.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Iterator

import torch

from radixrt.memory.kv_pool import release_pages
from radixrt.requests.messages import ControlReply, MemoryOccupationReq

logger = logging.getLogger(__name__)

TAGS = ("kv_cache", "weights", "cuda_graph")


def model_tensors(model: torch.nn.Module) -> Iterator[torch.Tensor]:
    """Every tensor ``model`` holds: parameters, buffers and the tensors of its modules' other
    attributes (a quantized layer's packed weight), each storage once."""
    seen: set[int] = set()

    def each(value: Any) -> Iterator[torch.Tensor]:
        if isinstance(value, torch.Tensor):
            yield value
        elif hasattr(value, "__dataclass_fields__"):
            for name in value.__dataclass_fields__:
                yield from each(getattr(value, name))

    for module in model.modules():
        for value in [*module._parameters.values(), *module._buffers.values(), *vars(module).values()]:
            for t in each(value):
                if t.device.type == "cpu" and t.untyped_storage().data_ptr() not in seen:
                    seen.add(t.untyped_storage().data_ptr())
                    yield t


class MemoryOccupation:
    def __init__(
        self,
        runner: Any,
        kv: Any,
        released: set[str],
        running: Callable[[], bool],
        install: Callable[[Any], None],
    ) -> None:
        """``released``: the tags given back, shared with `GenerationControl` (which holds the steps
        while any is); ``running()``: whether a request runs (or a step is in flight); ``install(loaded)``:
        the scheduler's way to serve weights read again (`SchedulerControl.install_weights`)."""
        self.runner = runner
        self.kv = kv
        self.released = released
        self.running = running
        self.install = install

    def handle(self, msg: MemoryOccupationReq) -> ControlReply:
        try:
            tags = self._tags(msg.tags)
            freed = self._release(tags) if msg.release else self._resume(tags)
        except (ValueError, OSError) as e:
            return ControlReply("memory", ok=False, payload={"message": str(e) or type(e).__name__})
        return ControlReply("memory", payload={"released": sorted(self.released), "freed_bytes": freed})

    def _tags(self, tags: Any) -> list[str]:
        if tags is None or tags == []:
            return list(TAGS)
        if not isinstance(tags, list) or not all(isinstance(t, str) and t in TAGS for t in tags):
            raise ValueError(f"'tags' must be a list of {', '.join(TAGS)} (or null: all).")
        return tags

    def _release(self, tags: list[str]) -> int:
        if not str(self.runner.device).startswith("cpu") or getattr(self.runner, "followers", None) is not None:
            raise ValueError(
                "release_memory_occupation runs on a single CPU process here (not on CUDA, not under --tp)."
            )
        if self.running():
            raise ValueError("requests are running: release memory when idle (pause generation first).")
        freed = 0
        if "kv_cache" in tags and "kv_cache" not in self.released:
            self.kv.tree.reset()
            freed += self.runner.kv_pool.release_pages()
        if "weights" in tags and "weights" not in self.released:
            freed += sum(release_pages(t) for t in model_tensors(self.runner.model))
        self.released.update(t for t in tags if t != "cuda_graph")
        logger.info("released %s: %.1f MB given back", ", ".join(tags), freed / 1e6)
        return freed

    def _resume(self, tags: list[str]) -> int:
        if "weights" in tags and "weights" in self.released:
            self.install(self.runner.load_weights(self.runner.model_path))
        self.released.difference_update(tags)
        return 0
