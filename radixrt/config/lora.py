"""`LoRASettings`: serving LoRA adapters (SGLang's flag names; the runtime:
radixrt/executor/lora/, radixrt/scheduler/lora_admission.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Collection, Iterable, Optional

from radixrt.config.fields import setting


def parse_lora_paths(items: Optional[list[str]]) -> dict[str, str]:
    """``name=path`` items (or a bare path, named after its folder) as {name: path}."""
    out: dict[str, str] = {}
    for item in items or []:
        name, sep, path = str(item).partition("=")
        if not sep:
            path = name
            name = path.rstrip("/").rsplit("/", 1)[-1]
        if not name or not path:
            raise ValueError(f"lora_paths item {item!r}: expected name=path")
        if name in out:
            raise ValueError(f"lora_paths names adapter {name!r} twice")
        out[name] = path
    return out


# the modules an adapter may adapt, and SGLang's names for groups of them (--lora-target-modules)
ADAPTABLE_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_MODULE_GROUPS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def target_modules(items: Optional[list[str]]) -> Optional[frozenset[str]]:
    """The modules ``--lora-target-modules`` allows: its names, SGLang's ``qkv_proj`` and
    ``gate_up_proj`` as their parts; None (any) when unset or ``all`` is among them.
    ValueError naming a module no adapter can adapt here (``embed_tokens``, ``lm_head``, a typo)."""
    if not items or "all" in items:
        return None
    out: set[str] = set()
    for item in items:
        parts = _MODULE_GROUPS.get(item, (item,))
        if parts[0] not in ADAPTABLE_MODULES:
            allowed = ", ".join((*ADAPTABLE_MODULES, *_MODULE_GROUPS, "all"))
            raise ValueError(f"lora_target_modules: {item!r} is not a module radixrt adapts ({allowed})")
        out.update(parts)
    return frozenset(out)


def unknown_adapter(adapters: Iterable[Optional[str]], known: Collection[str]) -> Optional[str]:
    """The first adapter name of ``adapters`` (requests' ``lora_path``; None: the base model)
    that is not in ``known``, or None: what the server answers with a 400 and the Engine
    raises, before anything is queued."""
    return next((a for a in adapters if a is not None and a not in known), None)


@dataclass(frozen=True)
class LoRASettings:
    """LoRA adapters: several fine-tuned variants of the model served at once."""

    enable_lora: bool = setting(False, "serve LoRA adapters (PEFT folders) next to the base model")
    lora_paths: Optional[list[str]] = setting(
        None, "adapters loaded at start: name=path ... (a bare path is named after its folder); implies --enable-lora"
    )
    max_loras_per_batch: int = setting(8, "most distinct adapters in one step's batch")
    max_loaded_loras: Optional[int] = setting(
        None, "most adapters held in memory; past it the least recently used idle one is unloaded (None: no limit)"
    )
    max_lora_rank: int = setting(64, "the largest adapter rank accepted")
    lora_target_modules: Optional[list[str]] = setting(
        None,
        "the modules adapters may adapt (q_proj k_proj v_proj o_proj gate_proj up_proj down_proj, or SGLang's "
        "qkv_proj, gate_up_proj and all; None: any)",
    )

    def __post_init__(self) -> None:
        parse_lora_paths(self.lora_paths)
        target_modules(self.lora_target_modules)
        if self.max_loras_per_batch < 1 or self.max_lora_rank < 1:
            raise ValueError("max_loras_per_batch and max_lora_rank must be >= 1")
        if self.max_loaded_loras is not None and self.max_loaded_loras < self.max_loras_per_batch:
            raise ValueError(
                f"max_loaded_loras ({self.max_loaded_loras}) must be at least max_loras_per_batch "
                f"({self.max_loras_per_batch}), as in SGLang: a step's adapters are all in memory at once"
            )
