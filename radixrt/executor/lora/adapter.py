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
``use_rslora``), per module where ``rank_pattern`` / ``alpha_pattern`` say,
their keys matched against the module's full name as PEFT matches them.

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

import regex  # type: ignore[import-untyped]  # re has no timeout
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
_KEY = re.compile(r"layers\.(\d{1,9})\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.(weight|bias)$")
# an alpha_pattern is a client's regex matched against module names: a catastrophic one gets this long
PATTERN_TIMEOUT_S = 0.05


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


def adapter_dtype(adapter: LoRAAdapter) -> torch.dtype:
    """The dtype of the adapter's weights (float32 for one that adapts nothing)."""
    return next(iter(adapter.layers.values())).a_t.dtype if adapter.layers else torch.float32


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
        raise ValueError(f"LoRA adapter {str(folder)!r}: its peft_type is {str(cfg.get('peft_type'))[:32]}, not LORA")
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


MAX_HEADER_BYTES = 1 << 24  # a safetensors header of an adapter: a few hundred bytes per tensor


def weight_modules(name: str, folder: Path) -> set[str]:
    """The PEFT modules (``q_proj``, ...) whose weights the adapter's safetensors file holds,
    from its header only (the file's size is not bounded yet). ValueError for a header that
    is not one, or for weights of modules radixrt does not adapt (``lm_head``,
    ``embed_tokens``, ...), naming them."""
    path = weights_file(folder)
    # read by hand, not with safetensors.safe_open: that checks the whole file's layout, and this
    # runs before the file's size is bounded (a sparse 16 GiB file is refused by its size next)
    with open(path, "rb") as f:
        head = f.read(8)
        length = int.from_bytes(head, "little") if len(head) == 8 else -1
        if not 0 < length <= min(MAX_HEADER_BYTES, path.stat().st_size - 8):
            raise ValueError(f"LoRA adapter {name!r}: {path.name} has no safetensors header")
        try:
            header = json.loads(f.read(length))
        except (json.JSONDecodeError, UnicodeDecodeError):
            header = None
    if not isinstance(header, dict):
        raise ValueError(f"LoRA adapter {name!r}: {path.name} has no safetensors header")
    modules, unsupported = set(), set()
    for key in header:
        if key == "__metadata__":
            continue
        m = _KEY.search(key)
        if m is not None and m.group(2) in PARTS:
            modules.add(m.group(2))
        else:
            unsupported.add(_module_of(key))
    if unsupported:
        raise ValueError(
            f"LoRA adapter {name!r} has weights for {sorted(unsupported)}: radixrt adapts only {', '.join(PARTS)}"
        )
    return modules


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


def projection_inputs(sizes: dict[str, list[int]]) -> dict[str, int]:
    """Each fused projection's input width, from the output slices `install` returns."""
    hidden, q, inter = sizes["o"][0], sizes["qkv"][0], sizes["gate_up"][0]
    return {"qkv": hidden, "o": q, "gate_up": hidden, "down": inter}


def pattern_value(patterns: Any, module_path: str, name: str, field_name: str) -> Any:
    """The value of the first key of ``patterns`` (PEFT's ``alpha_pattern`` / ``rank_pattern``)
    that matches module ``module_path`` (e.g. ``model.layers.0.self_attn.q_proj``) as PEFT's
    ``get_pattern_key`` matches it: ``(.*\\.)?(key)$`` from the start of the name, so a key
    names whole trailing components (``layers.1.self_attn.q_proj`` is not ``layers.11``'s);
    None when none matches. ValueError for a key that is no regex or runs past `PATTERN_TIMEOUT_S`."""
    if not isinstance(patterns or {}, dict):
        raise ValueError(f"LoRA adapter {name!r}: {field_name} is not a JSON object")
    for pattern, value in (patterns or {}).items():
        try:
            if regex.match(rf"(.*\.)?({pattern})$", module_path, timeout=PATTERN_TIMEOUT_S):
                return value
        except (regex.error, TimeoutError) as e:
            raise ValueError(f"LoRA adapter {name!r}: {field_name} {str(pattern)[:80]!r}: {e}") from None
    return None


def _scaling(name: str, cfg: dict[str, Any], module_path: str, rank: int) -> float:
    """PEFT's scaling of module ``module_path`` (its full name in the model, as PEFT names
    it) of rank ``rank`` (its weights' own, which ``rank_pattern`` sets in PEFT): ``lora_alpha
    / r`` (or ``/ sqrt(r)``), ``alpha_pattern`` applied (`pattern_value`); ValueError for a bad
    pattern or a scaling not finite."""
    alpha = pattern_value(cfg.get("alpha_pattern"), module_path, name, "alpha_pattern")
    if alpha is None:
        alpha = cfg.get("lora_alpha", 8)
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
        raise ValueError(f"LoRA adapter {name!r}: lora_alpha of {module_path} is not a number")
    scaling = alpha / math.sqrt(rank) if cfg.get("use_rslora") else alpha / rank
    if not math.isfinite(scaling) or abs(scaling) > 1e6:
        raise ValueError(f"LoRA adapter {name!r}: {module_path} has scaling {scaling}, not a finite one up to 1e6")
    return scaling


def _module_of(key: str) -> str:
    """The module's own name of any key a PEFT file holds (``...lm_head.lora_A.weight``,
    ``...embed_tokens.base_layer.weight``, ``...embed_tokens.lora_embedding_A``)."""
    names = peft_module_name(key).split(".")
    while len(names) > 1 and names[-1] in ("weight", "bias", "base_layer"):
        names.pop()
    return names[-1]


