"""SGLang's metric names on radixrt's figures: SGLang's dashboards and tools
(``sglang/benchmark/one_batch_server.py`` reads ``sglang:cached_tokens_total``)
scrape ``sglang:*`` names, so `/metrics` serves each figure radixrt has under
both names. Nothing is counted twice: `SGLangNames` re-reads radixrt's own
metrics when scraped and renames them (docs/metrics.md has the table, and how
the semantics differ where they do).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.core import Metric
from prometheus_client.registry import Collector


@dataclass(frozen=True)
class Alias:
    """``sglang`` (a family name, without ``_total``) for radixrt's metric ``attr`` of
    `ServerMetrics`; ``drop``: labels summed over; ``add``: labels added with a fixed value."""

    sglang: str
    attr: str
    drop: tuple[str, ...] = ()
    add: dict[str, str] = field(default_factory=dict)


ALIASES: tuple[Alias, ...] = (
    Alias("sglang:prompt_tokens", "prompt_tokens"),
    Alias("sglang:generation_tokens", "generation_tokens"),
    # SGLang's label when a request's cached tokens are not split by tier
    Alias("sglang:cached_tokens", "cached_tokens", add={"cache_source": "total"}),
    Alias("sglang:num_requests", "requests", drop=("finish_reason",)),
    Alias("sglang:num_running_reqs", "running"),
    Alias("sglang:num_queue_reqs", "queued"),
    Alias("sglang:token_usage", "kv_usage"),
    Alias("sglang:cache_hit_rate", "cache_hit_rate"),
    Alias("sglang:gen_throughput", "gen_throughput"),
    Alias("sglang:time_to_first_token_seconds", "ttft"),
    Alias("sglang:inter_token_latency_seconds", "itl"),
    Alias("sglang:e2e_request_latency_seconds", "e2e"),
    # SGLang collects these under --collect-tokens-histogram; radixrt always does
    Alias("sglang:prompt_tokens_histogram", "prompt_tokens_histogram"),
    Alias("sglang:generation_tokens_histogram", "generation_tokens_histogram"),
)


def _renamed(family: Metric, alias: Alias) -> Metric:
    """``family`` under ``alias``'s name and labels (samples that only differ in a
    dropped label summed; the sums of ``_created`` samples are meaningless, so dropped)."""
    out = Metric(alias.sglang, family.documentation, family.type)
    sums: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for sample in family.samples:
        suffix = sample.name[len(family.name) :]
        if alias.drop and suffix == "_created":
            continue
        labels = {k: v for k, v in sample.labels.items() if k not in alias.drop}
        labels.update(alias.add)
        key = (alias.sglang + suffix, tuple(sorted(labels.items())))
        sums[key] = sums.get(key, 0.0) + sample.value
    for (name, labels), value in sums.items():
        out.add_sample(name, dict(labels), value)
    return out


class SGLangNames(Collector):
    """The `ALIASES` of a `ServerMetrics`' metrics, collected from them at each scrape."""

    def __init__(self, metrics: Any) -> None:
        self.metrics = metrics

    def collect(self) -> Iterator[Metric]:
        for alias in ALIASES:
            for family in getattr(self.metrics, alias.attr).collect():
                yield _renamed(family, alias)
