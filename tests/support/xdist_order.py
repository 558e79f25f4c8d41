"""How the suite's files are dealt to the pytest-xdist workers (``--dist loadfile``).

Two rules on top of xdist's own file-per-unit scheduling:

* Modules that share a session-scoped server of ``tests/e2e/conftest.py`` form one unit
  (``SHARED_SERVER_MODULES``), so the worker that starts that server runs all of them and the
  other worker never starts a second copy.
* Units are dealt heaviest first (``HEAVIEST_FIRST``, then the rest in collection order), so the
  long modules start at once and the two workers finish together instead of one of them
  running a long module alone at the end. xdist's default order (most tests first) put the
  long few-test modules (the fuzz test, tensor parallel) last.

Both lists hold paths relative to the repository root. A module missing from ``HEAVIEST_FIRST``
still runs (after the listed ones); list a new module there when it takes more than a few seconds.
"""

from __future__ import annotations

from typing import Optional

import pytest

# module -> the name of the session server it shares (tests/e2e/conftest.py)
SHARED_SERVER_MODULES: dict[str, str] = {
    "tests/e2e/test_tool_calls.py": "default_server",
    "tests/e2e/test_responses_api.py": "default_server",
    "tests/e2e/test_kv_budget_needle.py": "default_server",
    "tests/e2e/test_server.py": "tiny_server",
    "tests/e2e/test_request_ids.py": "tiny_server",
    "tests/e2e/test_dashboard.py": "tiny_server",
    "tests/e2e/test_weight_updates.py": "tiny_server",
    "tests/e2e/test_sglang_utility_routes.py": "tiny_server",
    "tests/e2e/test_hidden_states.py": "tiny_server",
    "tests/e2e/test_anthropic_api.py": "tiny_server",
    "tests/e2e/test_memory_occupation.py": "tiny_server",
    "tests/e2e/test_profile.py": "tiny_server",
    "tests/e2e/test_sessions.py": "tiny_server",
    "tests/e2e/test_tool_call_shapes.py": "tiny_server",
    "tests/e2e/test_weight_groups.py": "tiny_server",
}

# the slowest modules of the full suite, slowest first (per-module time of a --durations run,
# 2026-12-04: the whole suite 9:46 on the 2-core machine)
HEAVIEST_FIRST: tuple[str, ...] = (
    "tests/e2e/test_server.py",  # with test_request_ids.py, test_weight_updates.py, test_dashboard.py: one unit
    "tests/e2e/test_request_ids.py",
    "tests/e2e/test_weight_updates.py",
    "tests/e2e/test_tool_calls.py",  # with test_responses_api.py: one unit
    "tests/e2e/test_responses_api.py",
    "tests/e2e/test_kv_budget_needle.py",
    "tests/e2e/test_speculative.py",
    "tests/e2e/test_http_fuzz.py",
    "tests/e2e/test_beam_search.py",
    "tests/e2e/test_http_hardening.py",
    "tests/e2e/test_engine_scheduling.py",
    "tests/unit/test_kv_budget.py",
    "tests/e2e/test_engine_greedy.py",
    "tests/unit/test_bench_workloads.py",
    "tests/e2e/test_router_kv_events.py",
    "tests/e2e/test_constrained.py",
    "tests/unit/test_torch_compile.py",
    "tests/e2e/test_storage_tier.py",
    "tests/e2e/test_swap_preemption.py",
    "tests/e2e/test_cli.py",
    "tests/e2e/test_router.py",
    "tests/e2e/test_engine_api.py",
    "tests/e2e/test_frontend.py",
    "tests/e2e/test_sglang_client.py",
    "tests/e2e/test_deterministic.py",
    "tests/e2e/test_tensor_parallel.py",
    "tests/unit/test_cuda_device_scripts.py",
    "tests/unit/test_beam_search.py",
    "tests/unit/test_step_time_bench.py",
    "tests/e2e/test_tokenize_routes.py",
    "tests/e2e/test_kv_cache_dtype.py",
    "tests/e2e/test_lora.py",
    "tests/e2e/test_frontend_http.py",
    "tests/gpu/test_cuda_graph.py",
    "tests/e2e/test_kv_cache_server.py",
    "tests/unit/test_peers_bench.py",
    "tests/unit/test_radix_cache.py",
    "tests/unit/test_host_tier.py",
)
_RANK = {path: i for i, path in enumerate(HEAVIEST_FIRST)}


def module_path(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def session_servers_used(item: pytest.Item, names: frozenset[str]) -> set[str]:
    """The session servers of tests/e2e/conftest.py among ``names`` that ``item`` uses, directly or
    through another fixture (a module's own fixture of the same name does not count)."""
    info = getattr(item, "_fixtureinfo", None)  # pytest's resolved fixtures of a test function
    if info is None:
        return set()
    defs = info.name2fixturedefs
    return {name for name in names if name in defs and defs[name][-1].baseid == "tests/e2e"}


def check_shared_server_modules(items: list[pytest.Item], names: frozenset[str]) -> None:
    """Refuses to run when a module uses a session server but is not in ``SHARED_SERVER_MODULES``:
    the other worker would start a second copy of that server."""
    missing = sorted(
        {
            f"{module_path(item.nodeid)} ({', '.join(sorted(used))})"
            for item in items
            if (used := session_servers_used(item, names)) and module_path(item.nodeid) not in SHARED_SERVER_MODULES
        }
    )
    if missing:
        raise pytest.UsageError(f"add to SHARED_SERVER_MODULES in tests/support/xdist_order.py: {', '.join(missing)}")


def order_heaviest_first(items: list[pytest.Item]) -> None:
    """Sorts ``items`` in place by their module's place in ``HEAVIEST_FIRST`` (stable: the order
    within a module, and of the unlisted modules, is kept)."""
    items.sort(key=lambda item: _RANK.get(module_path(item.nodeid), len(_RANK)))


def make_scheduler(config: pytest.Config, log) -> Optional[object]:
    """The scheduler for ``--dist loadfile`` (None for the other modes: xdist's own)."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler.loadfile import LoadFileScheduling

    class SharedServerFileScheduling(LoadFileScheduling):
        """xdist's loadfile scheduling with the modules of one shared server in one unit, and the
        units in collection order (which ``order_heaviest_first`` made heaviest first)."""

        def __init__(self, config: pytest.Config, log=None) -> None:
            super().__init__(config, log)
            config.option.loadscopereorder = False  # xdist would reorder the units by test count

        def _split_scope(self, nodeid: str) -> str:
            path = module_path(nodeid)
            return SHARED_SERVER_MODULES.get(path, path)

    return SharedServerFileScheduling(config, log)
