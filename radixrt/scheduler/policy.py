"""Orders the waiting queue. The cache-aware policies read the radix tree's
matches; none of them changes what is computed, only when.

Priority scheduling (``enable_priority_scheduling``) is a stable sort on
top of the policy's order: requests of a more urgent priority come first,
and within one priority the policy's order stands. As in SGLang, a higher
``priority`` value is more urgent unless ``schedule_low_priority_values_first``.

Aging (``priority_aging_s``): a request gains one unit of urgency for every
tick of a clock that ticks every ``priority_aging_s`` seconds, from its
arrival on (waiting or running), so a request waiting behind a flood of more
urgent ones is admitted ahead of any that arrive more than about
``gap * priority_aging_s`` seconds after it, ``gap`` being the priorities'
difference: nothing waits forever. As every request ages at the same rate, the order of two requests
never changes with time: `urgency` is a fixed integer computed once at
arrival, and sorting by it costs nothing per step beyond the sort itself.
Whole ticks (not seconds) keep equal-priority requests that arrived within
one tick equal, so the policy's order still decides among them."""

from __future__ import annotations

import math
import random
import time
from collections import Counter, defaultdict
from typing import TYPE_CHECKING, Any, Callable, Optional

from radixrt.memory.radix_node import MatchResult, TreeNode
from radixrt.requests.intake import ADMIN_PRIORITY_RANGE
from radixrt.scheduler.request import Req

if TYPE_CHECKING:
    from radixrt.config.sections import SchedulingSettings

MatchFn = Callable[[Req], MatchResult]

# Past this many waiting requests, matching each one every step costs more than
# it saves: fall back to arrival order (as SGLang does).
LPM_MAX_QUEUE = 256


# A cache-aware order admits what shares the tree first, so a request that shares nothing could wait
# behind a stream of requests that do for as long as they keep coming. Past this wait it goes first
# (the oldest first): no request's wait is unbounded (under overload the order becomes arrival order).
MAX_CACHE_AWARE_WAIT_S = 5.0


def order_waiting(policy: str, waiting: list[Req], match: MatchFn, now: Optional[float] = None) -> list[Req]:
    """``waiting`` in admission order under ``policy``; for the cache-aware ones, the requests
    queued more than MAX_CACHE_AWARE_WAIT_S before ``now`` (default: the monotonic clock) first."""
    if policy == "fcfs" or len(waiting) > LPM_MAX_QUEUE:
        return sorted(waiting, key=lambda r: r.arrival)
    if policy == "lof":  # SGLang's: the longest output asked for first
        return sorted(waiting, key=lambda r: (-r.sampling.max_new_tokens, r.arrival))
    if policy == "random":  # SGLang's; it changes when requests run, never what they compute
        return random.sample(waiting, len(waiting))
    matches = {id(r): match(r) for r in waiting}
    if policy == "lpm":
        ordered = sorted(waiting, key=lambda r: (-matches[id(r)].length, r.arrival))
    elif policy == "dfs-weight":
        ordered = _dfs_weight(waiting, matches)
    else:
        raise ValueError(f"unknown schedule policy {policy!r}")
    deadline = (time.monotonic() if now is None else now) - MAX_CACHE_AWARE_WAIT_S
    overdue = [r for r in ordered if r.queued_at < deadline]
    if not overdue:
        return ordered
    overdue.sort(key=lambda r: r.arrival)
    return overdue + [r for r in ordered if r.queued_at >= deadline]


def urgency(
    priority: int,
    arrived_s: float,
    *,
    low_values_first: bool = False,
    aging_s: float = 0.0,
    max_priority: Optional[int] = None,
) -> int:
    """A request's fixed sort key under priority scheduling (higher: more
    urgent): its priority, negated under ``low_values_first``, minus the
    aging clock's tick count at its arrival (``arrived_s``, seconds on any
    clock common to all requests; no aging when ``aging_s`` is 0). At time
    ``t`` the request's effective priority is ``urgency + floor(t / aging_s)``;
    comparing two requests, that common term drops out. ``max_priority``
    clamps the priority into ``[-max_priority, max_priority]`` (the front
    door refuses more than a 64-bit integer; this keeps the arithmetic bounded
    for any caller)."""
    if max_priority is not None:
        priority = max(-max_priority, min(priority, max_priority))
    ticks = math.floor(arrived_s / aging_s) if aging_s > 0 else 0
    return (-priority if low_values_first else priority) - ticks


def arrival_urgency(priority: Optional[int], settings: "SchedulingSettings") -> int:
    """`urgency` of a request arriving now with ``priority`` (None: 0), under the server's
    scheduling settings, clamped to the front door's widest bound (an admin's)."""
    return urgency(
        priority or 0,
        time.monotonic(),
        low_values_first=settings.schedule_low_priority_values_first,
        aging_s=settings.priority_aging_s,
        max_priority=ADMIN_PRIORITY_RANGE[1],
    )


