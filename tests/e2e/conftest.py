"""Servers that several e2e modules share.

Session-scoped, so pytest-xdist (``--dist loadfile``) starts one per worker
that runs a module using it, and a single process starts one in all
(tests/support/xdist_order.py keeps the modules of one server on one worker).
Each server's teardown checks that SIGTERM stops it and its children cleanly."""

from __future__ import annotations

import json

import pytest

from radixrt.server.local import free_port
from tests.support.servers import (
    TINY_SERVER_ADMIN_KEY,
    TINY_SERVER_KEY,
    TINY_SERVER_MAX_N,
    TINY_SERVER_MAX_TOP,
    serving,
)


@pytest.fixture(scope="session")
def default_server(default_model_path):
    """``radixrt serve`` on the embedded model with 24,576 KV tokens (tool calling, the Responses API),
    warming its grammar checker as a server does by default."""
    yield from serving("--max-total-tokens", "24576", model="default", warmup=True)


@pytest.fixture(scope="session")
def tiny_server(tiny_llama):
    """``radixrt serve`` on the tiny random Llama (test_server.py, test_request_ids.py, test_dashboard.py,
    test_hidden_states.py, test_weight_updates.py: which updates its weights, then restores them;
    test_sglang_utility_routes.py: its label, restored), served as
    "default", with the API key ``TINY_SERVER_KEY`` and the admin key ``TINY_SERVER_ADMIN_KEY``, 24,576 KV
    tokens, --enable-return-hidden-states,
    --max-request-bytes 200000, --max-n ``TINY_SERVER_MAX_N``, --max-top-logprobs-num
    ``TINY_SERVER_MAX_TOP`` and the overlap scheduler (a CUDA default, off on the CPU otherwise), so
    that streams, aborts and disconnects are also tested with a step in flight. ``folder`` and
    ``served_name`` are what it reports, ``admin_key`` its admin key; it publishes KV events at
    ``kv_events`` (test_dashboard.py)."""
    events = free_port()
    for srv in serving(
        "--max-total-tokens",
        "24576",
        "--max-request-bytes",
        "200000",
        "--served-model-name",
        "default",
        "--no-disable-overlap-schedule",
        "--enable-return-hidden-states",  # test_hidden_states.py
        "--max-n",
        str(TINY_SERVER_MAX_N),
        "--max-top-logprobs-num",
        str(TINY_SERVER_MAX_TOP),
        "--admin-api-key",
        TINY_SERVER_ADMIN_KEY,
        "--kv-events-config",
        json.dumps({"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://127.0.0.1:{events}"}),
        model=tiny_llama,
        api_key=TINY_SERVER_KEY,
    ):
        srv.folder, srv.served_name, srv.kv_events = tiny_llama, "default", f"tcp://127.0.0.1:{events}"
        srv.admin_key = TINY_SERVER_ADMIN_KEY
        yield srv
