"""End-to-end tests of `radixrt serve --dp 2` and `radixrt router` on a
tiny random Llama (slow: they start real servers).

One module-scoped setup keeps the cost to one launch: a ``--dp 2`` server
(two replica servers behind its router front, API key "k"), and two
standalone router processes (cache_aware and round_robin) in front of the
same two replicas, as a router in front of servers on other machines would
be. Which replica answered is read from each replica's own cache counters
(``/get_server_info``) and the router's ``x-radixrt-worker`` header. The
health tests run last: a replica stopped (SIGSTOP) leaves routing and comes
back (SIGCONT); a replica killed makes its requests fail over, and the
``--dp`` front, whose health covers every replica, exits non-zero and takes
the other replica down with it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from radixrt.server.local import LocalServer, free_port
from tests.support.servers import SKIP_WARMUP, pid_alive
from tests.support.slow_client import drip

pytestmark = pytest.mark.slow

KEY = "k"
ROUTER_READ_TIMEOUT_S = 1.0  # the round_robin router's --header-read-timeout-s and --body-read-timeout-s
ROUTER_MAX_BODY = 8192  # the round_robin router's --max-request-bytes
AUTH = {"Authorization": f"Bearer {KEY}"}
# one client for the module: a new httpx client per request costs 80 ms of CPU building its SSL context,
# which the health polls below would take from the servers under test
HTTP = httpx.Client(timeout=5)
ADMIN_KEY = "admin"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}  # /flush_cache and /abort_request: the workers have the admin key
# Two system prompts of ~60 tokens each; questions add a few tokens.
SYSTEM = [
    f"You are assistant number {i}. " + " ".join(f"rule {i}-{j} is important." for j in range(12)) for i in range(2)
]


class Worker:
    """One replica of the --dp server, by its private url and process ids."""

    def __init__(self, url: str, pids: dict) -> None:
        self.url = url
        self.pids = pids


class Router:
    """A `radixrt router` process."""

    def __init__(self, urls: list[str], policy: str, health_interval: float, *extra: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [
            sys.executable,
            "-m",
            "radixrt.cli",
            "router",
            "--port",
            str(self.port),
            "--policy",
            policy,
            "--api-key",
            KEY,
            "--health-check-interval",
            str(health_interval),
            "--health-check-timeout",
            "3",
            "--health-failure-threshold",
            "1",
            *extra,
        ]
        for u in urls:
            cmd += ["--worker-url", u]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        deadline = time.monotonic() + 120  # a loaded 2-core CI machine imports slowly
        while True:
            assert self.proc.poll() is None, self.proc.stdout.read() if self.proc.stdout else ""
            try:
                if HTTP.get(self.url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "router not ready"
            time.sleep(0.2)

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(20)


@pytest.fixture(scope="module")
def dp_server(tiny_llama):
    srv = LocalServer(
        "--dp",
        "2",
        "--max-total-tokens",
        "4096",
        "--served-model-name",
        "tiny",
        "--router-health-check-interval",
        "0.5",
        "--router-health-check-timeout",
        "3",
        "--router-health-failure-threshold",
        "1",
        "--admin-api-key",
        ADMIN_KEY,
        "--enable-lora",
        SKIP_WARMUP,
        "--log-requests",  # test_each_replicas_log_lines_name_it
        "--log-requests-level",
        "0",
        model=tiny_llama,
        api_key=KEY,
    )
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.cleanup()


@pytest.fixture(scope="module")
def workers(dp_server):
    info = HTTP.get(dp_server.url + "/get_server_info", headers=AUTH, timeout=30).json()
    return [Worker(w["url"], w["info"]["process_ids"]) for w in info["workers"]]


@pytest.fixture(scope="module")
def routers(workers):
    urls = [w.url for w in workers]
    # cache_aware: rare health checks, so that only a failed request can remove a worker (the failover test),
    # and an admin key; round_robin: frequent ones (the stopped-worker test), short read timeouts (the
    # slow-client test) and a small body limit
    made = {
        "cache_aware": Router(urls, "cache_aware", 60.0, "--admin-api-key", ADMIN_KEY),
        "round_robin": Router(
            urls,
            "round_robin",
            0.3,
            "--header-read-timeout-s",
            str(ROUTER_READ_TIMEOUT_S),
            "--body-read-timeout-s",
            str(ROUTER_READ_TIMEOUT_S),
            "--max-request-bytes",
            str(ROUTER_MAX_BODY),
        ),
    }
    yield made
    for r in made.values():
        assert r.stop() == 0


def test_router_cuts_off_slow_clients(routers):
    """The router shares the server's read timeouts (radixrt/server/slow_clients.py):
    headers or a body sent a byte every 0.2 s get a 408 and a closed connection."""
    router = routers["round_robin"]
    auth = f"Authorization: Bearer {KEY}\r\n".encode()
    for head, trickle in (
        (b"POST /generate HTTP/1.1\r\nHost: x\r\n", b"X-Slow: yes\r\n"),
        (b"POST /generate HTTP/1.1\r\nHost: x\r\n" + auth + b"Content-Length: 500\r\n\r\n", b'{"text": "aaaa'),
    ):
        elapsed, received = drip(router.port, head, trickle, ROUTER_READ_TIMEOUT_S + 10)
        assert ROUTER_READ_TIMEOUT_S - 0.3 <= elapsed <= ROUTER_READ_TIMEOUT_S + 1.5, (elapsed, received)
        assert received.startswith(b"HTTP/1.1 408 "), received
    assert _generate(router, "still served").status_code == 200


def _hits(worker: Worker) -> tuple[int, int]:
    """(queried, hit) prompt tokens of a worker's radix cache since start."""
    info = HTTP.get(worker.url + "/get_server_info", headers=AUTH, timeout=30).json()
    cache = info["internal_states"][0]["cache"]
    return cache["queried_tokens"], cache["hit_tokens"]


