"""Weights updated in place and generation paused (SGLang's routes for RL rollouts), on the
Engine and over HTTP: the new weights answer exactly as an engine started on them; requests
running at the update finish with the old weights, waiting ones start with the new; no KV of
the old weights is served; refused updates keep the old weights; pauses hold every request
and lose none (radixrt/scheduler/generation_control.py)."""

from __future__ import annotations

import shutil
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file, save_file

import radixrt
from tests.support.lora import make_adapter
from tests.support.servers import TINY_SERVER_ADMIN_KEY
from tests.support.weights import checkpoint_rows

GREEDY = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
LONG = {"max_new_tokens": 300, "temperature": 0, "ignore_eos": True}
PROMPT = "The weights of this model are"


@pytest.fixture(scope="module")
def models(make_tiny) -> dict[str, str]:
    """Two checkpoints of one architecture (seeds 0 and 1) and two of others (3 layers; another
    RoPE base)."""
    shape = {"max_position_embeddings": 4096}
    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
    rope |= {"original_max_position_embeddings": 64, "rope_theta": 500000.0}  # the tiny Llama's: 10,000
    return {
        "a": make_tiny("llama", seed=0, **shape),
        "b": make_tiny("llama", seed=1, **shape),
        "deeper": make_tiny("llama", seed=0, num_hidden_layers=3, **shape),
        "other_rope": make_tiny("llama", seed=1, rope_parameters=rope, **shape),
    }


@pytest.fixture(scope="module")
def answers(models) -> dict[str, dict]:
    """What an engine started on each checkpoint answers to a short greedy generation."""
    out = {}
    for name in ("a", "b"):
        with radixrt.Engine(models[name], max_total_tokens=8192) as engine:
            out[name] = {"short": engine.generate(PROMPT, GREEDY)["output_ids"]}
    assert out["a"]["short"] != out["b"]["short"]
    return out


@pytest.fixture(scope="module")
def long_answer(models) -> list[int]:
    """The first checkpoint's long greedy generation, which the tests below interrupt."""
    with radixrt.Engine(models["a"], max_total_tokens=8192) as engine:
        return engine.generate(PROMPT, LONG)["output_ids"]


@pytest.fixture
def engine(models):
    with radixrt.Engine(models["a"], max_total_tokens=8192, debug_check_invariants=True) as eng:
        yield eng
        assert eng.get_stats()["kv"]["private_slots"] == 0


def _in_thread(fn, *args) -> tuple[threading.Thread, dict]:
    box: dict = {}
    t = threading.Thread(target=lambda: box.update(result=fn(*args)))
    t.start()
    return t, box


