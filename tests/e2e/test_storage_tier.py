"""The storage tier through the Engine: a prefix computed before a restart is
read back after it (same greedy output, hits counted by tier), corrupt blocks
are refused and recomputed, a store of another layout is refused, and two
engines sharing one Redis share their blocks."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest

import radixrt
from radixrt.config.storage import DEFAULT_BLOCK_TOKENS
from radixrt.memory.kv_store import StoreMismatchError
from radixrt.requests.messages import RadixSnapshotReq
from radixrt.server.local import LocalServer
from tests.support.servers import SKIP_WARMUP
from tests.unit.test_kv_store import redis_url  # noqa: F401  (the fixture: a real redis-server)

GREEDY = {"max_new_tokens": 12, "temperature": 0.0}
BLOCK = DEFAULT_BLOCK_TOKENS  # tokens per stored block (page size 1)


def _prompt(n_words: int, tag: str = "") -> str:
    return "Inventory log. " + " ".join(f"item{i}{tag} ok" for i in range(n_words)) + " Summary:"


def _engine(model: str, **flags) -> radixrt.Engine:
    """An engine whose restarts read stored blocks only when a request needs them,
    unless ``hicache_storage_restore_tokens`` says otherwise (the restore's own tests)."""
    flags.setdefault("hicache_storage_backend", "file")
    flags.setdefault("hicache_storage_restore_tokens", 0)
    return radixrt.Engine(model, max_total_tokens=4096, debug_check_invariants=True, **flags)


def _restored(engine: radixrt.Engine) -> dict:
    """The engine's restore statistics once it is done."""
    deadline = time.monotonic() + 60
    while not (restore := engine.get_stats()["storage_kv"]["restore"])["done"]:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    return restore


def test_a_restarted_engine_restores_recent_prefixes_onto_the_device_before_any_request(
    tiny_llama, tmp_path: Path
) -> None:
    prompts, salts = [_prompt(150), _prompt(60, tag="-b")], [None, "tenant-b"]
    flags = dict(hicache_storage_dir=str(tmp_path))
    with _engine(tiny_llama, **flags) as first:
        before = [first.generate(p, GREEDY, cache_salt=salt)["text"] for p, salt in zip(prompts, salts)]
    with _engine(
        tiny_llama, hicache_storage_restore_tokens=100_000, hicache_storage_restore_wait=True, **flags
    ) as restarted:
        restore = restarted.get_stats()["storage_kv"]["restore"]
        assert restore["done"]  # the engine reported ready after the restore (--hicache-storage-restore-wait)
        after = [
            restarted.generate(p, GREEDY, return_cache_info=True, cache_salt=salt) for p, salt in zip(prompts, salts)
        ]
        unsalted = restarted.generate(prompts[1], {"max_new_tokens": 1}, return_cache_info=True)
        stats = restarted.scheduler.stats()
    assert [r["text"] for r in after] == before
    for r in after:  # every prompt token but the last (computed for its logits) was on the device already:
        n = r["meta_info"]["prompt_tokens"] - 1  # the restore brought the prompt and the output's stored blocks
        assert r["meta_info"]["cached_tokens"] == n
        assert r["meta_info"]["cache_info"]["tiers"] == {"device": n, "host": 0, "storage": 0}
    # the salted sequence came back in its own namespace: without the salt only what the first prompt
    # shares with it (its first words) is cached
    assert unsalted["meta_info"]["cached_tokens"] < 16
    assert restore["host_tokens"] == restore["device_tokens"] >= sum(r["meta_info"]["prompt_tokens"] for r in after)
    assert restore["host_tokens"] <= BLOCK * stats["storage_kv"]["hit_blocks"]
    assert stats["storage_kv"]["corrupt_blocks"] == 0 and stats["cache"]["storage_hit_tokens"] == 0


def test_a_restore_cut_by_a_corrupt_block_and_a_request_racing_it_give_the_same_answers(
    tiny_llama, tmp_path: Path
) -> None:
    prompt = _prompt(100)
    with _engine(tiny_llama, hicache_storage_dir=str(tmp_path)) as first:
        before = first.generate(prompt, GREEDY)
    blocks = sorted(tmp_path.rglob("*.kv"), key=lambda p: p.stat().st_mtime)
    middle = blocks[len(blocks) // 2]
    data = bytearray(middle.read_bytes())
    data[-5] ^= 0x01  # a payload byte: the frame head still verifies, the checksum does not
    middle.write_bytes(bytes(data))
    with _engine(tiny_llama, hicache_storage_dir=str(tmp_path), hicache_storage_restore_tokens=100_000) as restarted:
        restore = _restored(restarted)
        after = restarted.generate(prompt, GREEDY)
        storage = restarted.scheduler.stats()["storage_kv"]
    assert after["text"] == before["text"]
    assert storage["corrupt_blocks"] == 1 and 0 < restore["host_tokens"] == BLOCK * (len(blocks) // 2)
    assert after["meta_info"]["cached_tokens"] == restore["host_tokens"]
    with _engine(tiny_llama, hicache_storage_dir=str(tmp_path), hicache_storage_restore_tokens=100_000) as racing:
        raced = racing.generate(prompt, GREEDY)  # sent at once: the restore may still be reading
        assert _restored(racing)["done"]
    assert raced["text"] == before["text"] and raced["meta_info"]["cached_tokens"] >= restore["host_tokens"]


@pytest.mark.slow
def test_a_restarted_engine_reads_the_prefix_back_with_the_same_output(default_model_path, tmp_path: Path) -> None:
    prompt = _prompt(150)
    with _engine(default_model_path, dtype="float32", hicache_storage_dir=str(tmp_path)) as first:
        before = first.generate(prompt, GREEDY)
        assert first.scheduler.stats()["storage_kv"]["written_blocks"] >= 8
    with _engine(default_model_path, dtype="float32", hicache_storage_dir=str(tmp_path)) as restarted:
        after = restarted.generate(prompt, GREEDY, return_cache_info=True)
        stats = restarted.scheduler.stats()
    prompt_tokens = after["meta_info"]["prompt_tokens"]
    stored = prompt_tokens // BLOCK * BLOCK if prompt_tokens % BLOCK else prompt_tokens - BLOCK
    assert after["text"] == before["text"] and before["meta_info"]["cached_tokens"] == 0
    assert after["meta_info"]["cached_tokens"] == stored
    assert after["meta_info"]["cache_info"]["tiers"] == {"device": 0, "host": 0, "storage": stored}
    assert stats["cache"]["storage_hit_tokens"] == stored and stats["storage_kv"]["hit_blocks"] == stored // BLOCK
    assert stats["storage_kv"]["corrupt_blocks"] == 0
    assert stats["storage_kv"]["prefault_pages"] >= stored  # the pools' first pages were backed at start


def test_corrupt_blocks_are_refused_and_recomputed(tiny_llama, tmp_path: Path) -> None:
    prompt = _prompt(100)
    with _engine(tiny_llama, hicache_storage_dir=str(tmp_path)) as first:
        before = first.generate(prompt, GREEDY)
        deadline = time.monotonic() + 30
        while first.get_stats()["storage_kv"]["written_blocks"] < before["meta_info"]["prompt_tokens"] // BLOCK:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        view = first._control_call(RadixSnapshotReq(max_nodes=50)).payload
        assert any(n["where"] == "device+host+storage" for n in view["nodes"]), view["nodes"]
    blocks = sorted(tmp_path.rglob("*.kv"))
    assert len(blocks) >= 4
    for path in blocks[::2]:  # flip one payload byte in every other block
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0x01
        path.write_bytes(bytes(data))
    with _engine(tiny_llama, hicache_storage_dir=str(tmp_path)) as restarted:
        after = restarted.generate(prompt, GREEDY)
        storage = restarted.scheduler.stats()["storage_kv"]
    assert after["text"] == before["text"]
    assert storage["corrupt_blocks"] >= 1
    # the read stops at the first refused block: what was served is the intact run before it (blocks
    # after it may have been read by the read's other threads before they heard, and are not used)
    assert after["meta_info"]["cached_tokens"] == storage["loaded_tokens"] <= BLOCK * storage["hit_blocks"]
    assert storage["loaded_tokens"] % BLOCK == 0
    assert storage["written_blocks"] >= storage["corrupt_blocks"]  # recomputed blocks are stored again, intact


def test_requests_arriving_together_after_a_restart_share_one_read(tiny_llama, tmp_path: Path) -> None:
    prefix = _prompt(100)
    with _engine(tiny_llama, hicache_storage_dir=str(tmp_path)) as first:
        alone = [first.generate(prefix + q, GREEDY)["text"] for q in (" A", " B", " C")]
    with _engine(tiny_llama, hicache_storage_dir=str(tmp_path)) as restarted:
        together = restarted.generate([prefix + q for q in (" A", " B", " C")], GREEDY)
        stats = restarted.scheduler.stats()
    assert [r["text"] for r in together] == alone
    blocks = stats["storage_kv"]["hit_blocks"]
    assert blocks >= 4 and stats["cache"]["storage_hit_tokens"] == BLOCK * blocks  # read once, used by the first
    assert all(r["meta_info"]["cached_tokens"] >= BLOCK * blocks for r in together)


def test_a_beam_search_after_a_restart_reads_its_prompt_from_storage(tiny_llama, tmp_path: Path) -> None:
    prompt = _prompt(100)
    beam = {"max_new_tokens": 6, "beam_width": 3, "n": 2}
    with _engine(tiny_llama, hicache_storage_dir=str(tmp_path)) as first:
        first.generate(prompt, GREEDY)  # the prompt's blocks are stored
        before = first.generate(prompt, beam)
    with _engine(tiny_llama, hicache_storage_dir=str(tmp_path)) as restarted:
        after = restarted.generate(prompt, beam)
        stats = restarted.scheduler.stats()
    assert [r["output_ids"] for r in after] == [r["output_ids"] for r in before]
    read = BLOCK * stats["storage_kv"]["hit_blocks"]
    assert read >= 4 * BLOCK and stats["cache"]["storage_hit_tokens"] == read
    assert after[0]["meta_info"]["cached_tokens"] >= read


def test_a_store_of_another_page_size_is_refused(tiny_llama, tmp_path: Path) -> None:
    with _engine(tiny_llama, hicache_storage_dir=str(tmp_path)) as first:
        first.generate(_prompt(40), GREEDY)
    with pytest.raises(StoreMismatchError, match="page_size"):
        _engine(tiny_llama, hicache_storage_dir=str(tmp_path), page_size=4)


def test_two_engines_share_blocks_through_redis(tiny_llama, redis_url: str) -> None:  # noqa: F811
    prompts = [_prompt(60, tag=f"-{k}") for k in range(3)]
    with _engine(tiny_llama, hicache_storage_backend="redis", hicache_storage_url=redis_url) as a:
        first = [a.generate(p, GREEDY)["text"] for p in prompts]
        computed_cold = a.scheduler.stats()["prompt_tokens_computed"]
    with _engine(tiny_llama, hicache_storage_backend="redis", hicache_storage_url=redis_url) as b:
        second = [b.generate(p, GREEDY)["text"] for p in prompts]
        stats = b.scheduler.stats()
    assert second == first
    assert stats["storage_kv"]["hit_blocks"] >= 3
    assert stats["prompt_tokens_computed"] <= 0.4 * computed_cold


def _server(model: str, store: Path) -> LocalServer:
    flags = ("--hicache-storage-backend", "file", "--hicache-storage-dir", str(store), "--max-total-tokens", "4096")
    return LocalServer(*flags, SKIP_WARMUP, model=model).wait_ready()


@pytest.mark.slow  # two server start-ups and a kill -9: ~15 s
def test_kill_9_during_writes_then_a_restarted_server_serves_every_request(tiny_llama, tmp_path: Path) -> None:
    prompts = [_prompt(80, tag=f"-{k}") for k in range(10)]
    first = _server(tiny_llama, tmp_path)
    try:
        pids = httpx.get(first.url + "/get_server_info", timeout=30).json()["process_ids"]
        with httpx.Client(base_url=first.url, timeout=60) as c:
            done = {
                p: c.post("/generate", json={"text": p, "sampling_params": GREEDY}).json()["text"] for p in prompts[:3]
            }

            def fire(p: str) -> None:
                try:
                    c.post("/generate", json={"text": p, "sampling_params": GREEDY})
                except httpx.HTTPError:
                    pass  # the server is killed under it

            writers = [threading.Thread(target=fire, args=(p,)) for p in prompts[3:]]
            for t in writers:
                t.start()
            time.sleep(0.5)
            for pid in pids.values():  # the scheduler (which writes) and the front, mid-run
                os.kill(pid, signal.SIGKILL)
            for t in writers:
                t.join(30)
    finally:
        first.cleanup()
    second = _server(tiny_llama, tmp_path)
    try:
        with httpx.Client(base_url=second.url, timeout=60) as c:
            body = {"text": prompts[0], "sampling_params": GREEDY, "return_cache_info": True}
            again = c.post("/generate", json=body)
            assert again.status_code == 200 and again.json()["text"] == done[prompts[0]]
            # read back by the restore at start (device or host) or on demand (storage), whichever came first
            assert sum(again.json()["meta_info"]["cache_info"]["tiers"].values()) >= BLOCK
            for p in prompts[1:]:
                r = c.post("/generate", json={"text": p, "sampling_params": GREEDY})
                assert r.status_code == 200, r.text
                if p in done:
                    assert r.json()["text"] == done[p]
            info, metrics = c.get("/get_server_info").json(), c.get("/metrics").text
        storage = info["storage_kv_cache"]
        assert storage["corrupt_blocks"] == 0 and storage["hit_blocks"] >= 3
        assert "radixrt_cache_hit_tokens_total{model_name=" in metrics and 'tier="storage"' in metrics
        assert 'radixrt_storage_blocks_total{event="hit"' in metrics
        assert storage["restore"]["done"] and "radixrt_storage_restored_tokens_total{model_name=" in metrics
    finally:
        second.cleanup()


def test_stored_blocks_are_announced_as_kv_events_a_router_follows(tiny_llama, tmp_path: Path) -> None:
    """With KV events on, each block the storage tier writes is published (medium
    ``STORAGE:<store>``, the store's block size, the router's hash chain), and a
    router's index following the events counts it for the worker."""
    import json

    import zmq

    from radixrt.memory.kv_events import (
        STORAGE_MEDIUM_PREFIX,
        AllBlocksCleared,
        BlockStored,
        KVEventBatch,
        decode_batch,
    )
    from radixrt.router.kv_event_index import KVEventIndex, TokenKey, block_hashes
    from radixrt.server.local import free_port

    port = free_port()
    cfg = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://127.0.0.1:{port}"}
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(f"tcp://127.0.0.1:{port}")
    prompt = _prompt(100)
    try:
        with _engine(tiny_llama, hicache_storage_dir=str(tmp_path), kv_events_config=json.dumps(cfg)) as engine:
            time.sleep(0.5)  # the subscription reaches the publisher
            engine.generate(prompt, {**GREEDY, "max_new_tokens": 1})  # no output token's KV: the prompt's blocks
            ids = engine.tokenizer.encode(prompt)
            index, stored, deadline = KVEventIndex(), [], time.monotonic() + 30
            while len(stored) < len(ids) // BLOCK and time.monotonic() < deadline:
                if sub.poll(200):
                    _, seq, payload = sub.recv_multipart()
                    batch = decode_batch(payload)
                    index.apply("w", int.from_bytes(seq, "big"), batch)
                    stored += [e for e in batch.events if isinstance(e, BlockStored) and e.block_size == BLOCK]
                    engine.generate("x", {"max_new_tokens": 1})  # a step, so that the next batch is sent
    finally:
        sub.close(linger=0)
    assert stored and all(e.medium.startswith(STORAGE_MEDIUM_PREFIX) for e in stored)
    assert [h for e in stored for h in e.block_hashes] == list(block_hashes(None, ids, BLOCK))
    assert index.match_tokens(["w"], TokenKey(None, tuple(ids))) == {"w": len(ids)}  # its device tree
    assert index.stats()["w"]["stores"] == {stored[0].medium: len(ids) // BLOCK}
    index.apply("w", index.next_seq("w"), KVEventBatch(ts=0.0, events=[AllBlocksCleared()]))  # a flush
    assert index.match_tokens(["w"], TokenKey(None, tuple(ids))) == {"w": len(ids) // BLOCK * BLOCK}  # the store's


def test_pages_of_several_tokens_are_read_back_into_their_own_host_pages(tiny_llama, tmp_path: Path) -> None:
    """With 4-token pages, blocks read from storage (on demand, and by the restore at start) land in
    the host pages the tree gives them (they landed in the page numbered like the first slot), so
    every answer equals the first engine's."""
    prompts = [_prompt(40, tag=f"-{i}") for i in range(4)]
    flags = dict(hicache_storage_dir=str(tmp_path), page_size=4)
    with _engine(tiny_llama, **flags) as first:
        before = [first.generate(p, GREEDY)["output_ids"] for p in prompts]
    with _engine(tiny_llama, **flags) as on_demand:
        after = [on_demand.generate(p, GREEDY, return_cache_info=True) for p in prompts]
    assert [r["output_ids"] for r in after] == before
    assert all(r["meta_info"]["cache_info"]["tiers"]["storage"] >= 64 for r in after)
    with _engine(tiny_llama, hicache_storage_restore_tokens=100_000, hicache_storage_restore_wait=True, **flags) as e:
        assert [e.generate(p, GREEDY)["output_ids"] for p in prompts] == before


def test_a_host_tier_that_only_mirrors_the_device_pool_is_refused_with_a_storage_tier(
    tiny_llama, tmp_path: Path
) -> None:
    """Reads from storage land in free host pages; a write-through host tier no larger than the
    device pool never has one, so the storage tier would write and never serve: refused at start."""
    with pytest.raises(ValueError, match="more tokens than the device pool"):
        _engine(tiny_llama, hicache_storage_dir=str(tmp_path), host_kv_size=4096)


def test_one_request_rewrites_a_whole_stored_sequence_after_a_corrupt_block(tiny_llama, tmp_path: Path) -> None:
    """Every stored block corrupt: the first read stops at the first one, and the blocks after it,
    unreachable past it, are dropped too, so the request that recomputes them stores the whole
    sequence again (they stayed, and each later request repaired one block)."""
    prompt = _prompt(60)
    with _engine(tiny_llama, hicache_storage_dir=str(tmp_path)) as first:
        before = first.generate(prompt, GREEDY)
    for block in tmp_path.rglob("*.kv"):
        data = bytearray(block.read_bytes())
        data[-5] ^= 0x01
        block.write_bytes(bytes(data))
    with _engine(tiny_llama, hicache_storage_dir=str(tmp_path)) as repairing:
        assert repairing.generate(prompt, GREEDY)["output_ids"] == before["output_ids"]
        assert repairing.scheduler.stats()["storage_kv"]["corrupt_blocks"] >= 1  # (parallel reads may meet two)
    with _engine(tiny_llama, hicache_storage_dir=str(tmp_path)) as repaired:
        after = repaired.generate(prompt, GREEDY, return_cache_info=True)
    assert after["output_ids"] == before["output_ids"]
    prompt_tokens = after["meta_info"]["prompt_tokens"]
    assert after["meta_info"]["cache_info"]["tiers"]["storage"] == (prompt_tokens - 1) // BLOCK * BLOCK
