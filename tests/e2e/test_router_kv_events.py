"""End-to-end: `radixrt router` routing on its workers' KV cache events (slow:
two real servers on the tiny random Llama, each publishing events on ZMQ).

Worker A (page size 1) and worker B (page size 4) publish their events; the
router follows both (``--kv-events-endpoint``) with the model's tokenizer
(``--tokenizer-path``). A prompt is sent to B directly, not through the
router, so the router's approximate tree knows nothing of it (and would send
a new prompt to A, the first of two equally empty workers). A longer prompt
with the same prefix, sent through the router, must go to B: only B's events
tell the router that B holds that prefix. Both token-id and text prompts.
"""

from __future__ import annotations

import contextlib
import json
import random
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

from radixrt.server.local import LocalServer, free_port
from tests.support.servers import SKIP_WARMUP
from tests.support.weights import checkpoint_rows

pytestmark = pytest.mark.slow

SYSTEM = "You are a terse assistant for a shipping company. " + " ".join(f"Rule {i}: be exact." for i in range(10))


def _events_flag(port: int, replay_port: int | None = None) -> list[str]:
    cfg = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://127.0.0.1:{port}"}
    if replay_port is not None:
        cfg["replay_endpoint"] = f"tcp://127.0.0.1:{replay_port}"
    return ["--kv-events-config", json.dumps(cfg)]


@pytest.fixture(scope="module")
def setup(tiny_llama):
    ports = [free_port(), free_port()]
    replay_ports = [free_port(), free_port()]
    workers = [
        LocalServer(
            "--max-total-tokens", "4096", "--page-size", str(size), *_events_flag(p, r), SKIP_WARMUP, model=tiny_llama
        )
        for size, p, r in zip((1, 4), ports, replay_ports)
    ]
    router_port = free_port()
    cmd = [sys.executable, "-m", "radixrt.cli", "router", "--port", str(router_port), "--policy", "cache_aware"]
    cmd += ["--tokenizer-path", tiny_llama, "--health-check-interval", "60"]
    for w, p, r in zip(workers, ports, replay_ports):
        cmd += ["--worker-url", w.url, "--kv-events-endpoint", f"{w.url}=tcp://127.0.0.1:{p},tcp://127.0.0.1:{r}"]
    router = None
    try:
        for w in workers:
            w.wait_ready()
        router = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        url = f"http://127.0.0.1:{router_port}"
        _wait(lambda: _ok(url + "/health"), 120, router)
        yield url, workers
    finally:
        if router is not None:
            router.send_signal(signal.SIGTERM)
            assert router.wait(20) == 0
        for w in workers:
            w.cleanup()