def interleave_calls(ordered: list[Req]) -> list[Req]:
    """``ordered`` with the requests of each client call (a batch's prompts, a prompt's
    samples: one ``group``) taking turns: every call's first waiting request in
    ``ordered``'s order, then every call's second, and so on. A call of many prompts
    then holds up a call behind it for one step's admission, not for all its prompts;
    the policy's order still holds within a call, and among calls of one request each."""
    seen: dict[str, int] = defaultdict(int)
    turns = []
    for r in ordered:
        turns.append(seen[r.group])
        seen[r.group] += 1
    if len(seen) in (1, len(ordered)):  # one call, or one request per call: nothing to interleave
        return ordered
    order = sorted(range(len(ordered)), key=lambda i: (turns[i], i))
    return [ordered[i] for i in order]


def fair_share_retractions(running: list[Req], waiting: list[Req], max_running: int) -> list[Req]:
    """With the batch full (``max_running``), the running requests to retract so that each
    waiting call with nothing running gets a place: each time the latest-admitted request
    of the call holding the most places, while that call holds more than its share (the
    places over the calls running and those newcomers, at least one: so it keeps one, and no
    two calls take places from each other in turn, since a call with a request running is no
    newcomer); never a beam (a search is retracted as a unit). A call of 4,000 prompts, or
    two calls of n=64 on 128 places, then hold a newcomer's request for a step, not until a
    wave of their own requests has finished."""
    if len(running) < max_running or not waiting:
        return []
    held = Counter(r.group for r in running)
    newcomers = {r.group for r in waiting if r.group not in held and not (r.grammar_compiling or r.inflight_tokens)}
    share = max(1, max_running // (len(held) + len(newcomers) or 1))
    victims: list[Req] = []
    taken: set[int] = set()
    for _ in newcomers:
        group, count = held.most_common(1)[0]
        if count <= share:
            break
        candidates = [r for r in running if r.group == group and r.beam is None and id(r) not in taken]
        if not candidates:
            break
        victim = max(candidates, key=lambda r: r.arrival)
        victims.append(victim)
        taken.add(id(victim))
        held[group] -= 1
    return victims


def priority_retractions(running: list[Req], waiting: list[Req], max_running: int, threshold: int) -> list[Req]:
    """With the batch full (``max_running``), the running requests to retract, least urgent
    first, one for each admissible waiting request more urgent by at least ``threshold``
    (SGLang's rule; a beam search goes as a unit, its other beams with it). Urgency includes
    aging (`urgency`): a running request ages as a waiting one does, so a later arrival must
    outrank it by the threshold plus the ticks between their arrivals. Keys are fixed, so a
    retracted request can never preempt its preemptor back."""
    if len(running) < max_running:
        return []
    left = list(running)
    victims: list[Req] = []
    for u in sorted((r.urgency for r in waiting if not (r.grammar_compiling or r.inflight_tokens)), reverse=True):
        if not left:
            break
        victim = min(left, key=lambda r: (r.urgency, -r.arrival))  # least urgent, latest
        if u - victim.urgency < threshold:
            break
        victims.append(victim)
        gone = {id(b) for b in victim.beam.beams} if victim.beam is not None else {id(victim)}
        left = [r for r in left if id(r) not in gone]
    return victims


def by_priority(ordered: list[Req]) -> list[Req]:
    """``ordered`` with the most urgent (highest `urgency`) first; a stable
    sort, so the policy's order holds among requests of equal urgency."""
    return sorted(ordered, key=lambda r: -r.urgency)


def _dfs_weight(waiting: list[Req], matches: dict[int, MatchResult]) -> list[Req]:
    """Visit the tree depth-first, heavier subtrees (more waiting requests) first,
    so requests sharing a prefix run together while it is cached."""
    at_node: dict[Any, list[Req]] = defaultdict(list)
    weight: dict[Any, int] = defaultdict(int)
    children: dict[Any, set] = defaultdict(set)
    roots: list[Any] = []
    for r in waiting:
        node: Optional[TreeNode] = matches[id(r)].node
        at_node[node].append(r)
        while node is not None:
            weight[node] += 1
            parent = node.parent
            if parent is None:
                if node not in roots:
                    roots.append(node)
            else:
                children[parent].add(node)
            node = parent
    ordered: list[Req] = []
    stack = sorted(roots, key=lambda n: (weight[n], -n.id))
    while stack:
        node = stack.pop()
        ordered.extend(sorted(at_node.get(node, []), key=lambda r: r.arrival))
        stack.extend(sorted(children.get(node, ()), key=lambda n: (weight[n], -n.id)))
    return ordered
