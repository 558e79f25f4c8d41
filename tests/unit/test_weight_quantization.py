"""Weight-only quantization (``--quantization int8|int4``): the kernels against the
dequantized weights, the tiny model's logits against the float model's, an Engine
generating text, the refusals, and `radixrt plan`'s weight bytes."""

from __future__ import annotations

import argparse

import pytest
import torch

from radixrt.config import EngineConfig
from radixrt.config.weight_format import WeightQuantization
from radixrt.executor.models import load_model
from radixrt.executor.models.quantized_linear import LAYER_LINEARS, QuantizedLinear, quantize_linear
from radixrt.kernels import AttentionMetadata
from radixrt.kernels import quant_linear_cpu as ql
from radixrt.kernels.torch_ref import TorchReferenceBackend
from radixrt.memory.kv_pool import KVPool
from radixrt.plan import ModelShape, add_plan_args, make_plan, plan_main

SPECS = [WeightQuantization("int8"), WeightQuantization("int4", 32), WeightQuantization("int4", 64)]


def _packed(weight: torch.Tensor, spec: WeightQuantization) -> ql.PackedWeight:
    return ql.quantize_int8(weight) if spec.method == "int8" else ql.quantize_int4(weight, spec.group_size)


# ---------------------------------------------------------------- the kernels against the dequantized weight
@pytest.mark.parametrize("layout", ["rows", "tiles"])
@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"{s.method}-{s.group_size}")
def test_native_kernel_equals_the_dequantized_weight(spec, layout):
    """Both layouts; "tiles" runs the AVX-512 VNNI product where the build has it, else the
    kernel converts back to rows (same answer either way)."""
    kernel = ql.load()
    assert kernel is not None, "the native kernel should build on this machine (cc present)"
    gen = torch.Generator().manual_seed(1)
    weight, bias = torch.randn(70, 128, generator=gen), torch.randn(70, generator=gen)  # 70: a partial row block
    packed = _packed(weight, spec)
    dense = ql.dequantize(packed)
    if layout == "tiles":
        packed = ql.to_tiles(packed)
        torch.testing.assert_close(kernel.dequantize(packed), dense, atol=1e-6, rtol=1e-6)  # fma rounding
    for rows in (1, 2, 3, 5, 8, 17, ql.DENSE_MIN_ROWS):  # the last: the dense path (dequantized, then F.linear)
        x = torch.randn(rows, 256, generator=gen)[:, ::2]  # strided rows
        # int8 activations (a scale per run of 32), but for the row layout's dense prefill path
        integer = rows < ql.DENSE_MIN_ROWS or packed.layout == "tiles"
        xk = ql.quantize_activations(x) if integer else x
        expected = xk @ dense.T + bias
        torch.testing.assert_close(kernel.linear(x, packed, bias), expected, atol=2e-4, rtol=1e-4)
        torch.testing.assert_close(
            kernel.linear(x[:, :128].contiguous(), packed), xk[:, :128] @ dense.T, atol=2e-4, rtol=1e-4
        )
        exact = x @ dense.T + bias  # what the activations' rounding costs: well under 1%
        assert (kernel.linear(x, packed, bias) - exact).norm() < 0.01 * exact.norm()


