"""Prometheus metrics of one server (its own registry, so several servers or
apps in one process do not collide).

Conventions (Prometheus's and SGLang's): a count that only grows is a
counter (``*_total``) and never goes down, not even on ``/flush_cache``
(which drops cached prefixes, not history); a rate over any window is the
client's ``rate()`` of counters. A gauge says in its help text what instant
or window it describes. Values taken from the scheduler (its stats) are
refreshed whenever ``/metrics`` is scraped.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Optional

from prometheus_client import CONTENT_TYPE_LATEST as CONTENT_TYPE_LATEST  # re-exported for admin_routes
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from radixrt.server.sglang_metrics import SGLangNames

_LATENCY_BUCKETS = (
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    1.5,
    2.0,
    3.0,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
# tokens of one request's prompt or output (1-2-5 steps, as vLLM's request token histograms)
_TOKEN_BUCKETS = tuple(float(m * 10**e) for e in range(6) for m in (1, 2, 5))
_E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)


# The scheduler's cumulative counts, exposed as counters: (name without _total, help,
# label name or None, {label value or None: key of the scheduler's stats}).
_SCHEDULER_COUNTERS: tuple[tuple[str, str, Optional[str], dict[Optional[str], tuple[str, str]]], ...] = (
    (
        "radixrt_cache_queried_tokens",
        "Prompt tokens looked up in the radix cache (each request's prompt once, "
        "at its first admission) since the server started",
        None,
        {None: ("cache", "queried_tokens")},
    ),
    (
        "radixrt_cache_hit_tokens",
        "Of the queried prompt tokens, those found in the radix cache since the server "
        "started, by tier (device: already there; host: loaded back from the host tier; storage: read "
        "from the storage tier, then loaded back)",
        "tier",
        {
            "device": ("cache", "device_hit_tokens"),
            "host": ("cache", "host_hit_tokens"),
            "storage": ("cache", "storage_hit_tokens"),
        },
    ),
    (
        "radixrt_retractions",
        "Running requests retracted (KV pressure, or preempted by priority) since the server started",
        None,
        {None: ("", "retractions")},
    ),
    (
        "radixrt_spec_verify_steps",
        "Decode steps of speculating requests (each verifies a draft, possibly empty) since the server started",
        None,
        {None: ("", "spec_verify_steps")},
    ),
    (
        "radixrt_spec_verify_tokens",
        "Tokens those steps produced (accepted draft tokens plus the model's own); "
        "rate() of it over rate() of radixrt_spec_verify_steps_total is the acceptance length",
        None,
        {None: ("", "spec_verify_tokens")},
    ),
    (
        "radixrt_spec_draft_tokens",
        "Draft tokens verified, by outcome (accepted: kept in the output)",
        "outcome",
        {"drafted": ("", "spec_drafted_tokens"), "accepted": ("", "spec_accepted_tokens")},
    ),
    (
        "radixrt_kv_budget_tokens",
        "KV positions that requests under a KV budget stopped or started attending since the server started, "
        "per layer and KV head averaged (evicted: dropped for good; offloaded: kept on the host, infinigen; "
        "reloaded: brought back from the host)",
        "event",
        {
            "evicted": ("", "kv_budget_evicted_tokens"),
            "offloaded": ("", "kv_budget_offloaded_tokens"),
            "reloaded": ("", "kv_budget_reloaded_tokens"),
        },
    ),
    (
        "radixrt_swapped_out_tokens",
        "KV tokens of retracted requests moved to the host tier since the server started",
        None,
        {None: ("host_kv", "swapped_out_tokens")},
    ),
    (
        "radixrt_storage_blocks",
        "KV blocks of the storage tier since the server started, by event (written; hit: read back; "
        "missed; corrupt: refused by the checksum and recomputed; evicted: by the quota)",
        "event",
        {
            "written": ("storage_kv", "written_blocks"),
            "hit": ("storage_kv", "hit_blocks"),
            "missed": ("storage_kv", "missed_blocks"),
            "corrupt": ("storage_kv", "corrupt_blocks"),
            "evicted": ("storage_kv", "evicted_blocks"),
        },
    ),
    (
        "radixrt_storage_restored_tokens",
        "Tokens the storage tier read back at start (--hicache-storage-restore-tokens), by where they went "
        "(host: cached in the host tier; device: of them, also loaded onto the device)",
        "tier",
        {"host": ("storage_kv", "restored_tokens"), "device": ("storage_kv", "restored_device_tokens")},
    ),
)


class _SchedulerCounters(Collector):
    """The scheduler's own running totals, as Prometheus counters: the
    scheduler counts (from its start, never reset), this process mirrors the
    latest stats it has seen."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.values: dict[tuple[str, Optional[str]], float] = {}

    def update(self, stats: dict) -> None:
        for name, _help, _label, keys in _SCHEDULER_COUNTERS:
            for label, (section, key) in keys.items():
                src = (stats.get(section) or {}) if section else stats
                if key in src:
                    self.values[(name, label)] = float(src[key])

    def collect(self) -> Iterator[Metric]:
        for name, help_text, label_name, keys in _SCHEDULER_COUNTERS:
            labels = ["model_name"] + ([label_name] if label_name else [])
            family = CounterMetricFamily(name, help_text, labels=labels)
            for label in keys:
                value = self.values.get((name, label))
                if value is not None:
                    family.add_metric([self.model_name] + ([label] if label else []), value)
            yield family


