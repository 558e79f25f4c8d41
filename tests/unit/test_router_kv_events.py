"""The router's KV-event index, its subscriber, request token keys and the
cache_aware policy on events (no model, no server; one real ZMQ socket pair)."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
import zmq

from radixrt.memory.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    KVEventRecorder,
    decode_batch,
    encode_batch,
)
from radixrt.requests.cache_fields import cache_namespace
from radixrt.router.kv_event_index import KVEventIndex, TokenKey, block_hashes
from radixrt.router.kv_event_subscriber import KVEventSubscriber
from radixrt.router.kv_routing import parse_endpoints
from radixrt.router.policies import CacheAware, CacheAwareConfig
from radixrt.router.token_keys import token_key

A, B = "http://a", "http://b"


def stored(ids: list[int], namespace=None, size: int = 4) -> BlockStored:
    return BlockStored(list(block_hashes(namespace, ids, size)), None, ids, size, None, "CPU")


def batch(*events) -> KVEventBatch:
    return KVEventBatch(ts=0.0, events=list(events))


def test_block_hashes_are_the_workers():
    """The router's chain equals the worker's recorder's, namespace and page size included."""
    rec = KVEventRecorder(page_size=4)
    root_ns = SimpleNamespace(id=0, key=[], parent=None)
    first = SimpleNamespace(id=1, key=list(range(8)), parent=root_ns)
    second = SimpleNamespace(id=2, key=[9, 9, 9, 9], parent=first)
    rec.on_node_insert('["salt", null]', first)
    rec.on_node_insert('["salt", null]', second)
    events = rec.drain().events
    published = events[0].block_hashes + events[1].block_hashes
    assert published == list(block_hashes('["salt", null]', list(range(8)) + [9, 9, 9, 9, 5], 4))  # whole blocks
    assert published != list(block_hashes(None, list(range(8)) + [9, 9, 9, 9], 4))


def test_index_store_remove_clear_and_match():
    idx = KVEventIndex()
    ids = list(range(100, 116))
    idx.apply(A, 0, batch(stored(ids)))
    hashes = list(block_hashes(None, ids, 4))
    assert idx.live(A) and idx.match(A, hashes) == 4 and idx.held_tokens(A) == 16
    assert idx.match(A, list(block_hashes(None, ids[:8] + [1, 2, 3, 4], 4))) == 2  # diverges in block 3
    idx.apply(A, 1, batch(BlockRemoved(hashes[2:], "CPU")))
    assert idx.match(A, hashes) == 2
    idx.apply(A, 2, batch(AllBlocksCleared()))
    assert idx.match(A, hashes) == 0 and idx.live(A)
    assert idx.match(B, hashes) == 0 and not idx.live(B)


def test_index_sync_rules():
    idx = KVEventIndex()
    ids = list(range(8))
    idx.apply(A, 5, batch(stored(ids)))  # joined mid-stream: what came before is unknown
    assert not idx.live(A)
    idx.apply(A, 6, batch(AllBlocksCleared(), stored(ids)))  # a flush: complete from here on
    assert idx.live(A) and idx.held_tokens(A) == 8
    idx.apply(A, 9, batch(stored([7] * 4)))  # batches 7 and 8 lost
    assert not idx.live(A) and idx.stats()[A]["gaps"] == 2
    idx.apply(A, 0, batch(stored(ids)))  # the publisher restarted: a fresh cache
    assert idx.live(A) and idx.held_tokens(A) == 8 and idx.stats()[A]["restarts"] == 1
    idx.disconnected(A)
    assert not idx.live(A) and idx.held_tokens(A) == 0
    idx.apply(A, 0, batch(stored(ids)))
    assert idx.live(A)


def test_index_memory_is_bounded():
    idx = KVEventIndex(max_blocks=3)
    idx.apply(A, 0, batch(stored(list(range(20)))))  # 5 blocks
    s = idx.stats()[A]
    assert s["blocks"] == 3 and s["overflow"] == 2