def _generate(router: Router, text: str, max_new_tokens: int = 3) -> httpx.Response:
    r = HTTP.post(
        router.url + "/generate",
        headers=AUTH,
        timeout=120,
        json={"text": text, "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0}},
    )
    assert r.status_code == 200, r.text
    return r


def test_dp2_serves_native_and_openai_routes(dp_server, workers):
    srv = dp_server
    assert HTTP.get(srv.url + "/health").status_code == 200
    assert HTTP.post(srv.url + "/generate", json={"text": "x"}).status_code == 401  # the key covers the front
    info = HTTP.get(srv.url + "/get_server_info", headers=AUTH, timeout=30).json()
    assert len(info["internal_states"]) == 2 and info["router"]["policy"] == "cache_aware"
    assert info["dp_size"] == 2 and f":{info['port']}" in srv.url  # the front's, not a replica's
    prefix = SYSTEM[0] + " Question: "
    metas = [
        HTTP.post(
            srv.url + "/generate",
            headers=AUTH,
            timeout=60,
            json={"text": prefix + str(i), "sampling_params": {"max_new_tokens": 3}},
        ).json()["meta_info"]
        for i in range(3)
    ]
    assert [m["completion_tokens"] for m in metas] == [3, 3, 3]
    assert metas[1]["cached_tokens"] > 0 and metas[2]["cached_tokens"] > 0  # cache_aware: the same replica
    r = HTTP.post(
        srv.url + "/v1/chat/completions",
        headers=AUTH,
        timeout=60,
        json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
    )
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
    assert {w.url for w in workers} == {w["url"] for w in info["workers"]}
    # the admin key passes the front (as on one server) and reaches the replica, which lifts the priority cap
    urgent = {"text": "x", "priority": 10**6, "sampling_params": {"max_new_tokens": 1}}
    refused = HTTP.post(srv.url + "/generate", headers=AUTH, timeout=60, json=urgent)
    assert refused.status_code == 400 and "--admin-api-key" in refused.text, refused.text
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    assert HTTP.post(srv.url + "/generate", headers=admin, timeout=60, json=urgent).status_code == 200
    assert HTTP.post(srv.url + "/generate", headers={"x-api-key": "wrong"}, json=urgent).status_code == 401
    # SGLang's load probes: one entry per replica, numbered by its rank (one replica's alone before)
    assert [row["dp_rank"] for row in HTTP.get(srv.url + "/get_load", headers=AUTH, timeout=30).json()] == [0, 1]
    loads = HTTP.get(srv.url + "/v1/loads", headers=AUTH, params={"dp_rank": 1}, timeout=30).json()["loads"]
    assert [row["dp_rank"] for row in loads] == [1] and loads[0]["max_total_num_tokens"] > 0
    gauges = HTTP.get(srv.url + "/v1/loads", headers=AUTH, params={"format": "prometheus"}, timeout=30).text
    assert 'sglang_num_running_reqs{dp_rank="0"}' in gauges and 'sglang_num_running_reqs{dp_rank="1"}' in gauges
    assert gauges.count("# TYPE sglang_num_running_reqs gauge") == 1  # one group per metric
    # a weight-update group's member has one rank: through the front one replica would join, and then
    # be updated alone (the others kept their weights, unseen); refused, naming where to send it
    group = {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1, "world_size": 2, "group_name": "g"}
    for path in ("/init_weights_update_group", "/update_weights_from_distributed", "/destroy_weights_update_group"):
        r = HTTP.post(srv.url + path, headers=admin, timeout=30, json=group)
        assert r.status_code == 400 and "own rank" in r.json()["error"]["message"], (path, r.text)
    # a program through the frontend's RuntimeEndpoint: the front looks like one server
    import radixrt as rt

    @rt.function
    def fan(s):
        s += rt.system(SYSTEM[1]) + rt.user("Pick one.")
        s += rt.assistant(rt.select("c", choices=["red", "green", "blue"]))
        forks = s.fork(3)
        for f in forks:
            f += rt.user("More?") + rt.assistant(rt.gen("more", max_tokens=3))
        forks.join()

    backend = rt.RuntimeEndpoint(srv.url, api_key=KEY)
    assert backend.get_role_markers()["user"][0] == "<|im_start|>user\n"  # /get_model_info via the front
    st = fan.run(backend=backend, temperature=0)
    assert st.error() is None and st["c"] in ("red", "green", "blue") and len(st["more"]) == 3
    assert all(w.url.startswith("http://127.0.0.1:") and w.url != srv.url for w in workers)


def test_each_replicas_log_lines_name_it(dp_server):
    """A replica's processes prefix their log lines with its index: a request pinned to rank 1 is
    logged by "server dp1" (every replica wrote "[... server]" before)."""
    for rank in (0, 1):
        headers = {**AUTH, "X-Data-Parallel-Rank": str(rank)}
        body = {"text": "hello", "sampling_params": {"max_new_tokens": 1}, "rid": f"logged-on-{rank}"}
        assert HTTP.post(dp_server.url + "/generate", headers=headers, json=body, timeout=60).status_code == 200
    log = dp_server.log_tail(1_000_000)
    for rank in (0, 1):
        lines = [line for line in log.splitlines() if f'Receive: rid="logged-on-{rank}"' in line]
        assert len(lines) == 1 and f" server dp{rank}] INFO radixrt.request_log" in lines[0], lines


def test_lora_adapters_load_through_the_front_on_every_replica(dp_server, workers, tiny_llama, tmp_path):
    from tests.support.lora import make_adapter

    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    path = make_adapter(tiny_llama, tmp_path / "a", 8, seed=5, scale=0.5)
    r = HTTP.post(
        dp_server.url + "/load_lora_adapter", headers=admin, timeout=150, json={"lora_name": "a", "lora_path": path}
    )
    assert r.status_code == 200 and "a" in r.json()["loaded_adapters"], r.text
    body = {"input_ids": list(range(5, 40)), "sampling_params": {"max_new_tokens": 4, "temperature": 0}}
    outs = [
        HTTP.post(w.url + "/generate", headers=AUTH, timeout=60, json={**body, "lora_path": "a"}).json()["output_ids"]
        for w in workers
    ]
    assert outs[0] == outs[1] and len(outs[0]) == 4  # every replica holds it, with the same weights
    assert HTTP.post(workers[0].url + "/generate", headers=AUTH, timeout=60, json=body).json()["output_ids"] != outs[0]
    bad = HTTP.post(dp_server.url + "/load_lora_adapter", headers=admin, json={"lora_name": "b", "lora_path": "/nope"})
    assert bad.status_code == 400 and "adapter_config.json" in bad.json()["error"]["message"], bad.text
    assert HTTP.post(
        dp_server.url + "/load_lora_adapter", headers=AUTH, json={"lora_name": "c", "lora_path": path}
    ).status_code in (401, 403)
    gone = HTTP.post(dp_server.url + "/unload_lora_adapter", headers=admin, timeout=60, json={"lora_name": "a"})
    assert gone.status_code == 200
    for w in workers:
        after = HTTP.post(w.url + "/generate", headers=AUTH, timeout=60, json={**body, "lora_path": "a"})
        assert after.status_code == 400 and "unknown LoRA adapter" in after.text


def test_every_replica_profiles_into_its_own_trace(dp_server, workers, tmp_path):
    """/start_profile through the --dp front: every replica profiles (one profile_id for all) and
    writes its own trace, named with SGLang's -DP-<rank>; /stop_profile ends them all."""
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    body = {"output_dir": str(tmp_path), "profile_id": "p1"}
    r = HTTP.post(dp_server.url + "/start_profile", headers=admin, timeout=60, json=body)
    assert r.status_code == 200 and r.text.count("Start profiling") == 2, r.text
    for w in workers:  # a step on each
        assert HTTP.post(w.url + "/generate", headers=AUTH, timeout=60, json={"text": "x"}).status_code == 200
    r = HTTP.post(dp_server.url + "/stop_profile", headers=admin, timeout=120)
    assert r.status_code == 200 and r.text.count("Stop profiling") == 2, r.text
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"p1-TP-0-DP-{i}.trace.json.gz" for i in range(2)]
    again = HTTP.post(dp_server.url + "/stop_profile", headers=admin, timeout=60)
    assert again.status_code == 400, again.text  # none runs any more, on either


