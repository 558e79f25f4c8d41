"""Tensor parallel on the CPU (gloo): greedy outputs with tp_size 2 equal tp_size 1
token for token, on random Llama and Qwen2 models through the Engine and on the
embedded model through `radixrt serve --tp 2` (against the Engine at tp 1); copies between
KV slots (beam search, the host tier) run on every rank; the server's ranks live and die together."""

from __future__ import annotations

import ipaddress
import os
import signal
import stat
import time

import httpx
import psutil
import pytest
import torch
import zmq

import radixrt
from radixrt.server.local import LocalServer
from tests.e2e.test_swap_preemption import MULTI_TURN_HOST_TIER, _check_clean, _conversations, _multi_turn
from tests.support.servers import SKIP_WARMUP

pytestmark = pytest.mark.slow

PROMPTS = [
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
    "Once upon a time, in a land far away,",
    "1, 2, 3, 4,",
]


def _greedy(engine, prompts, n=20):
    return [r["output_ids"] for r in engine.generate(prompts, {"max_new_tokens": n, "temperature": 0})]


@pytest.mark.parametrize("arch", ["qwen2"])  # q/k/v biases; the server test below runs a Llama
def test_tp2_equals_tp1_on_random_models(make_tiny, arch):
    """Also through chunked prefill (16-token chunks), a second round served from the radix cache,
    and after the weights of another checkpoint replaced the first's (every rank loads its shard)."""
    path = make_tiny(arch, num_attention_heads=4, num_key_value_heads=2)
    other = make_tiny(arch, seed=1, num_attention_heads=4, num_key_value_heads=2)
    outputs = {}
    listening_before = _tcp_listeners(os.getpid())
    for tp in (1, 2):
        engine = radixrt.Engine(
            path, tp_size=tp, max_total_tokens=2048, chunked_prefill_size=16, debug_check_invariants=True
        )
        try:
            first = _greedy(engine, PROMPTS)
            again = _greedy(engine, PROMPTS)
            assert again == first
            if tp == 2:
                assert engine.scheduler.runner.shard_config.num_kv_heads == 1  # really split
                _assert_ranks_talk_privately(engine.scheduler.runner.followers, listening_before)
                with pytest.raises(ValueError, match="tensor parallelism"):  # the leader holds a shard
                    engine.get_weights_by_name("model.layers.0.self_attn.q_proj.weight")
                ok, message = engine.update_weights_from_tensor([("model.norm.weight", torch.ones(64))])
                assert not ok and "tensor parallelism" in message, message
            assert engine.update_weights_from_disk(other)[0]
            outputs[tp] = first, _greedy(engine, PROMPTS)
        finally:
            engine.shutdown()
    assert outputs[2] == outputs[1] and outputs[1][0] != outputs[1][1]


@pytest.mark.parametrize(
    "quantization,head,arch",
    [("int8", False, "llama"), ("int4", False, "llama"), ("int4", True, "llama"), ("int8", True, "qwen2")],
)
def test_each_rank_quantizes_its_shards(make_tiny, quantization, head, arch):
    """``--quantization`` under tensor parallelism: every rank quantizes the shards it keeps (a row
    shard its columns, its all-reduce kept; the LM head its vocabulary rows, its gather kept); greedy
    tokens at tp_size 2 equal tp_size 1's with the same quantization, also after a weight update (the
    ranks quantize the new shards). With a quantized head, which rounds its input to int8 per run of
    32, a last-bit difference in that input (the ranks sum their partial products in another order
    than one process) can move a logit by 1e-2 and swap a near tie (it did after the update): there
    the leader's vocabulary rows must compute what one process's head computes for them, exactly
    (Qwen2's head is tied to its embeddings, which stay float)."""
    path = make_tiny(arch, num_attention_heads=4, num_key_value_heads=2)
    other = make_tiny(arch, seed=1, num_attention_heads=4, num_key_value_heads=2)
    hidden = torch.randn(17, 64, generator=torch.Generator().manual_seed(0))
    outputs, logits = {}, {}
    for tp in (1, 2):
        flags = {"quantization": quantization, "quantize_lm_head": head}
        engine = radixrt.Engine(path, tp_size=tp, max_total_tokens=2048, **flags)
        try:
            first = _greedy(engine, PROMPTS)
            model = engine.scheduler.runner.model
            if head:
                outputs[tp] = first
                local = model.lm_head if tp == 1 else model.lm_head.local
                logits[tp] = local(hidden)[:, : model.lm_head.widths[0] if tp == 2 else None]
            else:
                assert engine.update_weights_from_disk(other)[0]
                outputs[tp] = first, _greedy(engine, PROMPTS)
            layer = model.model.layers[0]
            products = [layer.self_attn.qkv_proj, layer.mlp.down_proj if tp == 1 else layer.mlp.down_proj.local]
            products += [local] if head else []
            assert all(type(p).__name__ == "QuantizedLinear" for p in products), products
            assert model.model.embed_tokens.weight.shape[1] == 64  # the embedding stays whole
        finally:
            engine.shutdown()
    assert outputs[2] == outputs[1]
    if head:
        assert torch.equal(logits[2], logits[1][:, : logits[2].shape[1]])
    else:
        assert outputs[1][0] != outputs[1][1]


