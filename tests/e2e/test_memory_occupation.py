"""SGLang's release_memory_occupation / resume_memory_occupation (tiny random Llama): the KV pool's
and the weights' pages are given back while idle (the process's resident memory falls by the
pool's written pages), generation waits meanwhile and then answers exactly as before; refusals
are clear and change nothing."""

from __future__ import annotations

import concurrent.futures
import os
import time

import httpx
import pytest
import torch

from radixrt.memory.kv_pool import KVPool
from tests.support.engines import greedy, tiny_engine_fixture
from tests.support.servers import TINY_SERVER_ADMIN_KEY, TINY_SERVER_KEY, rss_bytes


def test_a_written_pool_gives_its_pages_back_and_reads_as_new():
    pool = KVPool(num_layers=4, num_pages=4096, page_size=16, num_kv_heads=2, head_dim=64)  # 64 MiB
    for buf in pool.buffers():
        buf.fill_(1.0)
    before = rss_bytes(os.getpid())
    freed = pool.release_pages()
    assert freed >= pool.total_bytes - 8 * 4096 and abs((before - rss_bytes(os.getpid())) - freed) < 0.05 * freed
    assert pool.release_pages() == 0  # nothing resident is left to give back
    assert all(float(buf.abs().sum()) == 0.0 for buf in pool.buffers())
    pool.k_buffers[0][3].fill_(2.0)  # written again: backed again
    assert float(pool.k_buffers[0].sum()) == 2.0 * pool.k_buffers[0][3].numel()


engine = tiny_engine_fixture(enable_memory_saver=True)  # SGLang's flag, as RL frameworks pass it


def test_release_holds_generation_and_resume_answers_as_before(engine):
    expected = engine.generate(input_ids=[1, 50, 51, 52], sampling_params=greedy(12))["output_ids"]
    out = engine.release_memory_occupation()
    assert out["released"] == ["kv_cache", "weights"] and out["freed_bytes"] > 0  # a CPU holds no graphs
    assert engine.get_server_info()["stats"]["kv"]["tree_slots"] == 0  # the prefix cache is gone
    pool = concurrent.futures.ThreadPoolExecutor(1)
    try:
        waiting = pool.submit(engine.generate, input_ids=[1, 50, 51, 52], sampling_params=greedy(12))
        time.sleep(0.5)
        assert not waiting.done()  # no step runs on released memory
        ok, message = engine.update_weights_from_tensor([("model.norm.weight", torch.ones(64))])
        assert not ok and "resume them first" in message
        engine.resume_memory_occupation(["weights"])
        time.sleep(0.3)
        assert not waiting.done()  # the KV cache is still released
        assert engine.resume_memory_occupation(["kv_cache"])["released"] == []  # as RL loops resume
        assert waiting.result(timeout=60)["output_ids"] == expected
    finally:
        engine.resume_memory_occupation()  # a failed check must not leave the request waiting forever
        pool.shutdown()
    with pytest.raises(ValueError, match="tags"):
        engine.release_memory_occupation(["gpu"])


def test_the_routes_refuse_while_requests_run_and_take_sglangs_bodies(tiny_server):
    admin = {"x-api-key": TINY_SERVER_ADMIN_KEY}
    with httpx.Client(base_url=tiny_server.url, headers={"x-api-key": TINY_SERVER_KEY}, timeout=120) as http:
        assert http.post("/release_memory_occupation", json={}).status_code == 403
        long = {"input_ids": [3, 4], "stream": True, "sampling_params": {"max_new_tokens": 100, "ignore_eos": True}}
        with http.stream("POST", "/generate", json=long) as running:
            next(running.iter_lines())
            r = http.post("/release_memory_occupation", json={"tags": ["kv_cache"]}, headers=admin)
            if r.status_code == 400:  # still running: refused, nothing released
                assert "requests are running" in r.json()["error"]["message"]
            else:  # it finished in between
                http.post("/resume_memory_occupation", json={}, headers=admin)
        r = http.post("/release_memory_occupation", json={"tags": ["kv_cache"]}, headers=admin)
        assert r.status_code == 200 and r.json()["released"] == ["kv_cache"], r.text
        assert (
            http.post("/resume_memory_occupation", json={"tags": ["kv_cache"]}, headers=admin).json()["released"] == []
        )
        r = http.post("/generate", json={"input_ids": [3, 4], "sampling_params": {"max_new_tokens": 3}})
        assert r.status_code == 200 and len(r.json()["output_ids"]) == 3
        assert http.post("/release_memory_occupation", json={"tags": "kv_cache"}, headers=admin).status_code == 400
        assert http.post("/release_memory_occupation", json={"nope": 1}, headers=admin).status_code == 400