def test_cache_aware_routes_a_prefix_to_the_worker_that_holds_it(workers, routers):
    router = routers["cache_aware"]
    assert HTTP.post(router.url + "/flush_cache", headers=ADMIN, timeout=30).status_code == 200
    first = {i: _generate(router, SYSTEM[i] + " Question: hello?").headers["x-radixrt-worker"] for i in range(2)}
    assert sorted(first.values()) == sorted(w.url for w in workers)  # two new prefixes: one per worker
    by_url = {w.url: w for w in workers}
    for i in range(2):
        owner = by_url[first[i]]
        other = next(w for w in workers if w is not owner)
        before_owner, before_other = _hits(owner), _hits(other)
        r = _generate(router, SYSTEM[i] + f" Question: what is {i + 7}?")
        assert r.headers["x-radixrt-worker"] == owner.url
        meta = r.json()["meta_info"]
        assert meta["cached_tokens"] >= 50, meta
        after_owner, after_other = _hits(owner), _hits(other)
        assert after_owner[1] - before_owner[1] == meta["cached_tokens"]  # the owner's tree served the prefix
        assert after_other == before_other  # the other worker saw nothing
    stats = HTTP.get(router.url + "/list_workers", headers=AUTH).json()["policy_stats"]
    assert stats["decisions"]["prefix"] >= 2