def _wait_for(engine, pred, timeout: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        stats = engine.get_stats()
        if pred(stats):
            return stats
        time.sleep(0.01)
    raise AssertionError(f"not reached in {timeout} s: {engine.get_stats()}")


@pytest.mark.slow
def test_the_new_weights_answer_as_an_engine_started_on_them(engine, models, answers):
    first = engine.generate(PROMPT, GREEDY)
    assert first["output_ids"] == answers["a"]["short"] and first["meta_info"]["weight_version"] == "default"
    assert engine.get_weight_version() == "default"
    ok, message, paused = engine.update_weights_from_disk(models["b"], weight_version="step-1")
    assert (ok, paused) == (True, 0) and models["b"] in message
    out = engine.generate(PROMPT, GREEDY)
    assert out["output_ids"] == answers["b"]["short"] and out["meta_info"]["weight_version"] == "step-1"
    assert out["meta_info"]["cached_tokens"] == 0  # the prompt's cached KV had the old weights
    assert engine.generate(PROMPT, GREEDY)["meta_info"]["cached_tokens"] > 0  # cached again, with the new
    assert engine.get_weight_version() == "step-1" and engine.get_server_info()["weight_version"] == "step-1"
    assert engine.update_weights_from_disk(models["a"])[0]
    assert engine.generate(PROMPT, GREEDY)["output_ids"] == answers["a"]["short"]
    assert engine.get_weight_version() == models["a"]  # no label given: the path
    engine.update_weight_version("relabelled", abort_all_requests=False)  # the weights stay
    out = engine.generate(PROMPT, GREEDY)
    assert out["output_ids"] == answers["a"]["short"] and out["meta_info"]["weight_version"] == "relabelled"
    assert engine.get_weight_version() == "relabelled"


# SGLang's own read-back test's names (lm_head: the embedding where they are tied)
WEIGHT_NAMES = [
    "model.embed_tokens.weight",
    "model.layers.0.input_layernorm.weight",
    "model.layers.0.self_attn.q_proj.weight",
    "model.layers.1.self_attn.k_proj.weight",
    "model.layers.0.self_attn.v_proj.weight",
    "model.layers.1.self_attn.o_proj.weight",
    "model.layers.0.mlp.gate_proj.weight",
    "model.layers.1.mlp.up_proj.weight",
    "model.layers.0.mlp.down_proj.weight",
    "model.layers.1.post_attention_layernorm.weight",
    "model.norm.weight",
    "lm_head.weight",
]


def test_weights_read_back_by_name_are_the_checkpoint_s(engine, models):
    """SGLang's ``get_weights_by_name`` before and after an update: every name (fused q/k/v and
    gate/up rows included) gives the served checkpoint's values exactly."""
    for folder in (models["a"], models["b"]):
        if folder != models["a"]:
            assert engine.update_weights_from_disk(folder)[0]
        for name in WEIGHT_NAMES:
            assert engine.get_weights_by_name(name, 3) == checkpoint_rows(folder, name, 3), name
    assert len(engine.get_weights_by_name("model.layers.0.self_attn.k_proj.weight")) == 32  # all its rows (< 100)
    for name, size, why in (
        ("model.layers.9.mlp.up_proj.weight", 100, "no weight"),
        ("model.layers.0.mlp.up_proj", 100, "no weight"),
        ("model.embed_tokens.weight", 0, "positive integer"),
        ("model.embed_tokens.weight", True, "positive integer"),
    ):
        with pytest.raises(ValueError, match=why):
            engine.get_weights_by_name(name, size)
    with radixrt.Engine(models["a"], max_total_tokens=1024, quantization="int8") as quantized:
        with pytest.raises(ValueError, match="quantized"):
            quantized.get_weights_by_name("model.layers.0.mlp.gate_proj.weight")
        ok, message = quantized.update_weights_from_tensor([("model.norm.weight", torch.ones(64))])
        assert not ok and "quantized" in message, message
        assert quantized.get_weights_by_name("model.norm.weight", 4) == checkpoint_rows(
            models["a"], "model.norm.weight", 4
        )


def test_tensors_sent_in_parts_update_the_weights(engine, models, answers):
    """SGLang's ``update_weights_from_tensor`` as an RL trainer calls it: the new state dict in
    parts, ``flush_cache`` False on each (the cache is dropped anyway); then one tensor alone
    changes that tensor only; refusals keep the weights served."""
    from safetensors.torch import load_file

    new = sorted(load_file(str(next(Path(models["b"]).glob("*.safetensors")))).items())
    for i in range(0, len(new), 7):
        ok, message = engine.update_weights_from_tensor(new[i : i + 7], flush_cache=False, weight_version="b")
        assert ok and message == "Succeeded to update model weights.", message
    out = engine.generate(PROMPT, GREEDY)
    assert out["output_ids"] == answers["b"]["short"] and out["meta_info"]["cached_tokens"] == 0
    assert engine.get_weight_version() == "b"
    k, v = "model.layers.0.self_attn.k_proj.weight", "model.layers.0.self_attn.v_proj.weight"
    old_k = load_file(str(next(Path(models["a"]).glob("*.safetensors"))))[k]
    assert engine.update_weights_from_tensor([(k, old_k)])[0]
    assert engine.get_weights_by_name(k, 2) == checkpoint_rows(models["a"], k, 2)
    assert engine.get_weights_by_name(v, 2) == checkpoint_rows(models["b"], v, 2)
    assert engine.get_weight_version() == "b"  # no label given: unchanged
    for pairs, why in (([(k, old_k[:3])], "shape"), ([("model.layers.7.mlp.up_proj.weight", old_k)], "no weight")):
        ok, message = engine.update_weights_from_tensor(pairs)
        assert not ok and why in message, message
    assert engine.update_weights_from_tensor([(k, old_k)], load_format="flattened_bucket")[0] is False
    with pytest.raises(TypeError, match="torch.Tensor"):
        engine.update_weights_from_tensor([(k, old_k.tolist())])
    assert engine.get_weights_by_name(k, 2) == checkpoint_rows(models["a"], k, 2)


def test_dummy_weights_read_nothing_until_the_trainer_sends_its_own(models, answers, tmp_path):
    """SGLang's ``load_format="dummy"``, as RL trainers start their rollout engines: the engine
    starts on a folder with no weight file (small random weights of its config) and generates;
    the trainer's tensors then make it answer as an engine started on the checkpoint."""
    bare = tmp_path / "config-only"
    shutil.copytree(models["a"], bare, ignore=shutil.ignore_patterns("*.safetensors*"))
    # beside load_format, the keywords a public RL framework gives its rollout engines (TypeErrors before)
    rollout = dict(base_gpu_id=0, gpu_id_step=1, port=40001, nccl_port=29600, attention_backend="fa3")
    with radixrt.Engine(str(bare), load_format="dummy", max_total_tokens=2048, **rollout) as engine:
        dummy = engine.generate(PROMPT, GREEDY)["output_ids"]
        norm = engine.get_weights_by_name("model.norm.weight", 64)
        assert len(dummy) == GREEDY["max_new_tokens"] and dummy != answers["a"]["short"]
        assert len(set(norm)) > 1 and max(abs(v) for v in norm) <= 1e-3
        assert engine.update_weights_from_tensor(sorted(load_file(_safetensors(models["a"])).items()))[0]
        assert engine.generate(PROMPT, GREEDY)["output_ids"] == answers["a"]["short"]
    with pytest.raises(ValueError, match="load_format"):
        radixrt.Engine(models["a"], load_format="pt")


def _safetensors(folder: str) -> str:
    return str(next(Path(folder).glob("*.safetensors")))


def test_refused_updates_keep_the_old_weights(engine, models, answers, tmp_path):
    for path, why in (
        (str(tmp_path / "missing"), "not a local folder"),
        (models["deeper"], "num_layers 3 (served: 2)"),
        (models["other_rope"], "'rope_theta': 500000.0"),
    ):
        ok, message, _ = engine.update_weights_from_disk(path)
        assert not ok and why in message, message
    assert engine.update_weights_from_disk(models["b"], load_format="pt")[0] is False
    cut = tmp_path / "cut"  # one tensor of another shape: named once, as a mismatch (not "missing" too)
    shutil.copytree(models["b"], cut)
    (file,) = cut.glob("*.safetensors")
    tensors = load_file(file)
    name = next(k for k in tensors if k.endswith("mlp.down_proj.weight"))
    tensors[name] = tensors[name][:, :-1].contiguous()
    save_file(tensors, file)
    ok, message, _ = engine.update_weights_from_disk(str(cut))
    assert not ok and "shape mismatches" in message and "missing" not in message, message
    first = engine.generate(PROMPT, GREEDY)
    assert first["output_ids"] == answers["a"]["short"] and first["meta_info"]["weight_version"] == "default"
    assert engine.get_weight_version() == "default"


@pytest.mark.slow
def test_running_requests_finish_with_the_old_weights_and_waiting_ones_start_with_the_new(
    engine, models, answers, long_answer
):
    long_run, long_box = _in_thread(engine.generate, PROMPT, LONG)
    _wait_for(engine, lambda s: s["running"] == 1 and s["generated_tokens"] > 10)
    update, update_box = _in_thread(engine.update_weights_from_disk, models["b"])
    _wait_for(engine, lambda s: s["weight_updates_pending"] == 1)
    short_run, short_box = _in_thread(engine.generate, PROMPT, GREEDY)
    stats = _wait_for(engine, lambda s: s["waiting"] == 1)  # held back while the long one runs
    assert stats["running"] == 1
    for t in (long_run, update, short_run):
        t.join(timeout=120)
    assert long_box["result"]["output_ids"] == long_answer
    assert update_box["result"][0] is True and update_box["result"][2] == 1  # the short one waited
    assert short_box["result"]["output_ids"] == answers["b"]["short"]
    # SGLang's meta_info.weight_version: the weights that computed each answer
    assert long_box["result"]["meta_info"]["weight_version"] == "default"
    assert short_box["result"]["meta_info"]["weight_version"] == models["b"]


@pytest.mark.slow
def test_requests_retracted_while_an_update_waits_finish_with_the_old_weights(models):
    """A pool too small for every request at once: some are retracted while the update waits, and
    they come back before it (they started with the old weights), not after. Each answer is the old
    weights' or (for a request that had not started) the new weights', never a mix."""
    prompts = [f"{PROMPT} {i}" for i in range(8)]
    params = {"max_new_tokens": 120, "temperature": 0, "ignore_eos": True}
    with radixrt.Engine(models["a"], max_total_tokens=480, debug_check_invariants=True) as engine:
        want = [o["output_ids"] for o in engine.generate(prompts, params)]
        retracted = engine.get_stats()["retractions"]
        assert retracted > 0, "the pool was meant to be too small for every request at once"
        run, box = _in_thread(engine.generate, prompts, params)
        _wait_for(engine, lambda s: s["running"] > 0 and s["generated_tokens"] > 8 * 120 + 20)
        assert engine.update_weights_from_disk(models["b"])[0]
        run.join(timeout=120)
        got = [o["output_ids"] for o in box["result"]]
        assert engine.get_stats()["retractions"] > retracted  # retracted again this time too
        assert any(o["meta_info"]["num_retractions"] > 0 for o in box["result"])
        assert sum(o["meta_info"]["num_retractions"] for o in box["result"]) <= engine.get_stats()["retractions"]
        new = [o["output_ids"] for o in engine.generate(prompts, params)]
        assert all(g in (w, n) for g, w, n in zip(got, want, new)), "an answer mixes the two checkpoints"
        assert got[0] == want[0] and sum(g == w for g, w in zip(got, want)) >= 2


@pytest.mark.slow
def test_abort_all_requests_ends_the_running_ones_first(engine, models, answers):
    long_run, long_box = _in_thread(engine.generate, PROMPT, LONG)
    _wait_for(engine, lambda s: s["running"] == 1 and s["generated_tokens"] > 10)
    assert engine.update_weights_from_disk(models["b"], abort_all_requests=True)[0]
    long_run.join(timeout=60)
    finished = long_box["result"]["meta_info"]["finish_reason"]
    assert finished["type"] == "abort" and len(long_box["result"]["output_ids"]) < LONG["max_new_tokens"]
    assert engine.generate(PROMPT, GREEDY)["output_ids"] == answers["b"]["short"]


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["in_place", "retract"])
def test_a_paused_request_waits_and_then_ends_as_if_never_paused(engine, long_answer, mode):
    long_run, long_box = _in_thread(engine.generate, PROMPT, LONG)
    _wait_for(engine, lambda s: s["running"] == 1 and s["generated_tokens"] > 10)
    engine.pause_generation(mode)
    held = engine.get_stats()
    time.sleep(0.2)
    stats = engine.get_stats()
    assert stats["generation_paused"] == mode and stats["generated_tokens"] == held["generated_tokens"]
    if mode == "retract":  # back in the queue without its KV
        assert (stats["running"], stats["waiting"], stats["kv"]["private_slots"]) == (0, 1, 0)
    engine.continue_generation()
    long_run.join(timeout=120)
    assert long_box["result"]["output_ids"] == long_answer
    assert engine.get_stats()["generation_paused"] is None


