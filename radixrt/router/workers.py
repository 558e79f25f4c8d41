"""The router's workers: their health, their load, and the routing policy
that picks among the healthy ones.

Health: every ``health_check_interval_s`` each worker's ``/health`` is asked
(``health_check_timeout_s``). After ``health_failure_threshold`` failures in
a row a worker is removed from routing (its share of the policy's state is
dropped); after ``health_success_threshold`` successes in a row it is added
back. A request that cannot reach its worker (connect error) removes it at
once; the health loop adds it back when it answers again.

Load: the requests the router has in flight on a worker (from sending the
request to the end of its answer or stream).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Optional

import httpx

from radixrt.router.kv_event_index import TokenKey
from radixrt.router.policies import Policy, RouteKey

logger = logging.getLogger("radixrt.router")


@dataclass
class HealthConfig:
    health_check_interval_s: float = 5.0
    health_check_timeout_s: float = 5.0
    health_failure_threshold: int = 2
    health_success_threshold: int = 1

    def __post_init__(self) -> None:
        if self.health_check_interval_s <= 0 or self.health_check_timeout_s <= 0:
            raise ValueError("health check interval and timeout must be > 0")
        if self.health_failure_threshold < 1 or self.health_success_threshold < 1:
            raise ValueError("health check thresholds must be >= 1")


@dataclass
class Worker:
    url: str
    healthy: bool = False
    load: int = 0
    failures: int = 0  # consecutive failed health checks
    successes: int = 0  # consecutive passed health checks
    last_error: Optional[str] = None
    routed: int = 0  # requests sent, all time
    since: float = field(default_factory=time.time)  # when `healthy` last changed
    was_healthy: bool = False  # ever healthy (so a change to healthy is a recovery)

    def public(self) -> dict:
        return {
            "url": self.url,
            "healthy": self.healthy,
            "load": self.load,
            "routed": self.routed,
            "last_error": self.last_error,
        }


def normalize_url(url: str) -> str:
    url = url.strip().rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"a worker url must start with http:// or https://, got {url!r}")
    return url


class NoWorkerError(Exception):
    """No healthy worker is left to take the request."""


class WorkerPool:
    """The workers, their state, and the policy; all calls on one event loop."""

    def __init__(self, urls: list[str], policy: Policy, health: Optional[HealthConfig] = None) -> None:
        self.policy = policy
        self.health = health or HealthConfig()
        self.workers: dict[str, Worker] = {}
        for u in urls:
            self.add(u)
        if not self.workers:
            raise ValueError("give at least one worker url (--worker-url)")
        self._task: Optional[asyncio.Task] = None
        self._evict_task: Optional[asyncio.Task] = None
        self._client: Optional[httpx.AsyncClient] = None
        self._probes: set[asyncio.Future] = set()

    # ------------------------------------------------------------------ membership
    def add(self, url: str) -> Worker:
        url = normalize_url(url)
        if url not in self.workers:
            self.workers[url] = Worker(url)
        return self.workers[url]

    def remove(self, url: str) -> bool:
        url = normalize_url(url)
        w = self.workers.pop(url, None)
        if w is None:
            return False
        self.policy.remove_worker(url)
        return True

    def healthy_urls(self) -> list[str]:
        return [u for u, w in self.workers.items() if w.healthy]

    def set_healthy(self, url: str, healthy: bool, reason: Optional[str] = None) -> None:
        w = self.workers.get(url)
        if w is None or w.healthy == healthy:
            if w is not None and reason:
                w.last_error = reason
            return
        w.healthy = healthy
        w.since = time.time()
        if healthy:
            w.last_error = None
            # the first time is startup; later it is a worker coming back, worth a warning
            logger.log(logging.WARNING if w.was_healthy else logging.INFO, "worker %s is healthy: routing to it", url)
            w.was_healthy = True
        else:
            w.last_error = reason
            self.policy.remove_worker(url)
            logger.warning("worker %s removed from routing: %s", url, reason)

    # ------------------------------------------------------------------ routing
    def pick(self, key: Optional[RouteKey], exclude: tuple[str, ...] = (), tokens: Optional[TokenKey] = None) -> Worker:
        urls = [u for u in self.healthy_urls() if u not in exclude]
        if not urls:
            raise NoWorkerError("no healthy worker is available" + (" (the others failed)" if exclude else ""))
        url = self.policy.select(urls, {u: self.workers[u].load for u in urls}, key, tokens)
        w = self.workers[url]
        w.routed += 1
        return w

    # ------------------------------------------------------------------ health loop
    async def check_once(self) -> None:
        assert self._client is not None
        await asyncio.gather(*(self._check(w) for w in list(self.workers.values())))

    async def _check(self, w: Worker) -> None:
        assert self._client is not None
        try:
            r = await self._client.get(w.url + "/health", timeout=self.health.health_check_timeout_s)
            ok, reason = r.status_code == 200, f"/health answered {r.status_code}"
        except httpx.HTTPError as e:
            ok, reason = False, f"/health failed: {type(e).__name__}: {e}"
        if ok:
            w.failures, w.successes = 0, w.successes + 1
            if not w.healthy and (w.successes >= self.health.health_success_threshold or w.routed == 0):
                self.set_healthy(w.url, True)
        else:
            w.successes, w.failures = 0, w.failures + 1
            w.last_error = reason
            if w.healthy and w.failures >= self.health.health_failure_threshold:
                self.set_healthy(w.url, False, reason)

    def probe(self, url: str) -> None:
        """Check one worker now (a request to it failed in a way that may or may
        not mean it is gone); it leaves routing at once if /health fails."""

        async def run() -> None:
            assert self._client is not None
            try:
                r = await self._client.get(url + "/health", timeout=self.health.health_check_timeout_s)
                if r.status_code == 200:
                    return
                reason = f"/health answered {r.status_code} after a failed request"
            except httpx.HTTPError as e:
                reason = f"/health failed after a failed request: {type(e).__name__}: {e}"
            self.set_healthy(url, False, reason)

        if self._client is not None:
            task = asyncio.ensure_future(run())
            self._probes.add(task)
            task.add_done_callback(self._probes.discard)

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.health.health_check_interval_s)
            try:
                await self.check_once()
            except Exception:  # the loop must outlive any one round
                logger.exception("health check round failed")

    async def _evict_loop(self, interval: float) -> None:
        while True:
            await asyncio.sleep(interval)
            self.policy.evict()

    async def start(self, eviction_interval_s: Optional[float] = None, headers: Optional[dict] = None) -> None:
        """Start the health checks (their requests carry ``headers``) and the eviction loop."""
        self._client = httpx.AsyncClient(headers=headers)
        await self.check_once()
        for w in self.workers.values():
            if not w.healthy:
                logger.warning("worker %s is not healthy yet (%s)", w.url, w.last_error)
        self._task = asyncio.create_task(self._health_loop())
        if eviction_interval_s:
            self._evict_task = asyncio.create_task(self._evict_loop(eviction_interval_s))

    async def stop(self) -> None:
        for t in (self._task, self._evict_task):
            if t is not None:
                t.cancel()
        if self._client is not None:
            await self._client.aclose()

    def public(self) -> list[dict[str, Any]]:
        return [w.public() for w in self.workers.values()]

    def health_problem(self, require_all: bool) -> Optional[str]:
        """Why the pool cannot serve (no healthy worker; with ``require_all``, any
        unhealthy one, as a ``--dp`` front's replicas), or None."""
        workers = self.public()
        healthy = [w for w in workers if w["healthy"]]
        if not healthy:
            return "no healthy worker"
        if require_all and len(healthy) < len(workers):
            return "unhealthy replicas: " + ", ".join(
                f"{w['url']} ({w['last_error']})" for w in workers if not w["healthy"]
            )
        return None