def test_round_robin_alternates(workers, routers):
    router = routers["round_robin"]
    before = [_hits(w)[0] for w in workers]
    picked = [_generate(router, SYSTEM[0] + " Question: again?").headers["x-radixrt-worker"] for _ in range(4)]
    assert picked[0] != picked[1] and picked[:2] == picked[2:]
    after = [_hits(w)[0] for w in workers]
    assert all(a > b for a, b in zip(after, before))  # both workers computed the same prompt


def test_routed_dp_rank_picks_the_worker_of_that_rank(workers, routers):
    """SGLang's routed_dp_rank (the Engine's data_parallel_rank): the worker of that rank in the
    router's order, whatever the policy; the field does not reach the worker (which serves one rank)."""
    router = routers["round_robin"]
    for rank, field in ((0, "routed_dp_rank"), (1, "routed_dp_rank"), (1, "data_parallel_rank")):
        for _ in range(2):  # round robin would alternate
            body = {"text": "x", "sampling_params": {"max_new_tokens": 1}, field: rank}
            r = HTTP.post(router.url + "/generate", headers=AUTH, json=body, timeout=60)
            assert r.status_code == 200 and r.headers["x-radixrt-worker"] == workers[rank].url, r.text
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 1}
    completion = {"model": "tiny", "prompt": "x", "max_tokens": 1}
    for path, body in (("/v1/chat/completions", chat), ("/v1/completions", completion)):
        for rank in (0, 1, 1, 0):  # the OpenAI routes too, as SGLang's
            r = HTTP.post(router.url + path, headers=AUTH, json={**body, "routed_dp_rank": rank}, timeout=60)
            assert r.status_code == 200 and r.headers["x-radixrt-worker"] == workers[rank].url, r.text
    for rank in (1, 0, 0, 1):  # SGLang's header, before the body's field
        headers = {**AUTH, "X-Data-Parallel-Rank": str(rank)}
        r = HTTP.post(
            router.url + "/v1/chat/completions", headers=headers, json={**chat, "routed_dp_rank": 1 - rank}, timeout=60
        )
        assert r.status_code == 200 and r.headers["x-radixrt-worker"] == workers[rank].url, r.text
    r = HTTP.post(router.url + "/generate", headers=AUTH, json={"text": "x", "routed_dp_rank": 2}, timeout=60)
    assert r.status_code == 400 and "names no worker" in r.text
    r = HTTP.post(
        router.url + "/v1/chat/completions", headers={**AUTH, "X-Data-Parallel-Rank": "7"}, json=chat, timeout=60
    )
    assert r.status_code == 400 and "names no worker" in r.text
    responses = {"model": "tiny", "input": "x", "max_output_tokens": 1, "store": False}
    for rank in (1, 0):  # and on /v1/responses (and /v1/messages), which the policy does not route
        headers = {**AUTH, "X-Data-Parallel-Rank": str(rank)}
        r = HTTP.post(router.url + "/v1/responses", headers=headers, json=responses, timeout=60)
        assert r.status_code == 200 and r.headers["x-radixrt-worker"] == workers[rank].url, r.text
    r = HTTP.post(router.url + "/v1/responses", headers={**AUTH, "X-Data-Parallel-Rank": "7"}, json=responses)
    assert r.status_code == 400 and "names no worker" in r.text
    r = HTTP.post(
        router.url + "/generate", headers={**AUTH, "X-Data-Parallel-Rank": "one"}, json={"text": "x"}, timeout=60
    )
    assert r.status_code == 400 and "must be an integer rank" in r.text
    for bad in ("1", True):  # not "unsupported" (the worker's word): the router serves ranks
        r = HTTP.post(router.url + "/generate", headers=AUTH, json={"text": "x", "routed_dp_rank": bad}, timeout=60)
        assert r.status_code == 400 and "must be an integer rank" in r.text, r.text