def test_what_a_worker_announces_is_bounded():
    """Stores past MAX_STORES and blocks of size < 1 are ignored (counted); a huge batch is
    applied APPLY_CHUNK hashes per hold of the lock, so routing never waits for all of it."""
    from radixrt.router import kv_event_index as kei

    idx = KVEventIndex()
    media = [f"STORAGE:s{i}" for i in range(3 * kei.MAX_STORES)]
    idx.apply(A, 0, batch(*(BlockStored([i], None, [1] * 4, 4, None, m) for i, m in enumerate(media))))
    idx.apply(A, 1, batch(BlockStored([10**6], None, [1] * 4, 0, None, "CPU")))
    s = idx.stats()[A]
    assert len(s["stores"]) == kei.MAX_STORES and s["ignored"] == 2 * kei.MAX_STORES + 1
    assert s["blocks"] == 0 and s["block_size"] is None

    holds = []

    class CountingLock:
        def __init__(self) -> None:
            self.inner = idx._lock

        def __enter__(self):
            holds.append(1)
            return self.inner.__enter__()

        def __exit__(self, *exc):
            return self.inner.__exit__(*exc)

    idx._lock = CountingLock()
    n = 10 * kei.APPLY_CHUNK
    idx.apply(B, 0, batch(BlockStored(list(range(n)), None, [], 1, None, "CPU")))
    assert len(holds) >= 10 and idx.stats()[B]["blocks"] == n


def test_match_tokens_needs_every_worker_live_and_follows_namespaces():
    idx = KVEventIndex()
    ids = list(range(12))
    idx.apply(A, 0, batch(stored(ids[:8])))
    key = TokenKey(None, tuple(ids) + (99,))
    assert idx.match_tokens([A, B], key) is None  # B's events are not flowing
    idx.apply(B, 0, batch(stored(ids)))
    assert idx.match_tokens([A, B], key) == {A: 8, B: 12}
    assert idx.match_tokens([A, B], TokenKey("other", key.ids)) == {A: 0, B: 0}