@pytest.mark.slow
def test_pause_abort_ends_requests_and_holds_new_ones_until_continued(engine, answers):
    long_run, long_box = _in_thread(engine.generate, PROMPT, LONG)
    _wait_for(engine, lambda s: s["running"] == 1)
    engine.pause_generation()  # SGLang's default mode: abort
    long_run.join(timeout=60)
    assert long_box["result"]["meta_info"]["finish_reason"]["type"] == "abort"
    short_run, short_box = _in_thread(engine.generate, PROMPT, GREEDY)
    _wait_for(engine, lambda s: s["waiting"] == 1)
    time.sleep(0.1)
    assert "result" not in short_box
    engine.continue_generation()
    short_run.join(timeout=60)
    assert short_box["result"]["output_ids"] == answers["a"]["short"]
    with pytest.raises(ValueError, match="mode must be one of"):
        engine.pause_generation("sleep")


@pytest.mark.slow
def test_an_update_while_paused_retracts_the_running_request(engine, models, long_answer):
    """Paused in place, a request's KV has the old weights: the update sends it back to the
    queue, and once continued it goes on with the new weights after what it already wrote."""
    long_run, long_box = _in_thread(engine.generate, PROMPT, LONG)
    _wait_for(engine, lambda s: s["running"] == 1 and s["generated_tokens"] > 10)
    engine.pause_generation("in_place")
    written = engine.get_stats()["generated_tokens"]
    ok, _, paused = engine.update_weights_from_disk(models["b"])
    assert ok and paused == 1
    assert engine.get_stats()["generation_paused"] == "in_place"  # until continued
    engine.continue_generation()
    long_run.join(timeout=120)
    got = long_box["result"]["output_ids"]
    assert len(got) == LONG["max_new_tokens"] and got[: written - 1] == long_answer[: written - 1]
    assert got != long_answer