def test_a_sessions_requests_stay_on_its_worker(workers, routers):
    """SGLang's sessions live in one worker: under round robin every turn of a session still goes
    to the worker that opened it (the router names a session that comes without an id)."""
    router = routers["round_robin"]
    for opened in (
        HTTP.post(router.url + "/open_session", headers=AUTH, json={"capacity_of_str_len": 100}),
        HTTP.post(router.url + "/open_session", headers=AUTH, json={"session_id": "mine", "streaming": True}),
    ):
        assert opened.status_code == 200, opened.text
        sid, home = opened.json(), opened.headers["x-radixrt-worker"]
        params = {"id": sid, "rid": None}
        for i in range(4):
            body = {"input_ids": [600 + i, 601], "session_params": params, "sampling_params": {"max_new_tokens": 2}}
            r = HTTP.post(router.url + "/generate", headers=AUTH, json=body, timeout=60)
            assert r.status_code == 200 and r.headers["x-radixrt-worker"] == home, r.text
            if sid != "mine":  # a tree session: continue the turn just made
                params = {"id": sid, "rid": r.json()["meta_info"]["id"]}
            assert r.json()["meta_info"]["prompt_tokens"] == 2 + 4 * i  # every earlier turn, on that worker
        closed = HTTP.post(router.url + "/close_session", headers=AUTH, json={"session_id": sid})
        assert closed.status_code == 200 and closed.headers["x-radixrt-worker"] == home


