"""Prometheus metrics of one server (its own registry, so several servers or
apps in one process do not collide)."""
from __future__ import annotations

from typing import Any, Optional

from prometheus_client import CONTENT_TYPE_LATEST as CONTENT_TYPE_LATEST  # re-exported for admin_routes
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
                    1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)


class ServerMetrics:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        lbl = ["model_name"]
        self.model_name = model_name
        self.requests = Counter("radixrt_requests", "Generation requests finished, by finish reason",
                                lbl + ["finish_reason"], registry=r)
        self.http_requests = Counter("radixrt_http_requests", "HTTP requests answered, by route and status",
                                     lbl + ["route", "status"], registry=r)
        self.prompt_tokens = Counter("radixrt_prompt_tokens", "Prompt tokens of finished requests",
                                     lbl, registry=r)
        self.generation_tokens = Counter("radixrt_generation_tokens", "Generated tokens", lbl, registry=r)
        self.cached_tokens = Counter("radixrt_cached_tokens", "Prompt tokens served from the radix cache",
                                     lbl, registry=r)
        self.cache_hit_rate = Gauge("radixrt_cache_hit_rate",
                                    "Radix cache hit rate in tokens (hit / queried) since start", lbl, registry=r)
        self.running = Gauge("radixrt_num_running_reqs", "Requests running in the scheduler", lbl, registry=r)
        self.queued = Gauge("radixrt_num_queued_reqs", "Requests waiting in the scheduler", lbl, registry=r)
        self.inflight = Gauge("radixrt_num_inflight_reqs", "Requests the HTTP server awaits", lbl, registry=r)
        self.kv_slots = Gauge("radixrt_kv_slots", "KV slots by owner (free, tree, private, total)",
                              lbl + ["state"], registry=r)
        self.kv_usage = Gauge("radixrt_kv_usage", "Share of KV slots not free", lbl, registry=r)
        kv_lbl = lbl + ["kv_cache_dtype"]
        self.kv_bytes_per_token = Gauge("radixrt_kv_cache_bytes_per_token",
                                        "KV cache bytes per token, all layers, K and V, scales included",
                                        kv_lbl, registry=r)
        self.kv_scale_bytes_per_token = Gauge("radixrt_kv_cache_scale_bytes_per_token",
                                              "Of which quantization scales (int8: per token and KV head)",
                                              kv_lbl, registry=r)
        self.kv_tokens_per_gib = Gauge("radixrt_kv_cache_tokens_per_gib", "KV cache tokens one GiB holds",
                                       kv_lbl, registry=r)
        self.kv_capacity = Gauge("radixrt_kv_cache_capacity_tokens", "Tokens the KV pool holds",
                                 kv_lbl, registry=r)
        self.kv_bytes = Gauge("radixrt_kv_cache_bytes", "Bytes of the KV pool (data and scales)",
                              kv_lbl, registry=r)
        self.cache_hit_tokens = Gauge("radixrt_cache_hit_tokens", "Prompt tokens served from the radix cache "
                                      "since start, by tier (device: already there; host: loaded back)",
                                      lbl + ["tier"], registry=r)
        self.host_kv_slots = Gauge("radixrt_host_kv_slots", "Host KV tier slots by owner (free, tree, total)",
                                   lbl + ["state"], registry=r)
        self.swapped_out_tokens = Gauge("radixrt_swapped_out_tokens",
                                        "KV tokens of retracted requests moved to the host tier since start",
                                        lbl, registry=r)
        self.retractions = Gauge("radixrt_retractions", "Requests retracted under KV pressure since start",
                                 lbl, registry=r)
        self.ttft = Histogram("radixrt_time_to_first_token_seconds", "Time to first token",
                              lbl, buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("radixrt_inter_token_latency_seconds", "Time between output tokens",
                             lbl, buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("radixrt_e2e_request_latency_seconds", "Request latency, arrival to finish",
                             lbl, buckets=_E2E_BUCKETS, registry=r)

    def _m(self, metric: Any, **labels: str) -> Any:
        return metric.labels(model_name=self.model_name, **labels)

    # -- events from the tokenizer manager --------------------------------------
    def observe_ttft(self, seconds: float) -> None:
        self._m(self.ttft).observe(seconds)

    def observe_itl(self, seconds: float, count: int) -> None:
        h = self._m(self.itl)
        for _ in range(count):
            h.observe(seconds)

    def observe_finish(self, finish_type: str, prompt_tokens: int, completion_tokens: int,
                       cached_tokens: int, latency: Optional[float]) -> None:
        self._m(self.requests, finish_reason=finish_type).inc()
        self._m(self.prompt_tokens).inc(prompt_tokens)
        self._m(self.generation_tokens).inc(completion_tokens)
        self._m(self.cached_tokens).inc(cached_tokens)
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
        self._m(self.retractions).set(stats.get("retractions", 0))
        cache = stats.get("cache") or {}
        if "hit_rate" in cache:
            self._m(self.cache_hit_rate).set(cache["hit_rate"])
        for tier in ("device", "host"):
            if f"{tier}_hit_tokens" in cache:
                self._m(self.cache_hit_tokens, tier=tier).set(cache[f"{tier}_hit_tokens"])
        host = stats.get("host_kv") or {}
        for state in ("free", "tree", "total"):
            if f"{state}_slots" in host:
                self._m(self.host_kv_slots, state=state).set(host[f"{state}_slots"])
        if "swapped_out_tokens" in host:
            self._m(self.swapped_out_tokens).set(host["swapped_out_tokens"])
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
        for gauge, key in ((self.kv_bytes_per_token, "bytes_per_token"),
                           (self.kv_scale_bytes_per_token, "scale_bytes_per_token"),
                           (self.kv_tokens_per_gib, "tokens_per_gib"), (self.kv_capacity, "total_tokens"),
                           (self.kv_bytes, "total_bytes")):
            if key in info:
                self._m(gauge, kv_cache_dtype=dt).set(info[key])

    def render(self) -> bytes:
        return generate_latest(self.registry)
