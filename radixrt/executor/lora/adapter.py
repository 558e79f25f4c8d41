"""One LoRA adapter, read from a PEFT folder (``adapter_config.json`` and
``adapter_model.safetensors``) into the shapes of radixrt's fused projections.

PEFT names its modules after the Hugging Face layout (``q_proj``, ``k_proj``,
``v_proj``, ``o_proj``, ``gate_proj``, ``up_proj``, ``down_proj``); radixrt
fuses ``qkv_proj`` and ``gate_up_proj`` (models/llama.py), so each adapted
module becomes a *part* of a fused projection: an output slice of it. Per
projection an adapter keeps one ``A_t`` (every part's ``lora_A`` stacked and
transposed, ``[in, R]``) and per part its ``lora_B`` transposed and already
multiplied by the part's scaling (``[r, out]``), with ``lora_B``'s bias
(``lora_bias``), likewise scaled, so that a projection's delta is
``x @ A_t`` once, then one small product per part:

    out[:, part] += (x @ A_t)[:, part's ranks] @ B_t + bias

as PEFT computes ``lora_B(lora_A(x)) * scaling`` (dropout is off at
inference). Scaling is ``lora_alpha / r`` (``lora_alpha / sqrt(r)`` with
``use_rslora``), per module where ``rank_pattern`` / ``alpha_pattern`` say.

``digest``: a hash of the adapter's weights and of the config fields that
change its output: the radix cache's namespace for its requests, so a name
reloaded with new weights never reuses the old KV and two names for the same
weights share theirs. Activated LoRA (``alora_invocation_tokens``): the
adapter applies from the last occurrence of those tokens in the prompt on.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch

# PEFT module -> (radixrt projection, index of its output slice)
PARTS = {
    "q_proj": ("qkv", 0),
    "k_proj": ("qkv", 1),
    "v_proj": ("qkv", 2),
    "o_proj": ("o", 0),
    "gate_proj": ("gate_up", 0),
    "up_proj": ("gate_up", 1),
    "down_proj": ("down", 0),
}
NEVER = 1 << 62  # an activation start no position reaches
UNSUPPORTED = ("use_dora", "modules_to_save", "fan_in_fan_out")
_KEY = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.(weight|bias)$")


@dataclass
class Part:
    """One adapted module inside a fused projection."""

    offset: int  # first output column of the projection it writes
    ranks: tuple[int, int]  # its columns of x @ A_t
    b_t: torch.Tensor  # [r, out_len], scaled
    bias: Optional[torch.Tensor] = None  # [out_len], scaled


@dataclass
class ProjectionDelta:
    a_t: torch.Tensor  # [in, R]: every part's lora_A, transposed and stacked
    parts: list[Part] = field(default_factory=list)


@dataclass
class LoRAAdapter:
    name: str
    path: str
    digest: str
    rank: int  # the largest rank of its modules
    targets: tuple[str, ...]  # PEFT module names it adapts
    invocation_tokens: Optional[tuple[int, ...]] = None  # activated LoRA
    layers: dict[tuple[int, str], ProjectionDelta] = field(default_factory=dict)  # (layer, projection)
    kernel_form: Optional[Any] = field(default=None, repr=False)  # the CPU kernel's descriptors (lora/native.py)

    @property
    def num_bytes(self) -> int:
        tensors = [d.a_t for d in self.layers.values()]
        tensors += [t for d in self.layers.values() for p in d.parts for t in (p.b_t, p.bias) if t is not None]
        return sum(t.numel() * t.element_size() for t in tensors)

    def activation_start(self, prompt: list[int]) -> int:
        """Where the adapter starts to apply in a request with this prompt (0 for
        plain LoRA; for activated LoRA the start of the invocation tokens' last
        occurrence, and never when they do not occur: the base model, as PEFT)."""
        inv = self.invocation_tokens
        if not inv:
            return 0
        k = len(inv)
        for start in range(len(prompt) - k, -1, -1):
            if tuple(prompt[start : start + k]) == inv:
                return start
        return NEVER


MAX_CONFIG_BYTES = 1 << 20  # a PEFT config is a few KB


def read_config(folder: Path) -> dict[str, Any]:
    path = folder / "adapter_config.json"
    if not path.is_file():
        raise ValueError(f"LoRA adapter {str(folder)!r} has no adapter_config.json (a PEFT folder is expected)")
    if path.stat().st_size > MAX_CONFIG_BYTES:
        raise ValueError(f"LoRA adapter {str(folder)!r}: adapter_config.json is over {MAX_CONFIG_BYTES} bytes")
    try:
        cfg = json.loads(path.read_text())
    except json.JSONDecodeError as e:  # its message only: the error object keeps the whole text
        raise ValueError(
            f"LoRA adapter {str(folder)!r}: adapter_config.json is not JSON ({e.msg}, line {e.lineno})"
        ) from None
    if not isinstance(cfg, dict):
        raise ValueError(f"LoRA adapter {str(folder)!r}: adapter_config.json is not a JSON object")
    if str(cfg.get("peft_type", "LORA")).upper() != "LORA":
        raise ValueError(f"adapter {str(folder)!r} is {cfg.get('peft_type')}, not LoRA")
    for key in UNSUPPORTED:
        if cfg.get(key):
            raise ValueError(f"LoRA adapter {str(folder)!r}: {key} is not supported")
    return cfg


def weights_file(folder: Path) -> Path:
    for name in ("adapter_model.safetensors", "adapter_model.bin"):
        if (folder / name).is_file():
            if name.endswith(".bin"):
                raise ValueError(f"LoRA adapter {str(folder)!r}: only safetensors weights are read")
            return folder / name
    raise ValueError(f"LoRA adapter {str(folder)!r} has no adapter_model.safetensors")


def adapter_digest(folder: Path) -> str:
    """A hash of the adapter's weights file and of its config (what its KV depends on)."""
    cfg = read_config(folder)
    h = hashlib.blake2b(digest_size=16)
    relevant = {k: cfg.get(k) for k in ("r", "lora_alpha", "use_rslora", "rank_pattern", "alpha_pattern")}
    relevant["alora_invocation_tokens"] = cfg.get("alora_invocation_tokens")
    h.update(json.dumps(relevant, sort_keys=True, default=str).encode())
    with open(weights_file(folder), "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _scaling(cfg: dict[str, Any], module_key: str, rank: int) -> float:
    alpha = cfg.get("lora_alpha", 8)
    for pattern, value in (cfg.get("alpha_pattern") or {}).items():
        if re.search(pattern, module_key):
            alpha = value
    return alpha / math.sqrt(rank) if cfg.get("use_rslora") else alpha / rank


def load_adapter(
    name: str, folder_text: str, sizes: dict[str, list[int]], dtype: torch.dtype, device: Any, max_rank: int
) -> LoRAAdapter:
    """Read a PEFT folder for a model whose fused projections have output slices
    ``sizes`` (e.g. ``{"qkv": [q, kv, kv], "o": [h], "gate_up": [i, i], "down": [h]}``)."""
    from safetensors.torch import load_file

    folder = Path(folder_text).expanduser()
    cfg = read_config(folder)
    raw = load_file(str(weights_file(folder)))
    modules: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in raw.items():
        m = _KEY.search(key)
        if m is None or m.group(2) not in PARTS:
            raise ValueError(f"LoRA adapter {name!r}: unsupported weight {key!r}")
        layer, module, ab, kind = int(m.group(1)), m.group(2), m.group(3), m.group(4)
        modules.setdefault((layer, module), {})[ab + ("_bias" if kind == "bias" else "")] = tensor
    digest = adapter_digest(folder)
    adapter = LoRAAdapter(name, str(folder), digest, 0, tuple(sorted({mod for _, mod in modules})))
    inv = cfg.get("alora_invocation_tokens")
    adapter.invocation_tokens = tuple(int(t) for t in inv) if inv else None
    grouped: dict[tuple[int, str], list[tuple[int, dict[str, torch.Tensor], str]]] = {}
    for (layer, module), w in sorted(modules.items()):
        projection, index = PARTS[module]
        grouped.setdefault((layer, projection), []).append((index, w, f"layers.{layer}.{module}"))
    for (layer, projection), parts in grouped.items():
        adapter.layers[(layer, projection)] = _projection(name, cfg, sizes[projection], parts, dtype, device)
        adapter.rank = max(adapter.rank, *(p.ranks[1] - p.ranks[0] for p in adapter.layers[(layer, projection)].parts))
    if adapter.rank > max_rank:
        raise ValueError(f"LoRA adapter {name!r} has rank {adapter.rank} > --max-lora-rank {max_rank}")
    return adapter


def _projection(
    name: str,
    cfg: dict[str, Any],
    slices: list[int],
    parts: list[tuple[int, dict[str, torch.Tensor], str]],
    dtype: torch.dtype,
    device: Any,
) -> ProjectionDelta:
    a_list, out_parts, r0 = [], [], 0
    for index, w, module_key in sorted(parts, key=lambda p: p[0]):
        if "A" not in w or "B" not in w:
            raise ValueError(f"LoRA adapter {name!r}: {module_key} lacks lora_A or lora_B")
        a, b = w["A"].float(), w["B"].float()
        r = a.shape[0]
        if b.shape != (slices[index], r) or a.shape[1] <= 0:
            raise ValueError(f"LoRA adapter {name!r}: {module_key} has shapes {tuple(a.shape)}, {tuple(b.shape)}")
        s = _scaling(cfg, module_key, r)
        bias = w.get("B_bias")
        out_parts.append(
            Part(
                sum(slices[:index]),
                (r0, r0 + r),
                (b * s).t().contiguous().to(device, dtype),
                None if bias is None else (bias.float() * s).to(device, dtype),
            )
        )
        a_list.append(a)
        r0 += r
    return ProjectionDelta(torch.cat(a_list, 0).t().contiguous().to(device, dtype), out_parts)