def test_streams_openai_and_broadcast_routes(workers, routers):
    router = routers["cache_aware"]
    assert HTTP.post(router.url + "/generate", json={"text": "x"}).status_code == 401  # no key
    assert HTTP.get(router.url + "/health").status_code == 200  # health needs none
    page = HTTP.get(router.url + "/dashboard")  # nor the live view's page (a browser sends no key)...
    assert page.status_code == 200 and "text/html" in page.headers["content-type"]
    assert HTTP.get(router.url + "/debug/radix").status_code == 401  # ... but what it shows does
    with httpx.stream(
        "POST",
        router.url + "/generate",
        headers=AUTH,
        timeout=60,
        json={"text": SYSTEM[1] + " Stream?", "stream": True, "sampling_params": {"max_new_tokens": 4}},
    ) as r:
        events = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]" and len(events) >= 2
    openai = pytest.importorskip("openai")
    with openai.OpenAI(base_url=router.url + "/v1", api_key=KEY, max_retries=0, timeout=60) as client:
        assert [m.id for m in client.models.list().data] == ["tiny"]
        out = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=3, temperature=0
        )
        assert out.usage.completion_tokens == 3
        chunks = list(
            client.chat.completions.create(
                model="tiny", max_tokens=3, stream=True, messages=[{"role": "user", "content": "hi"}]
            )
        )
        assert chunks[-1].choices[0].finish_reason == "length"
        comp = client.completions.create(model="tiny", prompt=SYSTEM[0], max_tokens=2)
        assert comp.usage.completion_tokens == 2
    info = HTTP.get(router.url + "/get_server_info", headers=AUTH, timeout=30).json()
    assert len(info["internal_states"]) == 2 and {w["url"] for w in info["workers"]} == {w.url for w in workers}
    assert info["router"]["policy"] == "cache_aware"
    assert HTTP.post(router.url + "/abort_request", headers=ADMIN, json={"rid": "nope"}).status_code == 200
    assert HTTP.post(router.url + "/abort_request", headers=ADMIN, json={"rid": 5}).status_code == 400
    assert HTTP.post(router.url + "/flush_cache", headers=ADMIN, timeout=30).status_code == 200
    assert all(_hits(w) is not None for w in workers)
    for label in ("step-3", "default"):  # every worker's label, then the one they started with again
        r = HTTP.post(router.url + "/update_weight_version", headers=ADMIN, json={"new_version": label}, timeout=30)
        assert r.status_code == 200 and r.json()["new_version"] == label, r.text
        assert [HTTP.get(w.url + "/get_weight_version", headers=AUTH).json()["weight_version"] for w in workers] == [
            label
        ] * len(workers)