def test_beam_search_copies_on_write_on_every_rank(make_tiny):
    """Beams forking inside a partly filled page (pages of 4 slots) copy it on write on every rank's
    pool: every hypothesis and score at tp_size 2 equals tp_size 1 (a copy on rank 0's pool alone
    left rank 1's heads reading a page the fork never wrote)."""
    path = make_tiny("llama", num_attention_heads=4, num_key_value_heads=2)
    sp = {"max_new_tokens": 12, "beam_width": 3, "n": 3, "length_penalty": 1.0}
    results = {}
    for tp in (1, 2):
        engine = radixrt.Engine(path, tp_size=tp, page_size=4, max_total_tokens=2048, debug_check_invariants=True)
        try:
            beams = engine.generate(PROMPTS, sp)
            assert len(beams) == 3 * len(PROMPTS)  # each prompt's 3 hypotheses, best first
            results[tp] = [(b["output_ids"], round(b["meta_info"]["beam"]["score"], 4)) for b in beams]
            assert engine.get_stats()["beam_copied_slots"] > 0
        finally:
            engine.shutdown()
    assert results[2] == results[1]


def test_host_tier_copies_run_on_every_rank(tiny_llama):
    """The host KV tier under tensor parallelism: each rank keeps its heads' share of the host pool and
    runs the leader's copies in the leader's order, so turns evicted to the host and loaded back answer
    as at tp_size 1 with a roomy pool (copies on rank 0's pool alone left rank 1's heads stale)."""
    convs = _conversations()
    with radixrt.Engine(tiny_llama, max_total_tokens=65536) as ref:
        reference = _multi_turn(ref, convs)
    # the overlap scheduler as on CUDA: the host copies run on the step's thread, in step order
    engine = radixrt.Engine(tiny_llama, tp_size=2, **MULTI_TURN_HOST_TIER, disable_overlap_schedule=False)
    try:
        assert _multi_turn(engine, convs) == reference
        stats = _check_clean(engine)
    finally:
        engine.shutdown()
    assert stats["cache"]["host_hit_tokens"] > 0 and stats["cache"]["host_loaded_tokens"] > 0


def _tcp_listeners(pid: int) -> set[tuple[str, int]]:
    return {c.laddr for c in psutil.Process(pid).net_connections("tcp") if c.status == psutil.CONN_LISTEN}


def _assert_ranks_talk_privately(followers, listening_before: set) -> None:
    """The leader's commands go over ipc:// sockets (one peer each) in a directory only this user
    can enter, and nothing the ranks opened listens beyond the loopback interface: a command socket
    on a loopback TCP port let any local process take a rank's commands and hang the server."""
    assert stat.S_IMODE(followers._dir.stat().st_mode) == 0o700
    for sock in followers._socks:
        assert sock.getsockopt_string(zmq.LAST_ENDPOINT).startswith(f"ipc://{followers._dir}/")
        assert sock.getsockopt(zmq.TYPE) == zmq.PAIR
    opened = _tcp_listeners(os.getpid()) - listening_before
    for proc in followers.procs:
        opened |= _tcp_listeners(proc.pid)
    assert all(ipaddress.ip_address(host).is_loopback for host, _ in opened), opened


@pytest.fixture(scope="module")
def tp_server(default_model_path):
    """One `radixrt serve --tp 2` for this module; its last test kills a rank, so
    the teardown only cleans up (no clean-exit check)."""
    srv = LocalServer("--tp", "2", "--max-total-tokens", "4096", SKIP_WARMUP, model=default_model_path)
    try:
        yield srv.wait_ready()
    finally:
        srv.stop()
        srv.cleanup()


def _ppid(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(") ", 1)[1].split()[1])


def _followers(server_pid: int) -> list[int]:
    """Pids of this server's follower ranks (server -> scheduler process -> followers)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                is_follower = b"radixrt.executor.parallel.follower" in f.read()
            if is_follower and _ppid(_ppid(int(pid))) == server_pid:
                found.append(int(pid))
        except (OSError, ValueError, IndexError):
            continue
    return found


def test_embedded_model_served_with_tp2_equals_tp1(tp_server, default_model_path):
    sp = {"max_new_tokens": 24, "temperature": 0}
    engine = radixrt.Engine(default_model_path, max_total_tokens=4096)
    try:
        want = _greedy(engine, PROMPTS, 24)
    finally:
        engine.shutdown()
    r = httpx.post(tp_server.url + "/generate", timeout=120, json={"text": PROMPTS, "sampling_params": sp})
    assert r.status_code == 200, r.text
    assert [o["output_ids"] for o in r.json()] == want


def test_a_weight_update_group_is_refused_before_anything_connects(tp_server):
    """Updates from tensors are not served under TP: joining a group is refused at once (it waited
    for the trainer, whose weights were then refused)."""
    group = {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1, "world_size": 2, "group_name": "g"}
    t0 = time.monotonic()
    r = httpx.post(tp_server.url + "/init_weights_update_group", json=group, timeout=30)
    assert r.status_code == 400 and "tensor parallelism" in r.json()["error"]["message"], r.text
    assert time.monotonic() - t0 < 5


def test_a_dead_rank_takes_the_server_down(tp_server):
    """Killing a follower rank makes the whole server exit (no hang, no
    half-model answers). Runs last: it ends the module's server."""
    followers = _followers(tp_server.proc.pid)
    assert len(followers) == 1, "the server runs one follower rank"
    os.kill(followers[0], signal.SIGKILL)
    deadline = time.monotonic() + 30
    while tp_server.proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert tp_server.proc.poll() is not None, "the server kept running with a dead rank"