class ServerMetrics:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        lbl = ["model_name"]
        self.model_name = model_name
        self.requests = Counter(
            "radixrt_requests", "Generation requests finished, by finish reason", lbl + ["finish_reason"], registry=r
        )
        self.http_requests = Counter(
            "radixrt_http_requests",
            "HTTP requests answered, by route and status",
            lbl + ["route", "status"],
            registry=r,
        )
        self.prompt_tokens = Counter("radixrt_prompt_tokens", "Prompt tokens of finished requests", lbl, registry=r)
        self.generation_tokens = Counter(
            "radixrt_generation_tokens", "Generated tokens of finished requests", lbl, registry=r
        )
        self.cached_tokens = Counter(
            "radixrt_cached_tokens",
            "Prompt tokens of finished requests served from the radix cache (their first admission's match)",
            lbl,
            registry=r,
        )
        self.cache_hit_rate = Gauge(
            "radixrt_cache_hit_rate",
            "Radix cache hit rate in tokens since the server started: "
            "radixrt_cache_hit_tokens_total / radixrt_cache_queried_tokens_total "
            "(/flush_cache does not reset it; rate() those counters for a window)",
            lbl,
            registry=r,
        )
        self.spec_accept_length = Gauge(
            "radixrt_spec_accept_length",
            "Speculative decoding: tokens per decode step of speculating requests since the server started",
            lbl,
            registry=r,
        )
        self.running = Gauge(
            "radixrt_num_running_reqs", "Requests running in the scheduler, at the last scrape", lbl, registry=r
        )
        self.queued = Gauge(
            "radixrt_num_queued_reqs", "Requests waiting in the scheduler, at the last scrape", lbl, registry=r
        )
        self.gen_throughput = Gauge(
            "radixrt_gen_throughput",
            "Generated tokens per second over the scheduler's last --log-interval steps, at the last scrape",
            lbl,
            registry=r,
        )
        self.inflight = Gauge("radixrt_num_inflight_reqs", "Requests the HTTP server awaits now", lbl, registry=r)
        self.kv_slots = Gauge(
            "radixrt_kv_slots",
            "KV slots by owner (free, tree, private, total), at the last scrape",
            lbl + ["state"],
            registry=r,
        )
        self.kv_usage = Gauge("radixrt_kv_usage", "Share of KV slots not free, at the last scrape", lbl, registry=r)
        self._init_kv_gauges(r, lbl)
        self.scheduler_counters = _SchedulerCounters(model_name)
        r.register(self.scheduler_counters)
        self._init_latency_histograms(r, lbl)
        r.register(SGLangNames(self))  # the same figures under SGLang's names (sglang_metrics.py)
        # every series exists at 0 from the start (a labelled one appears on first use otherwise, and
        # Prometheus' increase() misses that first step)
        for metric in (self.prompt_tokens, self.generation_tokens, self.cached_tokens, self.inflight):
            self._m(metric)
        for histogram in (self.ttft, self.itl, self.e2e):
            self._m(histogram)
        for reason in ("stop", "length", "abort"):
            self._m(self.requests, finish_reason=reason)

    def _init_kv_gauges(self, r: CollectorRegistry, lbl: list[str]) -> None:
        kv_lbl = lbl + ["kv_cache_dtype"]
        self.kv_bytes_per_token = Gauge(
            "radixrt_kv_cache_bytes_per_token",
            "KV cache bytes per token, all layers, K and V, scales included",
            kv_lbl,
            registry=r,
        )
        self.kv_scale_bytes_per_token = Gauge(
            "radixrt_kv_cache_scale_bytes_per_token",
            "Of which quantization scales (int8: per token and KV head)",
            kv_lbl,
            registry=r,
        )
        self.kv_tokens_per_gib = Gauge(
            "radixrt_kv_cache_tokens_per_gib", "KV cache tokens one GiB holds", kv_lbl, registry=r
        )
        self.kv_capacity = Gauge("radixrt_kv_cache_capacity_tokens", "Tokens the KV pool holds", kv_lbl, registry=r)
        self.kv_bytes = Gauge("radixrt_kv_cache_bytes", "Bytes of the KV pool (data and scales)", kv_lbl, registry=r)
        self.host_kv_slots = Gauge(
            "radixrt_host_kv_slots",
            "Host KV tier slots by owner (free, tree, total), at the last scrape",
            lbl + ["state"],
            registry=r,
        )

    def _init_latency_histograms(self, r: CollectorRegistry, lbl: list[str]) -> None:
        self.ttft = Histogram(
            "radixrt_time_to_first_token_seconds", "Time to first token", lbl, buckets=_LATENCY_BUCKETS, registry=r
        )
        self.itl = Histogram(
            "radixrt_inter_token_latency_seconds",
            "Time between output tokens",
            lbl,
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "radixrt_e2e_request_latency_seconds",
            "Request latency, arrival to finish",
            lbl,
            buckets=_E2E_BUCKETS,
            registry=r,
        )
        self.prompt_tokens_histogram = Histogram(
            "radixrt_request_prompt_tokens",
            "Prompt tokens of each finished request",
            lbl,
            buckets=_TOKEN_BUCKETS,
            registry=r,
        )
        self.generation_tokens_histogram = Histogram(
            "radixrt_request_generation_tokens",
            "Generated tokens of each finished request",
            lbl,
            buckets=_TOKEN_BUCKETS,
            registry=r,
        )

    def _m(self, metric: Any, **labels: str) -> Any:
        return metric.labels(model_name=self.model_name, **labels)

    # -- events from the tokenizer manager --------------------------------------
    def observe_ttft(self, seconds: float) -> None:
        self._m(self.ttft).observe(seconds)

    def observe_itl(self, seconds: float, count: int) -> None:
        h = self._m(self.itl)
        for _ in range(count):
            h.observe(seconds)

    def observe_finish(
        self, finish_type: str, prompt_tokens: int, completion_tokens: int, cached_tokens: int, latency: Optional[float]
    ) -> None:
        self._m(self.requests, finish_reason=finish_type).inc()
        self._m(self.prompt_tokens).inc(prompt_tokens)
        self._m(self.generation_tokens).inc(completion_tokens)
        self._m(self.cached_tokens).inc(cached_tokens)
        self._m(self.prompt_tokens_histogram).observe(prompt_tokens)
        self._m(self.generation_tokens_histogram).observe(completion_tokens)
        if latency is not None:
            self._m(self.e2e).observe(latency)

    def observe_http(self, route: str, status: int) -> None:
        self._m(self.http_requests, route=route, status=str(status)).inc()

    def set_inflight(self, n: int) -> None:
        self._m(self.inflight).set(n)

    # -- scheduler stats --------------------------------------------------------
    def update_from_stats(self, stats: dict) -> None:
        self._m(self.running).set(stats.get("running", 0))
        self._m(self.queued).set(stats.get("waiting", 0))
        self.scheduler_counters.update(stats)
        if "last_gen_throughput" in stats:
            self._m(self.gen_throughput).set(stats["last_gen_throughput"])
        if "avg_spec_accept_length" in stats:
            self._m(self.spec_accept_length).set(stats["avg_spec_accept_length"])
        cache = stats.get("cache") or {}
        if "hit_rate" in cache:
            self._m(self.cache_hit_rate).set(cache["hit_rate"])
        host = stats.get("host_kv") or {}
        for state in ("free", "tree", "total"):
            if f"{state}_slots" in host:
                self._m(self.host_kv_slots, state=state).set(host[f"{state}_slots"])
        kv = stats.get("kv") or {}
        for state in ("free", "tree", "private", "total"):
            key = f"{state}_slots"
            if key in kv:
                self._m(self.kv_slots, state=state).set(kv[key])
        total = kv.get("total_slots")
        if total:
            self._m(self.kv_usage).set(1.0 - kv.get("free_slots", total) / total)

    def set_kv_cache(self, info: Optional[dict]) -> None:
        """The KV pool's format and size: `KVFootprint.describe` of the scheduler's pool
        (radixrt/memory/kv_format.py, the arithmetic `radixrt plan` uses too)."""
        if not info:
            return
        dt = str(info.get("kv_cache_dtype", "?"))
        for gauge, key in (
            (self.kv_bytes_per_token, "bytes_per_token"),
            (self.kv_scale_bytes_per_token, "scale_bytes_per_token"),
            (self.kv_tokens_per_gib, "tokens_per_gib"),
            (self.kv_capacity, "total_tokens"),
            (self.kv_bytes, "total_bytes"),
        ):
            if key in info:
                self._m(gauge, kv_cache_dtype=dt).set(info[key])

    def render(self) -> bytes:
        return generate_latest(self.registry)