def test_only_the_admin_key_changes_the_workers(dp_server, workers, routers):
    """Adding a worker decides where clients' prompts and keys go: a client's key gets a 403 (on
    a router without an admin key, nobody may), and the router's own address is refused (it
    would send each request round through itself)."""
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    elsewhere = "http://127.0.0.1:9"
    for router_url in (dp_server.url, routers["cache_aware"].url, routers["round_robin"].url):
        for route in ("/add_worker", "/remove_worker"):
            r = HTTP.post(router_url + route, headers=AUTH, params={"url": elsewhere})
            assert r.status_code == 403 and "admin key" in r.json()["error"]["message"], (router_url, r.text)
            assert ("--admin-api-key" in r.text) == (router_url == routers["round_robin"].url), r.text
    for router_url in (dp_server.url, routers["cache_aware"].url):
        r = HTTP.post(router_url + "/add_worker", headers=admin, params={"url": router_url + "/"})
        assert r.status_code == 400 and "reaches this router itself" in r.text, r.text
        listed = HTTP.get(router_url + "/list_workers", headers=AUTH).json()["workers"]
        assert sorted(w["url"] for w in listed) == sorted(w.url for w in workers)
    assert HTTP.get(dp_server.url + "/health").status_code == 200


def test_a_path_with_dot_segments_is_refused_before_the_key_check(routers):
    """/metrics/../generate passed the router's key check as an open path, and httpx sent it to
    the worker as /generate: a keyed router in front of unkeyed workers served it without a key."""
    import http.client

    router = routers["round_robin"]
    for path in ("/metrics/../get_server_info", "/health/%2e%2e/get_server_info", "/./get_server_info"):
        conn = http.client.HTTPConnection("127.0.0.1", router.port, timeout=30)
        try:
            conn.request("GET", path)  # sent as written: http.client resolves nothing
            r = conn.getresponse()
            assert r.status == 400 and b"segments" in r.read(), (path, r.status)
        finally:
            conn.close()
    assert HTTP.get(router.url + "/get_server_info", headers=AUTH).status_code == 200


