"""Requests with a LoRA adapter, from arrival to the waiting queue.

`LoRAAdmission.start` resolves a request's adapter name (a 400 for an
unknown one) and sets what its KV is keyed by:

- a plain adapter's requests live in a namespace of their own,
  ``{"lora": <digest of the adapter's weights>, "ns": <the request's
  namespace>}`` (a JSON object: it never equals a plain namespace, which is
  None or a JSON array, intake.cache_namespace), so a name reloaded with new
  weights never reuses the old KV and two names for the same weights share;
- an activated adapter (aLoRA) applies from its invocation tokens on: the KV
  before that point is the base model's, so the request stays in its own
  namespace, matches and inserts only that part (``tree_limit``), and shares
  it with plain requests.

A request whose adapter is loaded goes on at once; otherwise it is held while
the pool's loader thread reads the adapter, and `ready` hands it back (or
ends it with the load's error) without holding up anything else.
"""

from __future__ import annotations

import json
from concurrent.futures import Future, wait
from dataclasses import dataclass
from typing import Callable, Iterable, Optional

from radixrt.executor.lora.adapter import NEVER, LoRAAdapter
from radixrt.executor.lora.pool import LoRAPool, LoRARuntime
from radixrt.requests.messages import ControlReply, LoRAControlReq
from radixrt.scheduler.request import Req


def lora_namespace(namespace: Optional[str], digest: str) -> str:
    return json.dumps({"lora": digest, "ns": namespace})


@dataclass(eq=False)
class _Held:
    req: Req
    name: str
    future: "Future[LoRAAdapter]"


class LoRAAdmission:
    def __init__(self, pool: LoRAPool) -> None:
        self.pool = pool
        self.held: list[_Held] = []

    def check(self, name: str) -> None:
        """ValueError (a 400) for a name the pool does not know."""
        if name not in self.pool.registered:
            known = sorted(self.pool.registered) or "none"
            raise ValueError(f"unknown LoRA adapter {name!r} (loaded: {known}); load it with /load_lora_adapter")

    def start(self, req: Req, name: str) -> bool:
        """Key ``req``'s KV by its adapter; True when it goes on now, False when
        it is held until its adapter is loaded."""
        reg = self.pool.registered[name]
        req.lora_name = name
        if reg.invocation_tokens is None:
            req.namespace = lora_namespace(req.namespace, reg.digest)
        adapter = self.pool.get(name)
        if adapter is not None:
            _bind(req, adapter)
            return True
        self.held.append(_Held(req, name, self.pool.load(name)))
        return False

    def ready(self, in_use: Callable[[], Iterable[str]]) -> list[tuple[Req, Optional[str]]]:
        """Held requests whose adapter load ended: ``(req, None)`` to queue, or
        ``(req, error)`` to end with a 400."""
        out: list[tuple[Req, Optional[str]]] = []
        for h in [h for h in self.held if h.future.done()]:
            self.held.remove(h)
            try:
                if h.name in self.pool.loading:
                    self.pool.finish_load(h.name, set(in_use()))
                adapter = self.pool.get(h.name)
                if adapter is None:
                    raise ValueError(f"LoRA adapter {h.name!r} was unloaded")
            except (ValueError, OSError, RuntimeError) as e:
                out.append((h.req, f"LoRA adapter {h.name!r}: {e}"))
                continue
            _bind(h.req, adapter)
            out.append((h.req, None))
        return out

    def wait(self, timeout_s: float) -> None:
        if self.held:
            wait([h.future for h in self.held], timeout=timeout_s, return_when="FIRST_COMPLETED")

    def drop(self, hit: Callable[[Req], bool]) -> list[Req]:
        out = [h.req for h in self.held if hit(h.req)]
        self.held = [h for h in self.held if not hit(h.req)]
        return out


def _bind(req: Req, adapter: LoRAAdapter) -> None:
    """Give ``req`` its adapter: from where it applies, and (aLoRA) up to where
    its KV is the base model's and may enter the tree. An aLoRA request whose
    prompt lacks the invocation tokens runs as the base model, as in PEFT."""
    start = adapter.activation_start(req.input_ids)
    if start == NEVER:
        return
    req.lora, req.lora_start = adapter, start
    if adapter.invocation_tokens is not None:
        req.tree_limit = start


def lora_control(runtime: Optional[LoRARuntime], msg: LoRAControlReq) -> ControlReply:
    """Load or unload an adapter at run time (/load_lora_adapter, /unload_lora_adapter).
    Loading reads the adapter here, on the scheduler's thread: a pause of the
    step loop as long as the read (milliseconds for small adapters)."""
    if runtime is None:
        return ControlReply("lora", ok=False, payload={"error": "this server serves no LoRA adapters (--enable-lora)"})
    pool = runtime.pool
    try:
        if msg.path is None:
            pool.unregister(msg.name)
        else:
            pool.register(msg.name, msg.path)
            pool.load(msg.name).result()
            pool.finish_load(msg.name, set())
    except (ValueError, OSError, RuntimeError) as e:
        return ControlReply("lora", ok=False, payload={"error": str(e)})
    return ControlReply("lora", payload={"adapters": pool.describe()})