def test_token_keys_follow_the_worker():
    class Tok:
        def encode(self, text: str) -> list[int]:
            return [1] + [ord(c) for c in text]  # a BOS, as add_special_tokens=True adds

    tok = Tok()
    assert token_key("/generate", {"input_ids": [5, 6]}) == TokenKey(None, (5, 6))
    assert token_key("/generate", {"input_ids": [[5, 6], [7]], "cache_salt": "s"}) == TokenKey(
        cache_namespace("s"), (5, 6)
    )
    assert token_key("/generate", {"text": "ab"}) is None  # no tokenizer
    assert token_key("/generate", {"text": ["ab", "c"]}, tok) == TokenKey(None, (1, 97, 98))
    assert token_key("/generate", {"text": "ab", "input_ids": [1]}, tok) is None  # the worker refuses it
    assert token_key("/generate", {"input_ids": [1], "cache_salt": 3}) is None
    assert token_key("/generate", {"input_ids": [1], "extra_key": "k"}) == TokenKey('[null, null, "k"]', (1,))
    assert token_key("/v1/completions", {"prompt": "ab", "prompt_cache_key": "k"}, tok) == TokenKey(
        cache_namespace(None, "k"), (1, 97, 98)
    )
    assert token_key("/v1/completions", {"prompt": [[3, 4]]}) == TokenKey(None, (3, 4))
    assert token_key("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}, tok) is None


def test_cache_aware_routes_on_events_when_live_else_on_its_tree():
    idx = KVEventIndex()
    p = CacheAware(CacheAwareConfig(cache_threshold=0.5), events=idx)
    loads = {A: 0, B: 0}
    ids = list(range(40))
    key, tokens = tuple(ids), TokenKey(None, tuple(ids))
    assert p.select([A, B], loads, key, tokens) == A  # nothing known: the smallest tree, A by order
    assert p.sources == {"events": 0, "approx_tree": 0, "no_events": 1}
    idx.apply(A, 0, batch())
    idx.apply(B, 0, batch(stored(ids[:32])))  # B got the prefix some other way than through the router
    assert p.select([A, B], loads, key, tokens) == B  # the tree says A; B's cache really holds it
    assert p.sources == {"events": 1, "approx_tree": 0, "no_events": 1} and p.counts["prefix"] == 1
    short = TokenKey(None, tuple(ids[:12]) + tuple(range(600, 640)))  # 12 of 52 held by B: under the threshold
    assert p.select([A, B], loads, short.ids, short) == A  # the tree's smallest (40 ids each: A by order)
    fresh = TokenKey(None, tuple(range(500, 540)))
    assert p.select([A, B], loads, fresh.ids, fresh) == B  # no cache holds it: the tree's smallest (B 40 < A 80)
    assert p.select([A, B], loads, fresh.ids + (1,), TokenKey(None, fresh.ids + (1,))) == B  # in flight: the tree
    assert p.sources == {"events": 1, "approx_tree": 3, "no_events": 1}
    idx.disconnected(B)
    assert p.select([A, B], loads, key, tokens) == A  # B's events stopped: the tree (which has A) decides
    assert p.stats()["sources"]["no_events"] == 2 and "kv_events" in p.stats()


def test_parse_endpoints():
    urls = ["http://10.0.0.1:30000", "http://10.0.0.2:30000/"]
    assert parse_endpoints(urls, ["tcp://h1:1", "tcp://h2:2"]) == {urls[0]: "tcp://h1:1", urls[1][:-1]: "tcp://h2:2"}
    assert parse_endpoints(urls, ["http://10.0.0.2:30000=tcp://x:5"]) == {urls[1][:-1]: "tcp://x:5"}
    assert parse_endpoints(urls, [], port=5557) == {
        urls[0]: "tcp://10.0.0.1:5557",
        urls[1][:-1]: "tcp://10.0.0.2:5557",
    }
    with pytest.raises(ValueError, match="not a --worker-url"):
        parse_endpoints(urls, ["http://elsewhere:1=tcp://x:5"])
    with pytest.raises(ValueError, match="endpoints for"):
        parse_endpoints(urls, ["tcp://a:1", "tcp://b:2", "tcp://c:3"])


def _wait(cond, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_subscriber_follows_a_publisher_and_its_restart():
    ctx = zmq.Context.instance()
    pub = ctx.socket(zmq.PUB)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    idx = KVEventIndex()
    sub = KVEventSubscriber(idx, {A: f"tcp://127.0.0.1:{port}"})
    sub.start()
    try:
        _wait(lambda: idx.stats().get(A, {}).get("connected"))
        time.sleep(0.3)  # the subscription reaches the publisher just after the connection
        seq = 0

        def send(*events) -> None:
            nonlocal seq
            pub.send_multipart([b"", seq.to_bytes(8, "big"), encode_batch(batch(*events))])
            seq += 1

        send(stored(list(range(8))))
        _wait(lambda: idx.held_tokens(A) == 8)
        assert idx.live(A)
        pub.send_multipart([b"", b"x", b"garbage"])  # skipped, the thread lives on
        send(stored(list(range(8, 16))))
        _wait(lambda: idx.held_tokens(A) == 16)
        pub.close(linger=0)  # the worker stops
        _wait(lambda: not idx.live(A))
        pub = ctx.socket(zmq.PUB)
        pub.bind(f"tcp://127.0.0.1:{port}")  # ... and comes back, its numbers from 0
        _wait(lambda: idx.stats()[A]["connected"])
        time.sleep(0.3)
        seq = 0
        send(stored(list(range(4))))
        _wait(lambda: idx.live(A) and idx.held_tokens(A) == 4)
        assert sub.bad_messages == 1
    finally:
        sub.stop()
        pub.close(linger=0)


def _free_port() -> int:
    from radixrt.server.local import free_port

    return free_port()


def test_a_late_router_replays_what_it_missed_and_vllms_req_client_works():
    """A worker publishes with a replay socket; a router that starts after the
    worker's first batches (and misses them) fetches them again and is live at
    once, holding exactly the worker's blocks, without a /flush_cache; a batch
    dropped later is fetched again too."""
    from radixrt.config.kv_events import KVEventsConfig
    from radixrt.memory.kv_pool import PageAllocator
    from radixrt.memory.radix_cache import RadixCache
    from radixrt.scheduler.kv_event_publisher import KVEvents

    pub_port, replay_port = _free_port(), _free_port()
    cfg = KVEventsConfig(True, "zmq", f"tcp://127.0.0.1:{pub_port}", replay_endpoint=f"tcp://127.0.0.1:{replay_port}")
    alloc = PageAllocator(1000, 4)
    tree = RadixCache(alloc, page_size=4)
    events = KVEvents(cfg, tree, page_size=4, medium="CPU")
    prompts = [[i] * 8 + list(range(20 + i, 28 + i)) for i in range(5)]

    def insert(ids: list[int]) -> None:
        slots = alloc.pages_to_slots(alloc.alloc_pages(len(ids) // 4))
        present = tree.insert(ids, slots)
        if present:
            alloc.free_slots(slots[:present])
        events.flush()

    for ids in prompts[:3]:  # nobody listens yet: batches 0..2 reach no subscriber
        insert(ids)
    idx = KVEventIndex()
    sub = KVEventSubscriber(idx, {A: cfg.connect_endpoint}, replay_endpoints={A: cfg.connect_replay_endpoint})
    sub.start()
    try:
        _wait(lambda: idx.stats().get(A, {}).get("connected"))
        time.sleep(0.3)
        for ids in prompts[3:]:
            insert(ids)
        _wait(lambda: idx.held_tokens(A) == 5 * 16)
        assert idx.live(A) and sub.replayed >= 3 and idx.stats()[A]["gaps"] == 0
        for ids in prompts:
            assert idx.match_tokens([A], TokenKey(None, tuple(ids))) == {A: 16}

        # a batch dropped at the publisher's socket (past its high-water mark) is fetched on the next one
        send = events.socket.send_multipart
        events.socket.send_multipart = lambda *a, **k: (_ for _ in ()).throw(zmq.Again())
        insert([9] * 16)
        events.socket.send_multipart = send
        insert([10] * 16)
        _wait(lambda: idx.held_tokens(A) == 7 * 16)
        assert events.dropped == 1 and idx.live(A) and idx.stats()[A]["gaps"] == 0
        assert idx.match_tokens([A], TokenKey(None, (9,) * 16)) == {A: 16}

        req = zmq.Context.instance().socket(zmq.REQ)  # vLLM's example subscriber asks with REQ
        req.connect(cfg.connect_replay_endpoint)
        req.send((3).to_bytes(8, "big"))
        assert req.poll(2000)
        seq, payload = req.recv_multipart()
        assert int.from_bytes(seq, "big") == 3 and decode_batch(payload).events
        req.close(linger=0)
    finally:
        sub.stop()
        events.close()


def test_dp_replicas_replay_ports_must_not_collide():
    import json

    from radixrt.config.kv_events import parse_kv_events_config, replica_kv_events_configs

    text = json.dumps(
        {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": "tcp://*:5557",
            "replay_endpoint": "tcp://*:5567",
        }
    )
    cfgs = [parse_kv_events_config(t) for t in replica_kv_events_configs(text, 3)]
    assert [(c.endpoint, c.replay_endpoint) for c in cfgs] == [
        (f"tcp://*:{5557 + i}", f"tcp://*:{5567 + i}") for i in range(3)
    ]
    with pytest.raises(ValueError, match="at least 2 away"):
        replica_kv_events_configs(text.replace("5567", "5558"), 2)
    with pytest.raises(ValueError, match="replay_endpoint"):
        parse_kv_events_config(text.replace("tcp://*:5567", "tcp://*:5557"))


def test_a_worker_added_at_run_time_is_followed_on_the_workers_ports():
    """`/add_worker` with --kv-events-port (and --kv-events-replay-port): the new
    worker's events are followed from then on; `/remove_worker` stops that."""
    from radixrt.config.kv_events import KVEventsConfig
    from radixrt.memory.kv_pool import PageAllocator
    from radixrt.memory.radix_cache import RadixCache
    from radixrt.router.kv_routing import KVEventRouting
    from radixrt.scheduler.kv_event_publisher import KVEvents

    port, replay = _free_port(), _free_port()
    cfg = KVEventsConfig(True, "zmq", f"tcp://127.0.0.1:{port}", replay_endpoint=f"tcp://127.0.0.1:{replay}")
    alloc = PageAllocator(100, 1)
    tree = RadixCache(alloc, page_size=1)
    events = KVEvents(cfg, tree, page_size=1, medium="CPU")
    tree.insert([5, 6, 7], alloc.pages_to_slots(alloc.alloc_pages(3)))
    events.flush()  # published before the router knew the worker
    routing = KVEventRouting({}, port=port, replay_port=replay)
    routing.start()
    worker = "http://127.0.0.1:30000"
    try:
        routing.add_worker(worker + "/")
        _wait(lambda: routing.index.live(worker) and routing.index.held_tokens(worker) == 3)
        assert routing.subscriber.endpoints == {worker: f"tcp://127.0.0.1:{port}"}
        routing.remove_worker(worker)
        _wait(lambda: not routing.index.stats()[worker]["connected"])
        assert not routing.index.live(worker) and routing.subscriber.endpoints == {}
    finally:
        routing.stop()
        events.close()


def test_storage_blocks_count_for_every_worker_sharing_the_store():
    """Blocks a worker's storage tier announces (medium STORAGE:<store>) count for
    every worker that announced the same store, survive a flush of the workers'
    caches, and go when the store evicts them."""
    from radixrt.memory.kv_events import storage_medium

    store, other = storage_medium("redis://shared:6379/0#m"), storage_medium("file://a/kv#m")
    ids = list(range(100, 164))
    idx = KVEventIndex()
    disk = BlockStored(list(block_hashes(None, ids, 16)), None, ids, 16, None, store)
    idx.apply(A, 0, batch(disk, BlockStored([], None, [], 16, None, other)))
    idx.apply(B, 0, batch(BlockStored([], None, [], 16, None, store)))  # B uses the same store
    idx.apply(C := "http://c", 0, batch(stored(ids[:8])))  # C holds 8 tokens on its device, no store
    key = TokenKey(None, tuple(ids + [1, 2]))
    assert idx.match_tokens([A, B, C], key) == {A: 64, B: 64, C: 8}
    assert idx.held_tokens(A) == 0  # a worker's own set is its device tree only
    idx.apply(A, 1, batch(AllBlocksCleared()))  # a flush empties caches, not stores
    assert idx.match_tokens([A, B], key) == {A: 64, B: 64}
    idx.apply(B, 1, batch(BlockRemoved([disk.block_hashes[2]], store)))  # the store evicted the third block
    assert idx.match_tokens([A, B], key) == {A: 32, B: 32}
    assert idx.stats()[A]["stores"] == {other: 0, store: 3}


def _announce_huge_message(port: int, socket_type: bytes) -> bytes:
    """Speak ZMTP 3.0 to ``port`` as a ``socket_type`` peer, announce a 2.5 GB message, send 3
    bytes of it; what the server sends back until it closes the connection, or b"still open"
    when it waits 3 s for the rest."""
    import socket
    import struct

    with socket.create_connection(("127.0.0.1", port), timeout=3) as s:
        s.sendall(b"\xff" + b"\x00" * 8 + b"\x7f" + b"\x03\x00" + b"NULL".ljust(20, b"\x00") + b"\x00" * 32)
        ready = b"\x05READY" + b"\x0bSocket-Type" + struct.pack(">I", len(socket_type)) + socket_type
        s.sendall(b"\x04" + bytes([len(ready)]) + ready)
        s.sendall(b"\x02" + struct.pack(">Q", 2_500_000_000) + b"abc")
        received = b""
        try:
            while chunk := s.recv(4096):
                received += chunk
        except TimeoutError:
            return b"still open"
        return received


def test_the_event_sockets_stay_local_and_refuse_what_no_peer_should_send():
    """The events carry every tenant's prompt token ids: the default endpoint is loopback and one
    open beyond it is warned about; a peer that announces a message larger than a subscription
    (PUB) or a replay request (ROUTER) is cut off at once instead of ZMQ allocating its size."""
    from radixrt.config.kv_events import KVEventsConfig, exposure_warning
    from radixrt.memory.kv_pool import PageAllocator
    from radixrt.memory.radix_cache import RadixCache
    from radixrt.scheduler.kv_event_publisher import KVEvents

    assert KVEventsConfig().endpoint == "tcp://127.0.0.1:5557"
    assert exposure_warning("tcp://127.0.0.1:5557") is None and exposure_warning("ipc:///tmp/e") is None
    for open_endpoint in ("tcp://*:5557", "tcp://0.0.0.0:5557", "tcp://10.0.0.1:5557"):
        assert "every tenant" in (exposure_warning(open_endpoint) or "")
    pub_port, replay_port = _free_port(), _free_port()
    cfg = KVEventsConfig(True, "zmq", f"tcp://127.0.0.1:{pub_port}", replay_endpoint=f"tcp://127.0.0.1:{replay_port}")
    alloc = PageAllocator(100, 4)
    events = KVEvents(cfg, RadixCache(alloc, page_size=4), page_size=4, medium="CPU")
    try:
        for port, peer in ((replay_port, b"DEALER"), (pub_port, b"SUB")):
            assert _announce_huge_message(port, peer) != b"still open", f"port {port} kept a peer announcing 2.5 GB"
    finally:
        events.close()


def test_a_replay_that_never_ends_is_cut_off_and_the_stream_goes_on(monkeypatch):
    """A publisher whose replay socket answers without end (no end marker) costs the router a
    bounded answer, not unbounded memory or a stuck thread: live batches apply afterwards."""
    from radixrt.router import kv_event_subscriber as kes

    monkeypatch.setattr(kes, "MAX_REPLAY_BATCHES", 300)
    ctx = zmq.Context.instance()
    pub, rep = ctx.socket(zmq.PUB), ctx.socket(zmq.ROUTER)
    pub_port, rep_port = pub.bind_to_random_port("tcp://127.0.0.1"), rep.bind_to_random_port("tcp://127.0.0.1")
    stop = threading.Event()

    def answer_forever() -> None:
        while not stop.is_set():
            if not rep.poll(50):
                continue
            ident, _ = rep.recv_multipart()
            seq = 0
            while not stop.is_set():
                rep.send_multipart([ident, seq.to_bytes(8, "big"), encode_batch(batch(stored([seq % 97] * 4)))])
                seq += 1

    streamer = threading.Thread(target=answer_forever, daemon=True)
    streamer.start()
    idx = KVEventIndex()
    sub = KVEventSubscriber(
        idx, {A: f"tcp://127.0.0.1:{pub_port}"}, replay_endpoints={A: f"tcp://127.0.0.1:{rep_port}"}
    )
    sub.start()
    try:
        _wait(lambda: sub.replayed > 0, timeout=20)
        assert sub.replayed <= 300 and sub.bad_messages >= 1
        stop.set()
        time.sleep(0.3)
        live = idx.next_seq(A)
        pub.send_multipart([b"", live.to_bytes(8, "big"), encode_batch(batch(AllBlocksCleared()))])
        _wait(lambda: idx.live(A) and idx.next_seq(A) == live + 1)
    finally:
        stop.set()
        sub.stop()
        pub.close(linger=0)
        rep.close(linger=0)