def test_the_router_refuses_a_body_past_its_limit(routers):
    router = routers["round_robin"]
    big = {"text": "x" * ROUTER_MAX_BODY, "sampling_params": {"max_new_tokens": 1}}
    r = HTTP.post(router.url + "/generate", headers=AUTH, json=big)
    assert r.status_code == 413 and str(ROUTER_MAX_BODY) in r.json()["error"]["message"], r.text

    def chunks():  # no Content-Length: refused once the bytes read pass the limit
        yield b'{"text": "'
        for _ in range(2 * ROUTER_MAX_BODY // 1024):
            yield b"y" * 1024
        yield b'"}'

    r = HTTP.post(router.url + "/generate", headers={**AUTH, "content-type": "application/json"}, content=chunks())
    assert r.status_code == 413, r.text
    assert _generate(router, "still served").status_code == 200


def test_a_client_that_leaves_a_routed_request_cancels_it_on_the_worker(workers, routers):
    """A non-streaming answer starts only when it is complete: until then the router watches the
    client, and when it leaves, the worker's request is cancelled (it aborts it)."""
    router = routers["cache_aware"]
    body = {"text": "A long story", "sampling_params": {"max_new_tokens": 3000, "ignore_eos": True}}
    with pytest.raises(httpx.ReadTimeout):
        HTTP.post(router.url + "/generate", headers=AUTH, json=body, timeout=1.0)

    def running() -> int:
        states = [HTTP.get(w.url + "/get_server_info", headers=AUTH, timeout=30).json() for w in workers]
        return sum(s["internal_states"][0]["running"] + s["internal_states"][0]["waiting"] for s in states)

    _wait(lambda: running() == 0, "the request ran on after its client left", timeout=5.0)


def _healthy(router: Router) -> dict:
    return {w["url"]: w["healthy"] for w in HTTP.get(router.url + "/list_workers", headers=AUTH).json()["workers"]}


def _wait(cond, what: str, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


def test_a_stopped_worker_leaves_routing_and_comes_back(workers, routers, dp_server):
    router = routers["round_robin"]
    frozen, other = workers
    os.kill(frozen.pids["server"], signal.SIGSTOP)
    try:
        _wait(lambda: not _healthy(router)[frozen.url], "a stopped worker stayed in routing")
        for i in range(3):
            assert _generate(router, f"Prompt {i} while one worker sleeps").headers["x-radixrt-worker"] == other.url
        _wait(lambda: HTTP.get(dp_server.url + "/health").status_code == 503, "--dp health ignored a replica")
        # a state change the sleeping replica did not get is not answered as done
        r = HTTP.post(dp_server.url + "/flush_cache", headers=ADMIN, timeout=30)
        message = r.json()["error"]["message"]
        assert r.status_code == 502 and f"{frozen.url}: not sent: out of routing" in message and "1 applied" in message
    finally:
        os.kill(frozen.pids["server"], signal.SIGCONT)
    _wait(lambda: _healthy(router)[frozen.url], "the worker was not added back")
    _wait(lambda: HTTP.get(dp_server.url + "/health").status_code == 200, "--dp health did not recover")
    picked = {_generate(router, "Round and round").headers["x-radixrt-worker"] for _ in range(2)}
    assert picked == {frozen.url, other.url}


def test_a_killed_worker_fails_over_and_the_dp_front_goes_down_with_it(workers, routers, dp_server):
    router = routers["cache_aware"]
    assert HTTP.post(router.url + "/flush_cache", headers=ADMIN, timeout=30).status_code == 200
    owner_url = _generate(router, SYSTEM[0] + " Before the crash?").headers["x-radixrt-worker"]
    victim = next(w for w in workers if w.url == owner_url)
    survivor = next(w for w in workers if w is not victim)
    # the --dp front is held still while the standalone router fails over (it would stop the survivor)
    os.kill(dp_server.proc.pid, signal.SIGSTOP)
    try:
        for pid in victim.pids.values():
            os.kill(pid, signal.SIGKILL)
        _wait(lambda: not pid_alive(victim.pids["server"]), "the replica did not die")
        # routed to the dead worker by its prefix: the connect error moves it to the survivor
        r = _generate(router, SYSTEM[0] + " After the crash?")
        assert r.headers["x-radixrt-worker"] == survivor.url
        assert HTTP.get(router.url + "/list_workers", headers=AUTH).json()["failovers"] >= 1
        # out of routing: at once after a connect error, after a probe of /health when a kept-alive
        # connection was found closed
        _wait(lambda: _healthy(router)[victim.url] is False, "the dead worker stayed in routing")
        assert _generate(router, SYSTEM[0] + " And again?").headers["x-radixrt-worker"] == survivor.url
    finally:
        os.kill(dp_server.proc.pid, signal.SIGCONT)
    # the --dp front's health covers every replica: it exits non-zero and stops the other one
    assert dp_server.proc.wait(30) == 1, dp_server.log_tail()
    _wait(lambda: not any(pid_alive(p) for p in survivor.pids.values()), "the other replica outlived the front")
    # standalone, the router has no worker left: a clear 503, not a hang or a 500
    r = HTTP.post(router.url + "/generate", headers=AUTH, json={"text": "anyone?"}, timeout=30)
    assert r.status_code == 503 and "no healthy worker" in r.json()["error"]["message"]
    assert HTTP.get(router.url + "/health").status_code == 503