@pytest.mark.slow
def test_adapters_apply_to_the_new_weights(models, tmp_path):
    """LoRA's wrappers go around the new model's layers: an adapter's answer after the update is
    what an engine started on the new weights with that adapter gives."""
    adapter = f"r8={make_adapter(models['a'], tmp_path / 'r8', 8, seed=1)}"
    want = {}
    for name in ("a", "b"):
        with radixrt.Engine(models[name], lora_paths=[adapter], max_total_tokens=4096) as e:
            want[name] = [e.generate(PROMPT, GREEDY, lora_path=lora)["output_ids"] for lora in (None, "r8")]
    with radixrt.Engine(models["a"], lora_paths=[adapter], max_total_tokens=4096, debug_check_invariants=True) as e:
        assert [e.generate(PROMPT, GREEDY, lora_path=lora)["output_ids"] for lora in (None, "r8")] == want["a"]
        assert e.update_weights_from_disk(models["b"])[0]
        assert [e.generate(PROMPT, GREEDY, lora_path=lora)["output_ids"] for lora in (None, "r8")] == want["b"]
    assert want["b"][0] != want["b"][1]


@pytest.mark.slow
def test_the_http_routes(tiny_server, make_tiny):
    """On the session's tiny server (tests/e2e/conftest.py), whose own weights come back at the end."""
    admin = {"Authorization": f"Bearer {TINY_SERVER_ADMIN_KEY}"}
    own, other = tiny_server.folder, make_tiny("llama", seed=1, max_position_embeddings=8192)
    deeper = make_tiny("llama", num_hidden_layers=3, max_position_embeddings=8192)
    with httpx.Client(base_url=tiny_server.url, headers=tiny_server.headers, timeout=120) as c:

        def short() -> list[int]:
            body = {"text": PROMPT, "sampling_params": GREEDY}
            return c.post("/generate", json=body).json()["output_ids"]

        try:
            _http_routes(c, admin, short, other, deeper)
        finally:
            restore = {"model_path": own, "weight_version": "default"}
            r = c.post("/update_weights_from_disk", json=restore, headers=admin)
            assert r.status_code == 200, r.text
        assert c.get("/get_model_info").json()["weight_version"] == "default"