@pytest.mark.parametrize("in_features,group", [(256, 32), (576, 32), (576, 64), (512, 128), (1536, 256), (288, 32)])
def test_int4_blocks_of_eight_runs_and_the_runs_past_them(in_features, group):
    """The row layout's int4 product folds 8 runs (256 inputs) at a time and takes the runs past
    the last whole block one by one (576 = 2 blocks + 2 runs): every split and group size gives
    the dequantized weight's answer, and a row's output does not depend on the other rows."""
    kernel = ql.load()
    assert kernel is not None
    gen = torch.Generator().manual_seed(11)
    packed = ql.quantize_int4(torch.randn(37, in_features, generator=gen), group)
    bias, x = torch.randn(37, generator=gen), 3 * torch.randn(9, in_features, generator=gen)
    got = kernel.linear(x, kernel.prepare(packed), bias)
    expected = ql.quantize_activations(x) @ ql.dequantize(packed).T + bias
    torch.testing.assert_close(got, expected, atol=2e-4, rtol=1e-4)
    for i in (0, 4, 8):
        assert torch.equal(kernel.linear(x[i : i + 1], kernel.prepare(packed), bias)[0], got[i])


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"{s.method}-{s.group_size}")
def test_the_tiles_layout_round_trips_exactly(spec):
    """`to_tiles` / `from_tiles` move codes, scales and minimums without changing one bit, for
    row counts that are and are not whole tiles."""
    gen = torch.Generator().manual_seed(2)
    for n in (16, 37):
        rows = _packed(torch.randn(n, 128, generator=gen), spec)
        tiles = ql.to_tiles(rows)
        assert tiles.layout == "tiles" and tiles.qweight.shape[0] == -(-n // ql.TILE)
        back = ql.from_tiles(tiles)
        assert back.layout == "rows" and torch.equal(back.qweight, rows.qweight)
        assert torch.equal(back.scales, rows.scales)
        assert (back.mins is None) == (rows.mins is None) and (rows.mins is None or torch.equal(back.mins, rows.mins))
        assert torch.equal(ql.dequantize(tiles), ql.dequantize(rows))


def test_the_prefill_product_in_bfloat16_stays_close_to_float32():
    """From DENSE_MIN_ROWS rows on, ``dense_dtype=bfloat16`` multiplies the dequantized weight in
    bf16 (what dtype auto asks for on a CPU with native bf16): bf16's rounding, nothing more."""
    kernel = ql.load()
    assert kernel is not None
    gen = torch.Generator().manual_seed(3)
    packed, bias = ql.quantize_int4(torch.randn(64, 128, generator=gen), 32), torch.randn(64, generator=gen)
    x = torch.randn(ql.DENSE_MIN_ROWS, 128, generator=gen)
    exact = kernel.linear(x, packed, bias)
    half = kernel.linear(x, packed, bias, torch.bfloat16)
    assert half.dtype == torch.float32 and not torch.equal(half, exact)
    assert (half - exact).norm() < 0.01 * exact.norm()


def test_native_kernel_split_over_threads_gives_the_same_bits(monkeypatch):
    """Large calls are split by output columns over torch.get_num_threads() threads: same result."""
    kernel = ql.load()
    assert kernel is not None
    gen = torch.Generator().manual_seed(5)
    packed = kernel.prepare(ql.quantize_int4(torch.randn(200, 96, generator=gen), 32))
    x = torch.randn(6, 96, generator=gen)
    one = kernel.linear(x, packed)
    monkeypatch.setattr(ql, "PARALLEL_MIN_MACS", 1)
    threads = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        assert torch.equal(kernel.linear(x, packed), one)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("spec", SPECS[:2], ids=lambda s: s.method)
def test_torch_fallback_equals_the_dequantized_weight_within_bfloat16(spec):
    """torch's packed kernels take bfloat16 activations: the tolerance is bfloat16's."""
    gen = torch.Generator().manual_seed(2)
    linear = torch.nn.Linear(128, 96)
    torch.nn.init.normal_(linear.weight, generator=gen)
    layer = quantize_linear(linear, spec, kernel=None)
    x = torch.randn(5, 128, generator=gen)
    expected = x @ ql.dequantize(layer.packed).T + linear.bias.detach()
    got = layer(x)
    assert got.dtype == torch.float32
    assert (got - expected).abs().max() <= 0.02 * expected.abs().max()


def test_int4_reproduces_q4_1_weights_exactly():
    """Weights of llama.cpp's Q4_1 form (groups of 32, w = d * q + m with float16 d and m, the
    group's minimum and maximum present) come back from int4 group 32 bit for bit."""
    gen = torch.Generator().manual_seed(3)
    n, k = 48, 256
    d = (torch.rand(n, k // 32, 1, generator=gen) * 0.01 + 1e-3).half().float()
    m = (-torch.rand(n, k // 32, 1, generator=gen) * 0.1).half().float()
    q = torch.randint(0, 16, (n, k // 32, 32), generator=gen)
    q[..., 0], q[..., 1] = 0, 15
    weight = (q * d + m).view(n, k)
    back = ql.dequantize(ql.quantize_int4(weight, 32))
    assert (back - weight).abs().max() <= 1e-7 * weight.abs().max()


# ---------------------------------------------------------------- the tiny model's logits
class _RoundedInputLinear(torch.nn.Module):
    """A float linear layer whose input is rounded as the quantized kernel rounds it."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(ql.quantize_activations(x), self.weight)


@torch.inference_mode()
def _prefill_logits(model, cfg, ids: torch.Tensor) -> torch.Tensor:
    pool = KVPool(cfg.num_layers, len(ids) + 1, 1, cfg.num_kv_heads, cfg.head_dim, torch.float32, "cpu")
    backend = TorchReferenceBackend()
    meta = AttentionMetadata.build([list(range(len(ids)))], [len(ids)], page_size=1)
    backend.plan(meta)
    return model.compute_logits(model(ids, meta.positions, meta, pool, backend))


@pytest.mark.parametrize(
    "spec,max_rms,min_argmax",
    [(WeightQuantization("int8"), 0.04, 0.9), (WeightQuantization("int4", 32, lm_head=True), 0.35, 0.3)],
    ids=["int8", "int4-lm-head"],
)
def test_tiny_model_logits_close_to_the_float_model(tiny_llama, spec, max_rms, min_argmax):
    """Against the float model the error is the quantization's. Stated bounds, on this random
    unit-scale model (which amplifies weight noise far more than a trained one):
    ||logits - float logits|| / ||float logits|| <= 0.04 for int8 (measured 0.018) and 0.35 for
    int4 (0.24), and the top token agreeing at >= 90% / 30% of positions. Against a float model
    holding the dequantized weights and rounding each linear's input as the kernel does
    (`quantize_activations`: 24 rows, below DENSE_MIN_ROWS) every layer's output, for the input
    it met in the model's forward, differs by the float arithmetic's only (1e-4). (Checked layer
    by layer: over a whole model a 1e-6 difference upstream can move one activation across an
    int8 rounding boundary, a step of max|run| / 127.)"""
    ids = torch.randint(0, 49152, (24,), generator=torch.Generator().manual_seed(4))
    ref_model, cfg = load_model(tiny_llama, "float32")
    quant_model, _ = load_model(tiny_llama, "float32", quantization=spec)
    replaced = [m for m in quant_model.modules() if isinstance(m, QuantizedLinear)]
    assert len(replaced) == cfg.num_layers * len(LAYER_LINEARS) + int(spec.lm_head)
    seen: list = []
    hooks = [m.register_forward_hook(lambda m, args, out: seen.append((m, args[0], out))) for m in replaced]
    ref, got = _prefill_logits(ref_model, cfg, ids), _prefill_logits(quant_model, cfg, ids)
    for h in hooks:
        h.remove()
    assert 0 < (got - ref).norm() <= max_rms * ref.norm()
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() >= min_argmax
    assert {id(m) for m, _, _ in seen} == {id(m) for m in replaced}
    for module, x, out in seen:  # the float layer computing exactly what the quantized one stands for
        expected = _RoundedInputLinear(ql.dequantize(module.packed))(x)
        torch.testing.assert_close(
            out, expected if module.bias is None else expected + module.bias, atol=1e-4, rtol=1e-4
        )


# ---------------------------------------------------------------- an Engine, and the refusals
@pytest.mark.parametrize("quantization", ["int8", "int4wo-64"])
def test_engine_generates_text_with_quantized_weights(tiny_llama, quantization):
    from radixrt.engine import Engine

    engine = Engine(model_path=tiny_llama, quantization=quantization, max_total_tokens=512)
    try:
        out = engine.generate("The capital of France is", {"max_new_tokens": 6, "temperature": 0})
        assert len(out["output_ids"]) == 6 and isinstance(out["text"], str) and out["text"]
        linears = [m for m in engine.scheduler.runner.model.modules() if isinstance(m, QuantizedLinear)]
        assert len(linears) == 2 * len(LAYER_LINEARS)  # the tiny model's two layers; the head stays float
        assert all(m.packed.bits == (8 if quantization == "int8" else 4) for m in linears)
        assert all(m.packed.group_size == 64 for m in linears if m.packed.bits == 4)
    finally:
        engine.shutdown()


@pytest.mark.parametrize(
    "flags,message",
    [
        (dict(quantization="int3"), "unknown quantization 'int3'"),
        (dict(quantization="int4", quantization_group_size=48), "quantization_group_size must be one of"),
        (dict(quantization="int8", device="cuda"), "quantization='int8' (--quantization int8) needs device='cpu'"),
        (dict(quantization="int8", quantization_group_size=64), "needs quantization='int4'"),
        (dict(quantize_lm_head=True), "needs quantization='int8' or 'int4'"),
        (dict(quantization="int4wo-64", quantization_group_size=128), "disagree"),
    ],
)
def test_bad_quantization_settings_are_refused_naming_the_flag(flags, message):
    with pytest.raises(ValueError) as e:
        EngineConfig(**flags)
    assert message in str(e.value)


@pytest.mark.parametrize(
    "given,method,group",
    [("int8wo", "int8", 32), ("W8A16", "int8", 32), ("int4_weight_only", "int4", 32), ("int4wo-128", "int4", 128)],
)
def test_aliases_normalize(given, method, group):
    model = EngineConfig(quantization=given).model
    assert (model.quantization, model.quantization_group_size) == (method, group)


# ---------------------------------------------------------------- radixrt plan
SMOL = ModelShape("smol", 30, 576, 9, 3, 64, 1536, 49152, True, False, 8192, "bfloat16")


def test_plan_counts_quantized_linear_bytes():
    params = SMOL.param_count()
    linear = sum(o * i for o, i in SMOL.linear_shapes())
    assert linear == 30 * (576 * 576 * 2 + 2 * 576 * 192 + 3 * 576 * 1536)
    rest = (params - linear) * 2  # bfloat16
    plan8 = make_plan(SMOL, 10**10, params=params, quantization=WeightQuantization("int8"))
    rows = sum(o for o, _ in SMOL.linear_shapes())
    assert plan8.weights_bytes == rest + linear + 4 * rows  # one byte each, a float32 scale per output row
    plan4 = make_plan(SMOL, 10**10, params=params, quantization=WeightQuantization("int4", 32))
    assert plan4.weights_bytes == rest + linear * (0.5 + 4 / 32)  # half a byte, a float16 scale and min per 32
    head = make_plan(SMOL, 10**10, params=params, quantization=WeightQuantization("int4", 32, lm_head=True))
    assert head.weights_bytes == plan4.weights_bytes + 49152 * 576 * 0.625  # tied: a quantized copy
    assert make_plan(SMOL, 10**10, params=params).weights_bytes == params * 2


def test_plan_cli_quantization(capsys, default_model_path):
    parser = argparse.ArgumentParser()
    add_plan_args(parser)
    plan_main(parser.parse_args(["--quantization", "int4wo-64", "--json"]))
    import json

    out = json.loads(capsys.readouterr().out)
    assert out["quantization"] == "int4, group 64, linear layers"
    plan_main(parser.parse_args(["--json"]))
    assert json.loads(capsys.readouterr().out)["weights_bytes"] > out["weights_bytes"]
    with pytest.raises(ValueError, match="unknown quantization 'q4'"):
        plan_main(parser.parse_args(["--quantization", "q4"]))


# ---------------------------------------------------------------- the quality benchmark's inputs
def test_quant_quality_formats_and_heldout_text(tiny_llama):
    from transformers import AutoTokenizer

    from radixrt.bench.quant_quality import engine_flags, heldout_text_ids

    assert engine_flags("float32") == {"dtype": "float32"}
    assert engine_flags("int4-64+head") == {  # dtype auto: float32, prefill products as auto says
        "quantization": "int4",
        "quantize_lm_head": True,
        "quantization_group_size": 64,
    }
    EngineConfig(**engine_flags("int4-64+head"))  # what the bench passes is a valid configuration
    ids = heldout_text_ids(AutoTokenizer.from_pretrained(tiny_llama), 300)
    assert len(ids) == 300 and len(set(ids)) > 100


def test_the_prefill_dtype_follows_dtype_auto(monkeypatch):
    """With dtype auto the quantized model stays float32 and its prefill products take what auto
    means on this CPU; an explicit dtype keeps them float32."""
    from radixrt.executor import cpu_dtype
    from radixrt.executor.runtime_choice import model_dtype, quantization_spec

    spec = WeightQuantization("int8")
    try:
        for pinned in ("bfloat16", "float32"):
            monkeypatch.setenv("RADIXRT_CPU_DTYPE", pinned)
            cpu_dtype.auto_cpu_dtype.cache_clear()
            assert model_dtype("auto", "cpu", quantized=True) == torch.float32
            assert quantization_spec(spec, "auto").prefill_dtype == pinned
            assert quantization_spec(spec, "float32").prefill_dtype == "float32"
        assert quantization_spec(None, "auto") is None
    finally:
        cpu_dtype.auto_cpu_dtype.cache_clear()
