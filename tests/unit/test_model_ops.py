"""The decode step's cheaper formulations give the reference formulas' results:
RMSNorm, rope's position table and rotation, the folded GQA decode attention
(padding never contributes), the lazily cut ``kv_slots`` and the greedy pick."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig

from radixrt.executor.models.llama import RMSNorm
from radixrt.executor.models.rope import RotaryEmbedding
from radixrt.kernels import AttentionMetadata, LayerKVCache, row_ops_cpu
from radixrt.kernels.torch_ref import TorchReferenceBackend
from radixrt.sampling.params import SamplingParams
from radixrt.sampling.sampler import Sampler, SamplingRow


def _reference_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm: normalize in float32, cast back, then scale."""
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(1, 64), (37, 576), (5, 3, 16)])
def test_rms_norm_is_bitwise_the_reference(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    torch.manual_seed(0)
    norm = RMSNorm(shape[-1], 1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(shape[-1]) + 0.5)
    x = (torch.randn(shape) * 3).to(dtype)
    with torch.no_grad():
        assert torch.equal(norm(x), _reference_rms_norm(x, norm.weight, 1e-5))


@pytest.mark.parametrize("shape", [(1, 576), (9, 960), (63, 64), (3, 70)])
def test_native_rms_norm_is_within_a_few_ulp_of_the_reference(shape: tuple[int, int]) -> None:
    """The CPU kernel a model's float32 norms get (`use_native_row_ops`) for fewer than
    ``max_rows`` rows: a correctly rounded mean, within a few units in the last place of the
    reference (a row whose float32 mean rounds differently differs in most elements); from
    ``max_rows`` rows on, and for strided rows, torch's op, bitwise."""
    native = row_ops_cpu.load()
    assert native is not None, "the RMSNorm kernel should build here (cc present)"
    torch.manual_seed(1)
    norm = RMSNorm(shape[-1], 1e-5)
    norm.native = native
    with torch.no_grad():
        norm.weight.copy_(torch.rand(shape[-1]) + 0.5)
        x = torch.randn(shape) * 3
        got, reference = norm(x), _reference_rms_norm(x, norm.weight, 1e-5)
        torch.testing.assert_close(got, reference, rtol=1e-6, atol=1e-7)
        many = torch.randn(native.max_rows, shape[-1])
        assert torch.equal(norm(many), _reference_rms_norm(many, norm.weight, 1e-5))
        strided = torch.randn(shape[0], 2 * shape[-1])[:, ::2]  # rows must be contiguous: torch's op
        assert torch.equal(norm(strided), _reference_rms_norm(strided, norm.weight, 1e-5))


ROPE_CONFIGS = {
    "default": {},
    "llama3": {
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 1024,
        }
    },
}