def _http_routes(c: httpx.Client, admin: dict, short, other: str, deeper: str) -> None:
    before = short()
    with radixrt.Engine(other, max_total_tokens=4096) as engine:
        want = engine.generate(PROMPT, GREEDY)["output_ids"]
    assert want != before
    body = {"model_path": other, "weight_version": "step-7", "abort_all_requests": False}
    assert c.post("/update_weights_from_disk", json=body).status_code == 403  # the admin key's
    r = c.post("/update_weights_from_disk", json=body, headers=admin)
    assert r.status_code == 200 and r.json()["success"] and r.json()["num_paused_requests"] == 0
    assert short() == want
    assert c.get("/get_weight_version").json() == {"weight_version": "step-7"}
    _read_back(c, admin, other)
    model_info = c.get("/get_model_info").json()
    assert model_info["weight_version"] == "step-7" and model_info["model_path"] == other
    info = c.get("/get_server_info").json()
    assert info["internal_states"][0]["weight_version"] == "step-7"
    for bad, field in (
        ({}, "model_path"),
        ({"model_path": 7}, "model_path"),
        ({"model_path": other, "flush_cache": False}, "flush_cache"),
        ({"model_path": other, "load_format": "pt"}, "load_format"),
        ({"model_path": other, "abort_all_requests": "yes"}, "abort_all_requests"),
        ({"model_path": other, "surprise": 1}, "surprise"),
    ):
        r = c.post("/update_weights_from_disk", json=bad, headers=admin)
        assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
    r = c.post("/update_weights_from_disk", json={"model_path": deeper}, headers=admin)
    assert r.status_code == 400 and not r.json()["success"] and "num_layers" in r.json()["message"]
    assert short() == want

    r = c.post("/pause_generation", json={"mode": "in_place"}, headers=admin)
    assert r.status_code == 200 and r.json()["status"] == "ok"
    held, box = _in_thread(short)
    time.sleep(0.3)
    assert "result" not in box
    assert c.post("/continue_generation", headers=admin).status_code == 200  # no body, as SGLang's clients
    held.join(timeout=60)
    assert box["result"] == want
    r = c.post("/pause_generation", json={"mode": "sleep"}, headers=admin)
    assert r.status_code == 400 and r.json()["error"]["param"] == "mode"
    kv = c.get("/debug/kv").json()
    assert kv["kv_slots"]["private_slots"] == 0 and kv["running"] == kv["waiting"] == 0


def _read_back(c: httpx.Client, admin: dict, served: str) -> None:
    """``/get_weights_by_name`` (GET with a JSON body, as SGLang's clients send it, or POST)."""
    name = "model.layers.1.self_attn.v_proj.weight"
    body = {"name": name, "truncate_size": 2}
    assert c.request("GET", "/get_weights_by_name", json=body).status_code == 403  # the admin key's
    r = c.request("GET", "/get_weights_by_name", json=body, headers=admin)
    assert r.status_code == 200 and r.json() == checkpoint_rows(served, name, 2), r.text
    r = c.post("/get_weights_by_name", json={"name": "lm_head.weight", "truncate_size": None}, headers=admin)
    assert r.json() == checkpoint_rows(served, "lm_head.weight", 100)
    for bad, field in (
        ({}, "name"),
        ({"name": "no.such.weight"}, "name"),
        ({"name": name, "truncate_size": -1}, "truncate_size"),
        ({"name": name, "surprise": 1}, "surprise"),
        ({"name": "model.embed_tokens.weight", "truncate_size": 10**9}, "name"),  # too many values
    ):
        r = c.post("/get_weights_by_name", json=bad, headers=admin)
        assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