def _ok(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def _wait(cond, timeout: float, proc=None) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if proc is not None:
            assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


def _stats(url: str) -> dict:
    return httpx.get(url + "/list_workers", timeout=10).json()["policy_stats"]


def _generate(url: str, body: dict) -> httpx.Response:
    body = {**body, "sampling_params": {"max_new_tokens": 2, "temperature": 0}}
    r = httpx.post(url + "/generate", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r


def _live(url: str, worker: str) -> bool:
    return bool(_stats(url).get("kv_events", {}).get(worker, {}).get("live"))


def test_router_sends_a_prefix_to_the_worker_whose_events_hold_it(setup):
    url, (a, b) = setup
    # The workers were serving before the router listened: their replay sockets make them live, no flush
    _generate(b.url, {"input_ids": list(range(3000, 3016))})
    _wait(lambda: _live(url, a.url) and _live(url, b.url), 30)

    ids = list(range(1000, 1064))
    _generate(b.url, {"input_ids": ids})  # straight to B: the router never sees it
    _wait(lambda: _stats(url)["kv_events"][b.url]["blocks"] >= 16, 30)
    before = _stats(url)["sources"]["events"]
    r = _generate(url, {"input_ids": ids + [7, 8, 9]})
    assert r.headers["x-radixrt-worker"] == b.url, _stats(url)
    assert _stats(url)["sources"]["events"] == before + 1
    assert r.json()["meta_info"]["cached_tokens"] >= 60

    _generate(b.url, {"text": SYSTEM})  # a text prompt, tokenized by the router as the worker does
    _wait(lambda: _stats(url)["kv_events"][b.url]["blocks"] >= 30, 30)
    r = _generate(url, {"text": SYSTEM + " Where is my parcel?"})
    assert r.headers["x-radixrt-worker"] == b.url, _stats(url)
    assert r.json()["meta_info"]["cached_tokens"] > 0

    # An unseen prompt goes to the worker holding the fewest tokens (A), as the events tell it
    r = _generate(url, {"input_ids": list(range(2000, 2040))})
    assert r.headers["x-radixrt-worker"] == a.url


_EPHEMERAL_LOW = 32768  # Linux hands out ports from here on to bind(0): the launcher's free_port() calls


def _free_run(n: int, below: int) -> int:
    """The first of ``n`` consecutive free ports under ``below``: outside the range free_port()
    draws from, so no port the --dp launcher picks for its replicas can be port + i (a flake once)."""
    rng = random.Random()
    while True:
        first = rng.randrange(20000, below - n)
        try:
            with contextlib.ExitStack() as held:
                for p in range(first, first + n):
                    s = held.enter_context(socket.socket())
                    s.bind(("127.0.0.1", p))
            return first
        except OSError:
            continue


def test_dp_front_follows_its_replicas_events(tiny_llama, make_tiny):
    """`radixrt serve --dp 2 --kv-events-config ...`: the front follows replica i at port + i (its replay
    socket too), with the model's tokenizer, by itself. A weight update sent to the front reaches
    both replicas, whose caches it drops (the front's view of them too)."""
    port, replay = _free_run(2, below=_EPHEMERAL_LOW), _free_run(2, below=_EPHEMERAL_LOW)
    while abs(replay - port) < 2:
        replay = _free_run(2, below=_EPHEMERAL_LOW)
    srv = LocalServer(
        "--dp", "2", "--max-total-tokens", "4096", *_events_flag(port, replay), SKIP_WARMUP, model=tiny_llama
    )
    try:
        srv.wait_ready()
        replicas = [w["url"] for w in httpx.get(srv.url + "/list_workers", timeout=10).json()["workers"]]
        _wait(lambda: all(_live(srv.url, u) for u in replicas), 30)  # replay: live without a flush
        _generate(replicas[1], {"text": SYSTEM})
        _wait(lambda: _stats(srv.url)["kv_events"][replicas[1]]["blocks"] > 0, 30)
        r = _generate(srv.url, {"text": SYSTEM + " And my refund?"})
        assert r.headers["x-radixrt-worker"] == replicas[1], _stats(srv.url)
        assert _stats(srv.url)["sources"]["events"] == 1
        before = [_generate(u, {"text": SYSTEM}).json()["output_ids"] for u in replicas]
        other = make_tiny("llama", seed=1, max_position_embeddings=8192)
        r = httpx.post(srv.url + "/update_weights_from_disk", json={"model_path": other}, timeout=120)
        assert r.status_code == 200 and r.json()["success"], r.text
        _wait(lambda: _stats(srv.url)["kv_events"][replicas[1]]["blocks"] == 0, 30)
        after = [_generate(u, {"text": SYSTEM}).json()["output_ids"] for u in replicas]
        assert before[0] == before[1] != after[0] == after[1]
        # the weights read back through the front (one replica answers; both serve the update)
        name = "model.layers.0.self_attn.v_proj.weight"
        got = httpx.request(
            "GET", srv.url + "/get_weights_by_name", json={"name": name, "truncate_size": 2}, timeout=30
        )
        assert got.status_code == 200 and got.json() == checkpoint_rows(other, name, 2), got.text
    finally:
        srv.cleanup()