@pytest.mark.parametrize("name", list(ROPE_CONFIGS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_table_rows_are_the_computed_cos_sin(name: str, dtype: torch.dtype) -> None:
    cfg = LlamaConfig(hidden_size=128, num_attention_heads=2, max_position_embeddings=4096, **ROPE_CONFIGS[name])
    rope = RotaryEmbedding(cfg, 64)
    for positions in (torch.tensor([0, 3]), torch.tensor([5, 300, 77]), torch.randint(0, 3000, (41,))):
        want_cos, want_sin = rope._cos_sin(positions, dtype, None)
        n = int(positions.max()) + 1
        cos, sin = rope.cos_sin(positions, dtype, [1] * len(positions), [n] * len(positions))
        assert torch.equal(cos, want_cos) and torch.equal(sin, want_sin)
    assert rope.reserve(1, "cpu", dtype).shape[0] >= 3000  # grown, never shrunk


def test_a_partial_rotary_factor_is_read_as_transformers_reads_it() -> None:
    """transformers' Llama-family models rotate the whole head: the default RoPE ignores the factor
    (it rotated half the head here: logprobs 3.6 off), and a scaled one, whose frequencies cover
    part of the head (transformers fails there), is refused."""
    cfg = LlamaConfig(hidden_size=128, num_attention_heads=2, partial_rotary_factor=0.5)
    assert RotaryEmbedding(cfg, 64).rotary_dim == 64
    scaled = LlamaConfig(
        hidden_size=128,
        num_attention_heads=2,
        partial_rotary_factor=0.5,
        rope_scaling={"rope_type": "linear", "factor": 2.0},
    )
    with pytest.raises(ValueError, match="partial_rotary_factor"):
        RotaryEmbedding(scaled, 64)


def test_rope_rotation_is_transformers_rotate_half() -> None:
    cfg = LlamaConfig(hidden_size=64, num_attention_heads=4, max_position_embeddings=512)
    rope = RotaryEmbedding(cfg, 16)
    positions = torch.tensor([0, 1, 17, 200])
    x = torch.randn(4, 3, 16)
    cos, sin = rope.cos_sin(positions, torch.float32, [1] * 4, [201] * 4)
    freqs = positions.float()[:, None] * rope.inv_freq[None, :]
    c, s = torch.cat((freqs.cos(), freqs.cos()), -1)[:, None], torch.cat((freqs.sin(), freqs.sin()), -1)[:, None]
    rotate_half = torch.cat((-x[..., 8:], x[..., :8]), dim=-1)
    torch.testing.assert_close(rope.apply(x, cos, sin), x * c + rotate_half * s)


@pytest.mark.parametrize("name", list(ROPE_CONFIGS))
def test_native_rope_gives_the_torch_formulas_bits(name: str) -> None:
    """The CPU kernel (`use_native_row_ops`) rotates few float32 rows of a projection's strided
    [T, heads, D] view to exactly the torch formula's bits, also for a partial rotary dim and
    the length-dependent tables; the residual add fused with RMSNorm adds exactly as torch."""
    native = row_ops_cpu.load()
    assert native is not None
    cfg = LlamaConfig(hidden_size=128, num_attention_heads=2, max_position_embeddings=4096, **ROPE_CONFIGS[name])
    rope = RotaryEmbedding(cfg, 64)
    torch.manual_seed(2)
    for t in (1, 9, 40):
        qkv = torch.randn(t, 5 * 64)
        x = qkv[:, : 3 * 64].view(t, 3, 64)  # q and k heads of a fused projection: strided rows
        positions = torch.randint(0, 3000, (t,))
        cos, sin = rope.cos_sin(positions, torch.float32, [1] * t, [3001] * t)
        want = rope.apply(x, cos, sin)
        rope.native = native
        try:
            got = rope.apply(x, cos, sin)
        finally:
            rope.native = None
        assert got.is_contiguous() and torch.equal(got, want)
    norm = RMSNorm(64, 1e-5)
    norm.native = native
    h, delta = torch.randn(3, 64), torch.randn(3, 64)
    total, normed = norm.add_and_norm(h, delta)
    assert torch.equal(total, h + delta) and torch.equal(normed, norm(h + delta))


@pytest.mark.parametrize("num_q_heads,num_kv_heads", [(4, 2), (9, 3), (4, 4)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_padding_never_contributes(num_q_heads: int, num_kv_heads: int, dtype: torch.dtype) -> None:
    """Padded columns of the slot table point at stale slots; whatever those hold,
    each request's output is attention over its own slots only."""
    torch.manual_seed(0)
    d, lens = 16, [3, 9, 1, 6]
    table = torch.arange(40, dtype=torch.int32).view(4, 10)
    k_pool, v_pool = torch.randn(40, num_kv_heads, d).to(dtype), torch.randn(40, num_kv_heads, d).to(dtype)
    for i, n in enumerate(lens):  # large, finite stale values past each request's length
        k_pool[10 * i + n : 10 * i + 10] = 1e3
        v_pool[10 * i + n : 10 * i + 10] = -1e4
    meta = AttentionMetadata.from_table(table, [0, 1, 2, 3], [1] * 4, lens)
    backend = TorchReferenceBackend()
    backend.plan(meta)
    q = torch.randn(4, num_q_heads, d).to(dtype)
    new_k, new_v = k_pool[meta.out_slots], v_pool[meta.out_slots]  # rewrite what is there
    out = backend.forward(q, new_k, new_v, LayerKVCache(k_pool, v_pool), d**-0.5)
    assert out.dtype == dtype
    group = num_q_heads // num_kv_heads
    for i, n in enumerate(lens):
        k = k_pool[10 * i : 10 * i + n].float().repeat_interleave(group, 1)  # [n, Hq, D]
        v = v_pool[10 * i : 10 * i + n].float().repeat_interleave(group, 1)
        p = (torch.einsum("hd,khd->hk", q[i].float(), k) * d**-0.5).softmax(-1)
        want = torch.einsum("hk,khd->hd", p, v).reshape(-1)
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(out[i].float(), want, atol=tol, rtol=tol)


def test_from_table_cuts_kv_slots_on_demand() -> None:
    table = torch.arange(40, dtype=torch.int32).view(4, 10)
    seqs = [table[2, :4].tolist(), table[0, :6].tolist(), table[3, :2].tolist()]
    got = AttentionMetadata.from_table(table, [2, 0, 3], [1, 3, 1], [4, 6, 2])
    want = AttentionMetadata.build(seqs, [1, 3, 1])
    assert got._kv_slots is None  # ragged: left for the first reader
    for field in ("qo_indptr", "kv_indptr", "kv_slots", "out_slots", "positions"):
        a, b = getattr(got, field), getattr(want, field)
        assert a.dtype == b.dtype and torch.equal(a, b), field


def test_greedy_picks_the_first_maximum() -> None:
    x = torch.tensor([[1.0, 3.0, 3.0, 0.0], [float("-inf")] * 4, [2.0, 2.0, 2.0, 2.0], [0.0, 1.0, 5.0, 5.0]])
    params = SamplingParams.from_dict({"temperature": 0})
    rows = [SamplingRow(params, i, [], [1]) for i in range(4)]
    assert Sampler(4, []).sample(x, rows).token_ids == [1, 0, 0, 2]


LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


def test_plain_configs_are_read_without_transformers_and_give_the_same_config(tmp_path):
    """config.json read as JSON (no transformers import at start-up) gives the
    same `ModelConfig` and RoPE frequencies as transformers' AutoConfig (Llama 3's
    scaling and linear included); other scalings, incomplete parameters or a
    missing field go through AutoConfig."""
    import json

    from transformers import AutoConfig

    from radixrt.executor.models.config import ModelConfig, PlainHFConfig

    raw = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 100,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 256,
        "eos_token_id": 2,
        "tie_word_embeddings": True,
        "rope_parameters": {"rope_type": "default", "rope_theta": 50000.0},
    }
    (tmp_path / "config.json").write_text(json.dumps(raw))
    plain = ModelConfig.from_pretrained(str(tmp_path))
    assert isinstance(plain.hf_config, PlainHFConfig)
    reference = ModelConfig.from_hf_config(AutoConfig.from_pretrained(str(tmp_path)))
    strip = lambda c: {k: v for k, v in vars(c).items() if k != "hf_config"}  # noqa: E731
    assert strip(plain) == strip(reference)
    from radixrt.executor.models.rope import RotaryEmbedding

    a, b = RotaryEmbedding(plain.hf_config, 16), RotaryEmbedding(reference.hf_config, 16)
    assert torch.equal(a.inv_freq, b.inv_freq) and a.attention_scaling == b.attention_scaling
    scaled = (  # Llama 3.x's scaling, in the standard form and in the older rope_scaling one; linear
        {"rope_parameters": {**LLAMA3_ROPE, "rope_theta": 5e5}},
        {"rope_scaling": {**LLAMA3_ROPE, "type": "llama3"}, "rope_theta": 5e5, "rope_parameters": None},
        {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}},
    )
    for change in scaled:
        (tmp_path / "config.json").write_text(json.dumps({**raw, **change}))
        plain = ModelConfig.from_pretrained(str(tmp_path))
        assert isinstance(plain.hf_config, PlainHFConfig), change
        reference = ModelConfig.from_hf_config(AutoConfig.from_pretrained(str(tmp_path)))
        assert strip(plain) == strip(reference)
        a, b = RotaryEmbedding(plain.hf_config, 16), RotaryEmbedding(reference.hf_config, 16)
        assert a.rope_type == b.rope_type != "default"
        assert torch.equal(a.inv_freq, b.inv_freq) and a.attention_scaling == b.attention_scaling
    for change in (
        {"rope_parameters": {"rope_type": "yarn", "factor": 2.0, "rope_theta": 1e4}},
        {"rope_parameters": dict(LLAMA3_ROPE)},  # no rope_theta anywhere
        {"rope_parameters": {k: v for k, v in LLAMA3_ROPE.items() if k != "low_freq_factor"} | {"rope_theta": 5e5}},
        {"rope_parameters": {**LLAMA3_ROPE, "rope_theta": 5e5, "extra": 1}},
        {"eos_token_id": None},
    ):
        other = {**raw, **change}
        if change.get("eos_token_id", 0) is None:
            del other["eos_token_id"]
        (tmp_path / "config.json").write_text(json.dumps(other))
        assert PlainHFConfig.read(str(tmp_path / "config.json")) is None


def test_a_context_longer_than_the_checkpoint_s_is_refused_unless_allowed(tmp_path, monkeypatch):
    """As SGLang: a context_length past max_position_embeddings (times a RoPE scaling factor that
    extends it) gives positions the model never saw; refused unless an environment variable allows it."""
    import json

    from radixrt.executor.models.config import LONGER_CONTEXT_ENV, ModelConfig
    from radixrt.executor.models.rope import rope_parameters

    raw = {
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 100,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 256,
        "tie_word_embeddings": True,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e4},
    }
    for env in LONGER_CONTEXT_ENV:
        monkeypatch.delenv(env, raising=False)
    for rope, trained in (
        ({"rope_type": "default", "rope_theta": 1e4}, 256),
        ({"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}, 512),
        ({**LLAMA3_ROPE, "rope_theta": 5e5}, 256),  # max_position_embeddings is the scaled length
    ):
        (tmp_path / "config.json").write_text(json.dumps({**raw, "rope_parameters": rope}))
        config = ModelConfig.from_pretrained(str(tmp_path))
        assert rope_parameters(config.hf_config)["rope_type"] == rope["rope_type"]
        assert config.check_context_length(None) == trained == config.check_context_length(trained)
        assert config.check_context_length(100) == 100
        with pytest.raises(ValueError, match=f"context_length {trained + 1} is longer than the model's {trained}"):
            config.check_context_length(trained + 1)
    monkeypatch.setenv("SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN", "1")
    assert config.check_context_length(99999) == 99999


def test_a_sliding_window_caps_the_context(tmp_path, monkeypatch):
    """Attention here is full-causal, which equals a sliding-window model only within its window
    (a 100-token prompt on a 32-token window was 2.6 nats off transformers): the context stops
    there, and a longer one is refused unless allowed."""
    from transformers import MistralConfig, Qwen2Config

    from radixrt.executor.models.config import LONGER_CONTEXT_ENV, ModelConfig

    for env in LONGER_CONTEXT_ENV:
        monkeypatch.delenv(env, raising=False)
    small = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, vocab_size=100)
    cases = (
        (MistralConfig(**small, num_hidden_layers=2, sliding_window=32, max_position_embeddings=512), 32),
        (
            Qwen2Config(**small, num_hidden_layers=2, use_sliding_window=True, sliding_window=32, max_window_layers=1),
            32,
        ),
        # every layer below max_window_layers attends fully; without use_sliding_window none slides
        (
            Qwen2Config(**small, num_hidden_layers=2, use_sliding_window=True, sliding_window=32, max_window_layers=2),
            None,
        ),
        (Qwen2Config(**small, num_hidden_layers=2, sliding_window=32), None),
    )
    for hf_config, window in cases:
        config = ModelConfig.from_hf_config(hf_config)
        assert config.sliding_window == window, hf_config
        if window is not None:
            assert config.check_context_length(None) == window == config.check_context_length(window)
            with pytest.raises(ValueError, match="sliding attention window"):
                config.check_context_length(window + 1)
        else:
            assert config.check_context_length(None) == hf_config.max_position_embeddings


def test_an_unknown_activation_is_named():
    from radixrt.executor.models.llama import _activation

    with pytest.raises(ValueError, match="unsupported hidden_act 'swiglu_foo'"):
        _activation("swiglu_foo")  # was a bare KeyError
