"""Servers that several e2e modules share.

Session-scoped, so pytest-xdist (``--dist loadfile``) starts one per worker
that runs a module using it, and a single process starts one in all."""

from __future__ import annotations

import pytest

from tests.support.servers import serving


@pytest.fixture(scope="session")
def default_server(default_model_path):
    """``radixrt serve`` on the embedded model with 24,576 KV tokens (tool calling, the Responses API)."""
    yield from serving("--max-total-tokens", "24576", model="default")
