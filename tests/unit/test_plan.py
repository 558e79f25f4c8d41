"""`radixrt plan`: the seeds' capacity arithmetic, checked against hand-computed values."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from radixrt.plan import ModelShape, make_plan, parse_bytes, safetensors_param_count

# Llama-2-13B's config.json (the fields that matter, as published).
LLAMA2_13B = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 5120,
    "intermediate_size": 13824,
    "num_attention_heads": 40,
    "num_hidden_layers": 40,
    "num_key_value_heads": 40,
    "vocab_size": 32000,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
    "torch_dtype": "float16",
    "rms_norm_eps": 1e-5,
}
# By hand: embeddings 32000*5120 = 163,840,000, the same again for the LM head;
# per layer 4*5120^2 (attention) + 3*5120*13824 (MLP) + 2*5120 (norms) = 317,204,480;
# 40 layers + final norm 5120.
LLAMA2_13B_PARAMS = 2 * 163_840_000 + 40 * 317_204_480 + 5120  # 13,015,864,320
# SmolLM2-135M: embeddings 49152*576 = 28,311,552 (tied); per layer
# 576*576*2 + 576*192*2 (q, o, k, v) + 3*576*1536 + 2*576 = 3,540,096; 30 layers; final norm.
SMOLLM2_PARAMS = 28_311_552 + 30 * 3_540_096 + 576  # 134,515,008


def test_parse_bytes_units():
    assert parse_bytes("80GB") == 80 * 10**9
    assert parse_bytes("80GiB") == 80 * 2**30
    assert parse_bytes("512 MB") == 512 * 10**6
    assert parse_bytes("80") == 80 * 10**9
    assert parse_bytes("1.5TB") == 1_500_000_000_000
    with pytest.raises(ValueError):
        parse_bytes("eighty")


def test_llama2_13b_matches_the_seeds_arithmetic():
    shape = ModelShape.from_config(LLAMA2_13B, name="Llama-2-13B")
    assert shape.param_count() == LLAMA2_13B_PARAMS == 13_015_864_320
    # 2 (K and V) x 40 layers x 40 heads x 128 head_dim x 2 bytes = 819,200 B: the seeds' "819 KB"
    assert shape.kv_bytes_per_token(2) == 2 * 40 * 40 * 128 * 2 == 819_200

    p = make_plan(shape, parse_bytes("80GB"), params=shape.param_count(), weight_dtype="fp16", avg_tokens=2000)
    assert p.weights_bytes == 2 * 13_015_864_320  # "about 26 GB"
    assert p.kv_budget_bytes == 80e9 - 26_031_728_640  # "roughly 54 GB left"
    assert p.max_live_tokens == 65_879  # floor(53,968,271,360 / 819,200): "roughly 66,000 tokens"
    assert p.concurrency == pytest.approx(32.94, abs=0.01)  # "about 33 concurrent sequences"
    long_ctx = make_plan(shape, parse_bytes("80GB"), params=shape.param_count(), weight_dtype="fp16", avg_tokens=8000)
    assert long_ctx.concurrency == pytest.approx(8.23, abs=0.01)  # "falls to ~8"

    fp8 = make_plan(
        shape, parse_bytes("80GB"), params=shape.param_count(), weight_dtype="fp16", kv_dtype="fp8", avg_tokens=2000
    )
    assert fp8.kv_bytes_per_token == 409_600
    assert fp8.max_live_tokens == 131_758  # halving dtype_bytes doubles the live tokens
    assert fp8.concurrency == pytest.approx(65.88, abs=0.01)

    # 1,000 of the 2,000 tokens shared by every request and stored once:
    # (65,879 - 1,000) / (2,000 - 1,000) = 64.879 requests, 1.97x.
    shared = make_plan(
        shape, parse_bytes("80GB"), params=shape.param_count(), weight_dtype="fp16", avg_tokens=2000, shared_prefix=1000
    )
    assert shared.concurrency_shared == pytest.approx(64.879)
    assert shared.sharing_gain == pytest.approx(64.879 / 32.9395, rel=1e-4)

    reserved = make_plan(
        shape, parse_bytes("80GB"), params=shape.param_count(), weight_dtype="fp16", overhead_bytes=parse_bytes("4GB")
    )
    assert reserved.max_live_tokens == int((80e9 - 26_031_728_640 - 4e9) // 819_200) == 60_996

    with pytest.raises(ValueError):
        make_plan(shape, parse_bytes("80GB"), params=1, avg_tokens=100, shared_prefix=100)


def test_weights_that_do_not_fit_give_zero_tokens():
    shape = ModelShape.from_config(LLAMA2_13B)
    p = make_plan(shape, parse_bytes("24GB"), params=shape.param_count(), weight_dtype="fp16")
    assert p.kv_budget_bytes < 0 and p.max_live_tokens == 0 and p.concurrency == 0


def _run_plan(*args: str) -> tuple[dict, str]:
    """Run `radixrt plan` in a fresh interpreter; report whether torch got imported."""
    code = (
        "import sys, json, io, contextlib; from radixrt.cli import main\n"
        "buf = io.StringIO()\n"
        "with contextlib.redirect_stdout(buf): rc = main(['plan', *sys.argv[1:]])\n"
        "print(json.dumps({'rc': rc, 'out': buf.getvalue(),"
        " 'heavy': sorted(m for m in ('torch', 'transformers', 'safetensors') if m in sys.modules)}))"
    )
    proc = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    assert res["rc"] == 0
    assert res["heavy"] == [], f"plan imported {res['heavy']}"
    return res, res["out"]


def test_plan_cli_llama2_13b_from_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA2_13B))
    _, out = _run_plan(
        "--model", str(tmp_path), "--gpu-mem", "80GB", "--weight-dtype", "fp16", "--avg-tokens", "2000", "--json"
    )
    p = json.loads(out)
    assert p["params"] == LLAMA2_13B_PARAMS and p["params_source"] == "config.json"
    assert p["kv_bytes_per_token"] == 819_200
    assert p["max_live_tokens"] == 65_879
    assert p["concurrency"] == pytest.approx(32.94, abs=0.01)

    _, text = _run_plan(
        "--model",
        str(tmp_path),
        "--gpu-mem",
        "80GB",
        "--weight-dtype",
        "fp16",
        "--kv-dtype",
        "fp8",
        "--shared-prefix",
        "1000",
    )
    assert "409,600 B = 409.6 KB (fp8)" in text
    assert "max live tokens" in text and "131,758" in text
    assert "with a 1,000-token shared prefix" in text


def test_plan_cli_default_model_smollm2(default_model_path):
    # SmolLM2-135M: 2 x 30 layers x 3 KV heads x 64 head_dim = 11,520 values per token.
    folder = default_model_path
    assert safetensors_param_count(__import__("pathlib").Path(folder)) == SMOLLM2_PARAMS
    shape = ModelShape.from_config(json.loads(open(f"{folder}/config.json").read()))
    assert shape.param_count() == SMOLLM2_PARAMS  # the config formula agrees with the file
    _, out = _run_plan("--gpu-mem", "24GB", "--avg-tokens", "2000", "--json")  # --model default
    p = json.loads(out)
    assert p["params"] == SMOLLM2_PARAMS
    assert p["kv_bytes_per_token"] == 2 * 30 * 3 * 64 * 2 == 23_040  # bf16
    weights = 2 * SMOLLM2_PARAMS  # 269,030,016 B
    assert p["weights_bytes"] == weights
    assert p["max_live_tokens"] == (24 * 10**9 - weights) // 23_040 == 1_029_990
    assert p["concurrency"] == pytest.approx(514.995)
    _, out = _run_plan("--gpu-mem", "24GB", "--kv-dtype", "fp32", "--weight-dtype", "fp32", "--json")
    p = json.loads(out)
    assert p["kv_bytes_per_token"] == 46_080  # what radixrt's CPU pool spends per token (fp32)
