"""Fixtures shared by every test package.

Models: ``default_model_path`` (the embedded SmolLM2-135M, converted once),
``hf_model`` and ``tokenizer`` (transformers' model and tokenizer on it),
``tiny_llama`` (a tiny random-weight Llama folder made once per session) and
``make_tiny`` (the same for other architectures or config overrides).

Markers (registered in pyproject.toml): ``slow`` for end-to-end tests on the
embedded model, every test that starts or uses a server (a test of a session
server of tests/e2e/conftest.py is marked here, by its fixtures), long stress
runs and the other tests over about 2.5 s on a 2-core machine (``-m "not slow"``
is the fast path, under 3 minutes there); ``gpu`` for tests that need CUDA,
skipped here without it.
"""

import os
import sys

import pytest

from tests.support.xdist_order import (
    check_shared_server_modules,
    make_scheduler,
    order_heaviest_first,
    session_servers_used,
)

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# dtype auto is float32 in every engine and server the tests start, also on a CPU with native
# bf16 (where auto may measure bf16 faster): the tests compare outputs across configurations,
# which only float32 keeps equal (radixrt/executor/cpu_dtype.py)
os.environ.setdefault("RADIXRT_CPU_DTYPE", "float32")


def _share_the_cores_among_workers() -> None:
    """Under pytest-xdist, each worker (with the servers and CLI runs it starts, which inherit the
    environment) runs torch on cores / workers intra-op threads unless OMP_NUM_THREADS says
    otherwise: with every process on torch's default (one thread per core), the workers and their
    servers oversubscribe the cores and the OpenMP threads spin against each other, which slows
    every model forward several-fold (docs/benchmarks.md). A single-process run keeps torch's
    default; the tests of multi-threaded kernels set their thread counts themselves."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if workers < 1 or "OMP_NUM_THREADS" in os.environ:
        return
    threads = max(1, (os.cpu_count() or 1) // workers)
    os.environ["OMP_NUM_THREADS"] = str(threads)
    if "torch" in sys.modules:  # imported before this file (a plugin): too late for the variable
        sys.modules["torch"].set_num_threads(threads)


_share_the_cores_among_workers()


def _share_httpx_ssl_contexts() -> None:
    """Each httpx client (the openai package's too) builds an SSL context with certifi's CA bundle as
    it is made, plain-HTTP ones included: 20-80 ms of CPU each, about 35 s of the suite's (py-spy over
    a whole run). The suite's clients all speak plain HTTP to 127.0.0.1, so those made with the same
    arguments share one context (httpx's transport builds it through this function)."""
    import functools

    import httpx._transports.default as transports

    transports.create_ssl_context = functools.lru_cache(maxsize=None)(transports.create_ssl_context)


_share_httpx_ssl_contexts()


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """``--dist loadfile`` with the modules of one shared server in one unit, heaviest units first
    (tests/support/xdist_order.py)."""
    return make_scheduler(config, log)


# the session servers of tests/e2e/conftest.py: a test that uses one, directly or through another
# fixture, is marked slow (the fast path starts no server); a module with a server of its own marks
# its tests itself
SERVER_FIXTURES = frozenset({"tiny_server", "default_server"})


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
def pytest_collection_modifyitems(config, items):
    for item in items:
        if session_servers_used(item, SERVER_FIXTURES):
            item.add_marker(pytest.mark.slow)
    check_shared_server_modules(items, SERVER_FIXTURES)
    order_heaviest_first(items)
    gpu_items = [item for item in items if item.get_closest_marker("gpu")]
    if not gpu_items:
        return
    import torch

    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="needs CUDA")
        for item in gpu_items:
            item.add_marker(skip)


# ---------------------------------------------------------------- the embedded model
@pytest.fixture(scope="session")
def default_model_path() -> str:
    from radixrt.executor.model_store import resolve_model_path

    return resolve_model_path("default")


@pytest.fixture(scope="session")
def hf_model(default_model_path):
    """transformers' reference model on the embedded weights (fp32, CPU)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(default_model_path, dtype=torch.float32)
    model.eval()
    return model


@pytest.fixture(scope="session")
def tokenizer(default_model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_model_path)


# ---------------------------------------------------------------- tiny random models
@pytest.fixture(scope="session")
def make_tiny(tmp_path_factory):
    """``make_tiny(arch="llama", *, tokenizer=True, seed=0, **config_overrides)`` -> the folder of a
    tiny random-weight model (radixrt.bench.tiny_model.make_tiny_model), made once per session for
    each distinct set of arguments. The folders are shared: tests read them, never change them."""
    from radixrt.bench.tiny_model import make_tiny_model

    made: dict[tuple, str] = {}

    def make(arch: str = "llama", *, tokenizer: bool = True, seed: int = 0, **overrides) -> str:
        key = (arch, tokenizer, seed, repr(sorted(overrides.items())))
        if key not in made:
            made[key] = make_tiny_model(
                tmp_path_factory.mktemp(f"tiny-{arch}"), arch, tokenizer=tokenizer, seed=seed, **overrides
            )
        return made[key]

    return make


@pytest.fixture(scope="session")
def tiny_llama(make_tiny) -> str:
    """A tiny random-weight Llama with SmolLM2's tokenizer and chat template, and the embedded
    model's context length (8192 tokens)."""
    return make_tiny("llama", max_position_embeddings=8192)
