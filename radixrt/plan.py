"""Capacity planning: how many tokens and requests fit in GPU memory.

    radixrt plan --model PATH --gpu-mem 80GB [--kv-dtype fp8] [--avg-tokens 2000] [--shared-prefix 1000]

The arithmetic, from the model's own config.json:

    kv_bytes_per_token = 2 (K and V) x layers x kv_heads x head_dim x kv_dtype_bytes
                         (+ 2 x layers x kv_heads x 2 with --kv-dtype int8: the float16
                          scale radixrt keeps per token and KV head)
    weights_bytes      = parameters x weight_dtype_bytes
                         (with --quantization int8|int4: the decoder's linear weights at
                          their quantized size instead, scales included; see
                          radixrt/config/weight_format.py)
    kv_budget          = gpu_mem - weights_bytes - overhead
    max_live_tokens    = kv_budget // kv_bytes_per_token
    concurrency        = max_live_tokens / avg_tokens_per_request
    with a prefix of S tokens shared by every request, stored once:
    concurrency_shared = (max_live_tokens - S) / (avg_tokens - S)

The parameter count comes from the safetensors headers when the folder has
them (shapes only; no tensor is read), else from the config (Llama-family
formula), or from ``--params``. Nothing here imports torch or loads weights.
The KV arithmetic is `radixrt.memory.kv_format`'s, the same the KV pool and
the server's ``/get_server_info`` and ``/metrics`` use.

Units: ``GB`` is 10^9 bytes and ``GiB`` 2^30 (an "80 GB" card has 80 GiB:
pass ``80GiB`` for its full size). Bytes per token print in decimal KB, as
the seeds do (Llama-2-13B in fp16: 819.2 KB).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import struct
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Optional

from radixrt.config.weight_format import DEFAULT_GROUP_SIZE, WeightQuantization, check_group_size, normalize_method
from radixrt.memory.kv_format import KVCacheFormat, KVFootprint, kv_cache_format

DTYPE_BYTES = {
    "float32": 4,
    "fp32": 4,
    "float": 4,
    "float16": 2,
    "fp16": 2,
    "half": 2,
    "bfloat16": 2,
    "bf16": 2,
    "float8": 1,
    "fp8": 1,
    "fp8_e4m3": 1,
    "fp8_e5m2": 1,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int8": 1,
    "uint8": 1,
    "int4": 0.5,
}
_ST_DTYPE_BYTES = {
    "F64": 8,
    "F32": 4,
    "F16": 2,
    "BF16": 2,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "I8": 1,
    "U8": 1,
    "I16": 2,
    "I32": 4,
    "I64": 8,
    "BOOL": 1,
}
_UNITS = {
    "": 10**9,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def parse_bytes(text: str | int | float) -> int:
    """'80GB' -> 80e9, '80GiB' -> 80 * 2^30, '512MB', '1.5TB'; a bare number is GB."""
    if isinstance(text, (int, float)):
        return int(text * 10**9)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"cannot read a memory size from {text!r} (examples: 80GB, 80GiB, 512MB)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def dtype_bytes(name: str) -> float:
    key = name.lower().replace("torch.", "")
    if key not in DTYPE_BYTES:
        raise ValueError(f"unknown dtype {name!r}; one of {', '.join(sorted(DTYPE_BYTES))}")
    return DTYPE_BYTES[key]


@dataclass
class ModelShape:
    """What the arithmetic needs from config.json."""

    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool
    attention_bias: bool
    max_position_embeddings: Optional[int]
    config_dtype: Optional[str]

    @classmethod
    def from_config(cls, cfg: dict[str, Any], name: str = "") -> "ModelShape":
        cfg = cfg.get("text_config") or cfg  # multimodal wrappers keep the LM config nested
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        return cls(
            name=name or cfg.get("_name_or_path") or cfg.get("model_type", "model"),
            num_layers=int(cfg["num_hidden_layers"]),
            hidden_size=hidden,
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            intermediate_size=int(cfg.get("intermediate_size") or 4 * hidden),
            vocab_size=int(cfg["vocab_size"]),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", cfg.get("model_type") == "qwen2")),
            max_position_embeddings=cfg.get("max_position_embeddings"),
            config_dtype=cfg.get("torch_dtype") or cfg.get("dtype"),
        )

    def kv_footprint(self, kv_dtype: str, weight_dtype: str = "bfloat16") -> KVFootprint:
        """Bytes per token of a radixrt KV cache (`kv_format.kv_cache_format`: auto, int8,
        fp8_e4m3, fp8_e5m2, a plain dtype); other names of `DTYPE_BYTES` count their
        element size alone."""
        try:
            fmt = kv_cache_format(kv_dtype, weight_dtype)
        except ValueError:
            fmt = KVCacheFormat(kv_dtype, dtype_bytes(kv_dtype), 0, "unquantized")
        return KVFootprint(self.num_layers, self.num_kv_heads, self.head_dim, fmt)

    def kv_bytes_per_token(self, kv_dtype_bytes: float) -> float:
        """Unscaled storage of ``kv_dtype_bytes`` per value."""
        fmt = KVCacheFormat(f"{kv_dtype_bytes} B", kv_dtype_bytes, 0, "unquantized")
        return KVFootprint(self.num_layers, self.num_kv_heads, self.head_dim, fmt).bytes_per_token

    def linear_shapes(self, lm_head: bool = False) -> list[tuple[int, int]]:
        """[out, in] of every weight `--quantization` quantizes: per layer q, k, v, o, gate, up and
        down (the runtime fuses q/k/v and gate/up: same bytes), and the LM head with ``lm_head``."""
        h, q, kv, i = (
            self.hidden_size,
            self.num_heads * self.head_dim,
            self.num_kv_heads * self.head_dim,
            self.intermediate_size,
        )
        layer = [(q, h), (kv, h), (kv, h), (h, q), (i, h), (i, h), (h, i)]
        return layer * self.num_layers + ([(self.vocab_size, h)] if lm_head else [])

    def weights_bytes(self, params: int, weight_dtype: str, quant: Optional[WeightQuantization] = None) -> float:
        """Bytes of ``params`` parameters in ``weight_dtype``, the linear layers in ``quant``'s format
        (a quantized head tied to the embeddings is a copy: the embeddings stay)."""
        if quant is None:
            return params * dtype_bytes(weight_dtype)
        shapes = self.linear_shapes(quant.lm_head)
        moved = sum(o * i for o, i in shapes)
        if quant.lm_head and self.tie_word_embeddings:
            moved -= self.vocab_size * self.hidden_size
        return (params - moved) * dtype_bytes(weight_dtype) + sum(quant.linear_bytes(o, i) for o, i in shapes)

    def param_count(self) -> int:
        """Llama-family decoder: embeddings, per-layer attention + SwiGLU MLP + 2 norms,
        final norm, and an LM head unless tied to the embeddings."""
        h, hd = self.hidden_size, self.head_dim
        q, kv = self.num_heads * hd, self.num_kv_heads * hd
        attn = h * q + 2 * h * kv + q * h
        if self.attention_bias:
            attn += q + 2 * kv
        layer = attn + 3 * h * self.intermediate_size + 2 * h
        embed = self.vocab_size * h
        head = 0 if self.tie_word_embeddings else self.vocab_size * h
        return embed + self.num_layers * layer + h + head


def safetensors_param_count(folder: Path) -> Optional[int]:
    """Sum of tensor sizes from the safetensors headers (8-byte length + JSON), or None."""
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        return None
    total = 0
    for f in files:
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        for key, meta in header.items():
            if key != "__metadata__":
                total += math.prod(meta["shape"])
    return total


@dataclass
class Plan:
    model: str
    params: int
    params_source: str
    weight_dtype: str
    kv_dtype: str
    kv_bytes_per_token: float
    weights_bytes: float
    gpu_mem_bytes: int
    overhead_bytes: int
    kv_budget_bytes: float
    max_live_tokens: int
    avg_tokens: int
    concurrency: float
    shared_prefix: int
    concurrency_shared: Optional[float]
    max_position_embeddings: Optional[int]
    kv_scale_bytes_per_token: float = 0  # int8: the per-token scales (included in kv_bytes_per_token)
    kv_tokens_per_gib: int = 0
    quantization: Optional[str] = None  # the linear layers' weight format, when quantized
    host_bytes: int = 0  # the host KV tier (--hicache-size), 0: none
    storage_bytes: int = 0  # the storage tier's quota (--hicache-storage-quota-gb), 0: none

    def tier_tokens(self) -> dict[str, int]:
        """Cached tokens each KV tier holds (host and storage store the device's format)."""
        per_token = self.kv_bytes_per_token
        tiers = {"device": self.max_live_tokens, "host": int(self.host_bytes // per_token)}
        return {**tiers, "storage": int(self.storage_bytes // per_token)}

    @property
    def sharing_gain(self) -> Optional[float]:
        if self.concurrency_shared is None or not self.concurrency:
            return None
        return self.concurrency_shared / self.concurrency

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "sharing_gain": self.sharing_gain, "tier_tokens": self.tier_tokens()}


def make_plan(
    shape: ModelShape,
    gpu_mem_bytes: int,
    *,
    params: int,
    params_source: str = "config",
    weight_dtype: str = "bfloat16",
    kv_dtype: Optional[str] = None,
    overhead_bytes: int = 0,
    avg_tokens: int = 2000,
    shared_prefix: int = 0,
    quantization: Optional[WeightQuantization] = None,
    host_bytes: int = 0,
    storage_bytes: int = 0,
) -> Plan:
    if avg_tokens <= 0:
        raise ValueError("avg_tokens must be positive")
    if not 0 <= shared_prefix < avg_tokens:
        raise ValueError(
            f"shared_prefix ({shared_prefix}) must be below avg_tokens ({avg_tokens}): "
            "it is the part of each request's tokens that every request has in common"
        )
    kv_dtype = kv_dtype or weight_dtype
    footprint = shape.kv_footprint(kv_dtype, weight_dtype)
    kv_per_token = footprint.bytes_per_token
    weights = shape.weights_bytes(params, weight_dtype, quantization)
    budget = gpu_mem_bytes - weights - overhead_bytes
    max_tokens = footprint.tokens_in(budget)
    shared = None
    if shared_prefix:
        shared = max(0.0, (max_tokens - shared_prefix) / (avg_tokens - shared_prefix))
    return Plan(
        model=shape.name,
        params=params,
        params_source=params_source,
        weight_dtype=weight_dtype,
        kv_dtype=kv_dtype,
        kv_bytes_per_token=kv_per_token,
        weights_bytes=weights,
        gpu_mem_bytes=gpu_mem_bytes,
        overhead_bytes=overhead_bytes,
        kv_budget_bytes=budget,
        max_live_tokens=max_tokens,
        avg_tokens=avg_tokens,
        concurrency=max_tokens / avg_tokens,
        shared_prefix=shared_prefix,
        concurrency_shared=shared,
        max_position_embeddings=shape.max_position_embeddings,
        kv_scale_bytes_per_token=footprint.scale_bytes_per_token,
        kv_tokens_per_gib=footprint.tokens_per_gib,
        quantization=_quant_label(quantization),
        host_bytes=host_bytes,
        storage_bytes=storage_bytes,
    )


def _quant_label(q: Optional[WeightQuantization]) -> Optional[str]:
    if q is None:
        return None
    group = f", group {q.group_size}" if q.method == "int4" else ""
    return f"{q.method}{group}, linear layers" + (" and LM head" if q.lm_head else "")


def load_shape(model: str) -> tuple[ModelShape, Path]:
    """Read config.json from a model folder (or "default", the embedded model) -- nothing else."""
    from radixrt.executor.model_store import resolve_model_path  # stdlib-only module

    folder = Path(resolve_model_path(model))
    cfg = json.loads((folder / "config.json").read_text())
    name = folder.name if model != "default" else f"default ({folder.name})"
    return ModelShape.from_config(cfg, name=name), folder


def _gb(x: float) -> str:
    return f"{x / 1e9:,.2f} GB"


def format_plan(p: Plan) -> str:
    rows = [
        ("model", p.model),
        ("parameters", f"{p.params:,} ({p.params / 1e9:.2f} B, from {p.params_source})"),
        ("weights", f"{_gb(p.weights_bytes)} ({p.weight_dtype}" + (f"; {p.quantization})" if p.quantization else ")")),
        (
            "KV bytes per token",
            f"{p.kv_bytes_per_token:,.0f} B = {p.kv_bytes_per_token / 1e3:,.1f} KB ({p.kv_dtype}"
            + (f", scales {p.kv_scale_bytes_per_token:,.0f} B" if p.kv_scale_bytes_per_token else "")
            + ")",
        ),
        ("KV tokens per GiB", f"{p.kv_tokens_per_gib:,}"),
        ("GPU memory", _gb(p.gpu_mem_bytes)),
        (
            "overhead (activations etc.)",
            _gb(p.overhead_bytes) + ("  (none reserved: pass --overhead, e.g. 4GB)" if not p.overhead_bytes else ""),
        ),
        ("KV budget", _gb(p.kv_budget_bytes)),
        ("max live tokens", f"{p.max_live_tokens:,}"),
        (f"concurrency at {p.avg_tokens:,} tokens/request", f"{p.concurrency:,.1f}"),
    ]
    if p.concurrency_shared is not None:
        rows.append(
            (
                f"  with a {p.shared_prefix:,}-token shared prefix",
                f"{p.concurrency_shared:,.1f} ({p.sharing_gain:.2f}x)",
            )
        )
    tiers = p.tier_tokens()
    for tier, size in (("host", p.host_bytes), ("storage", p.storage_bytes)):
        if size:
            rows.append((f"{tier} tier ({_gb(size)})", f"{tiers[tier]:,} cached tokens"))
    if p.max_position_embeddings and p.max_live_tokens < p.max_position_embeddings:
        rows.append(("note", f"one full-context request ({p.max_position_embeddings:,} tokens) does not fit"))
    if p.kv_budget_bytes <= 0:
        rows.append(("note", "the weights alone do not fit in this memory"))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def add_plan_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="default", help="model folder with config.json, or 'default'")
    p.add_argument("--gpu-mem", default="80GB", help="GPU memory: 80GB (10^9 B), 80GiB (2^30 B), 141GB ...")
    p.add_argument(
        "--kv-dtype",
        default=None,
        help="KV cache dtype: fp16, bf16, fp32, fp8 (= fp8_e4m3), fp8_e5m2, "
        "int8 (with radixrt's float16 scale per token and KV head) "
        "(default: the weight dtype)",
    )
    p.add_argument(
        "--weight-dtype", default="bf16", help="weights dtype as served (default bf16, what radixrt runs on CUDA)"
    )
    p.add_argument("--avg-tokens", type=int, default=2000, help="average live tokens per request (prompt + output)")
    p.add_argument(
        "--shared-prefix",
        type=int,
        default=0,
        help="tokens every request shares (system prompt, few-shot examples), stored once",
    )
    p.add_argument(
        "--overhead",
        default="0GB",
        help="memory kept for activations, CUDA context, graphs (default 0GB: none reserved; 2-4GB is realistic)",
    )
    p.add_argument(
        "--quantization",
        default=None,
        help="weight-only quantization of the linear layers, as `radixrt serve --quantization`: int8 or int4 "
        "(and their aliases); the rest stays in --weight-dtype",
    )
    p.add_argument("--quantization-group-size", type=int, default=DEFAULT_GROUP_SIZE, help="int4's group size")
    p.add_argument("--quantize-lm-head", action="store_true", help="with --quantization: the LM head too")
    p.add_argument("--host-mem", default="0GB", help="host KV tier size (--hicache-size), e.g. 64GB: its capacity")
    p.add_argument("--storage", default="0GB", help="storage tier quota, e.g. 1TB: its capacity in tokens")
    p.add_argument("--params", type=float, default=None, help="override the parameter count (e.g. 13e9)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")


def _quantization(args: argparse.Namespace) -> Optional[WeightQuantization]:
    """The format of --quantization (ValueError naming the flag for an unknown one)."""
    method, group = normalize_method(args.quantization)
    if method is None:
        return None
    group = group or args.quantization_group_size
    check_group_size(group)
    return WeightQuantization(method, group, args.quantize_lm_head)


def plan_main(args: argparse.Namespace) -> int:
    shape, folder = load_shape(args.model)
    if args.params is not None:
        params, source = int(args.params), "--params"
    else:
        counted = safetensors_param_count(folder)
        params, source = (counted, "safetensors headers") if counted else (shape.param_count(), "config.json")
    plan = make_plan(
        shape,
        parse_bytes(args.gpu_mem),
        params=params,
        params_source=source,
        weight_dtype=args.weight_dtype,
        kv_dtype=args.kv_dtype,
        overhead_bytes=parse_bytes(args.overhead),
        avg_tokens=args.avg_tokens,
        shared_prefix=args.shared_prefix,
        quantization=_quantization(args),
        host_bytes=parse_bytes(args.host_mem),
        storage_bytes=parse_bytes(args.storage),
    )
    print(json.dumps(plan.to_dict(), indent=2) if args.json else format_plan(plan))
    return 0