def peft_module_name(key: str) -> str:
    """The full name in the model of the module a PEFT weight key is for, as PEFT matches its
    patterns against it: ``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``
    -> ``model.layers.0.self_attn.q_proj``."""
    path = key[: key.rindex(".lora_")] if ".lora_" in key else key
    return path.removeprefix("base_model.model.")


def load_adapter(
    name: str,
    folder_text: str,
    sizes: dict[str, list[int]],
    dtype: torch.dtype,
    device: Any,
    max_rank: int,
    num_layers: int,
) -> LoRAAdapter:
    """Read a PEFT folder for a model of ``num_layers`` layers whose fused projections have
    output slices ``sizes`` (e.g. ``{"qkv": [q, kv, kv], "o": [h], "gate_up": [i, i], "down":
    [h]}``). ValueError for a weight that is not a floating tensor of its module's shape (rank
    at most ``max_rank``) in one of the model's layers, each checked before it is converted."""
    from safetensors.torch import load_file

    folder = Path(folder_text).expanduser()
    cfg = read_config(folder)
    raw = load_file(str(weights_file(folder)))
    modules: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    paths: dict[tuple[int, str], str] = {}
    for key, tensor in raw.items():
        m = _KEY.search(key)
        if m is None or m.group(2) not in PARTS:
            raise ValueError(f"LoRA adapter {name!r}: unsupported weight {key!r}")
        layer, module, ab, kind = int(m.group(1)), m.group(2), m.group(3), m.group(4)
        if layer >= num_layers:
            raise ValueError(f"LoRA adapter {name!r}: {key!r} is for layer {layer}; the model has {num_layers}")
        modules.setdefault((layer, module), {})[ab + ("_bias" if kind == "bias" else "")] = tensor
        paths[(layer, module)] = peft_module_name(key)
    digest = adapter_digest(folder)
    adapter = LoRAAdapter(name, str(folder), digest, 0, tuple(sorted({mod for _, mod in modules})))
    inv = cfg.get("alora_invocation_tokens")
    adapter.invocation_tokens = tuple(int(t) for t in inv) if inv else None
    grouped: dict[tuple[int, str], list[tuple[int, dict[str, torch.Tensor], str]]] = {}
    for (layer, module), w in sorted(modules.items()):
        projection, index = PARTS[module]
        grouped.setdefault((layer, projection), []).append((index, w, paths[(layer, module)]))
    for (layer, projection), parts in grouped.items():
        shape = (projection_inputs(sizes)[projection], sizes[projection], max_rank)
        adapter.layers[(layer, projection)] = _projection(name, cfg, shape, parts, dtype, device)
        adapter.rank = max(adapter.rank, *(p.ranks[1] - p.ranks[0] for p in adapter.layers[(layer, projection)].parts))
    return adapter


def _check_module(name: str, module_key: str, w: dict[str, torch.Tensor], width: int, out: int, max_rank: int) -> int:
    """The rank of a module's weights ``w``, or ValueError unless they are floating tensors
    ``A [r, width]``, ``B [out, r]`` and a bias ``[out]``, with ``0 < r <= max_rank``."""
    if "A" not in w or "B" not in w:
        raise ValueError(f"LoRA adapter {name!r}: {module_key} lacks lora_A or lora_B")
    a, b, bias = w["A"], w["B"], w.get("B_bias")
    r = a.shape[0] if a.dim() == 2 else 0
    if not all(t.is_floating_point() for t in (a, b) + ((bias,) if bias is not None else ())):
        raise ValueError(f"LoRA adapter {name!r}: {module_key} has weights that are not floating point")
    if a.shape != (r, width) or b.shape != (out, r) or not 0 < r or (bias is not None and bias.shape != (out,)):
        raise ValueError(
            f"LoRA adapter {name!r}: {module_key} has shapes {tuple(a.shape)}, {tuple(b.shape)}; "
            f"the model's module takes {width} inputs to {out} outputs"
        )
    if r > max_rank:
        raise ValueError(f"LoRA adapter {name!r} has rank {r} > --max-lora-rank {max_rank}")
    return r


def _check_configured_rank(name: str, cfg: dict[str, Any], module_key: str, rank: int) -> None:
    """ValueError unless a module's weights have the rank its config gives it (``rank_pattern``,
    else ``r``, 8 when unset, as PEFT reads it): PEFT refuses a folder whose weights disagree."""
    configured = pattern_value(cfg.get("rank_pattern"), module_key, name, "rank_pattern")
    configured = cfg.get("r", 8) if configured is None else configured
    if configured != rank or isinstance(configured, bool):
        raise ValueError(
            f"LoRA adapter {name!r}: {module_key} has weights of rank {rank}, but adapter_config.json gives it "
            f"r = {str(configured)[:32]}"
        )


def _projection(
    name: str,
    cfg: dict[str, Any],
    shape: tuple[int, list[int], int],
    parts: list[tuple[int, dict[str, torch.Tensor], str]],
    dtype: torch.dtype,
    device: Any,
) -> ProjectionDelta:
    """A projection's delta from its adapted parts; ``shape``: its input width, output slices
    and the largest rank allowed."""
    width, slices, max_rank = shape
    a_list, out_parts, r0 = [], [], 0
    for index, w, module_key in sorted(parts, key=lambda p: p[0]):
        r = _check_module(name, module_key, w, width, slices[index], max_rank)
        _check_configured_rank(name, cfg, module_key, r)
        a, b = w["A"].float(), w["B"].float()
        s = _scaling(name, cfg, module_key, r)
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
