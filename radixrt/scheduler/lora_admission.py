"""Requests with a LoRA adapter, from arrival to the waiting queue.

`LoRAAdmission.start` resolves a request's adapter name (a 400 for an
unknown one) and, once it has the loaded adapter (at once, or when a held
request's load ends), sets what its KV is keyed by, from the weights it got:

- a plain adapter's requests live in a namespace of their own,
  ``{"lora": <digest of the adapter's weights>, "ns": <the request's
  namespace>}`` (a JSON object: it never equals a plain namespace, which is
  None or a JSON array, cache_fields.cache_namespace), so a name reloaded with new
  weights never reuses the old KV and two names for the same weights share;
- an activated adapter (aLoRA) applies from its invocation tokens on: the KV
  before that point is the base model's, so the request stays in its own
  namespace, matches and inserts only that part (``tree_limit``), and shares
  it with plain requests.

A request whose adapter is loaded goes on at once; otherwise it is held while
the pool's loader thread reads the adapter, and `ready` hands it back (or
ends it with the load's error) without holding up anything else.

Loads and unloads at run time (``/load_lora_adapter``, ``/unload_lora_adapter``)
read on the loader thread as well: `control` starts one, and `control_replies`
applies those whose reads have ended to the pool and answers them, in the order
they came (the callers match replies to calls by order).
"""

from __future__ import annotations

import json
import logging
from collections import deque
from concurrent.futures import Future, wait
from dataclasses import dataclass
from typing import Callable, Iterable, Optional

from radixrt.executor.lora.adapter import NEVER, LoRAAdapter
from radixrt.executor.lora.pool import LoRAPool, Registered
from radixrt.requests.messages import ControlReply, LoRAControlReq
from radixrt.scheduler.request import Req


def lora_namespace(namespace: Optional[str], digest: str) -> str:
    return json.dumps({"lora": digest, "ns": namespace})


logger = logging.getLogger(__name__)


@dataclass(eq=False)
class _Held:
    req: Req
    name: str
    future: "Future[LoRAAdapter]"


@dataclass(eq=False)
class _Control:
    """A load (``read`` under way on the loader thread) or an unload (``read`` None)."""

    msg: LoRAControlReq
    read: "Optional[Future[tuple[Registered, LoRAAdapter]]]"


class LoRAAdmission:
    def __init__(self, pool: LoRAPool) -> None:
        self.pool = pool
        self.held: list[_Held] = []
        self.controls: deque[_Control] = deque()

    def check(self, name: str) -> None:
        """ValueError (a 400) for a name the pool does not know."""
        if name not in self.pool.registered:
            known = sorted(self.pool.registered) or "none"
            raise ValueError(f"unknown LoRA adapter {name!r} (loaded: {known}); load it with /load_lora_adapter")

    def start(self, req: Req, name: str) -> bool:
        """Key ``req``'s KV by its adapter; True when it goes on now, False when
        it is held until its adapter is loaded."""
        req.lora_name = name
        adapter = self.pool.get(name)
        if adapter is not None:
            _bind(req, adapter)
            return True
        self.held.append(_Held(req, name, self.pool.load(name)))  # keyed once it has its adapter (`_bind`)
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
            except Exception as e:  # noqa: BLE001 - a client-named folder: safetensors raises a bare Exception
                # the pool's and loader's checks (ValueErrors) name the adapter; safetensors' and the OS's do not
                out.append((h.req, str(e) if isinstance(e, ValueError) else f"LoRA adapter {h.name!r}: {e}"))
                continue
            _bind(h.req, adapter)
            out.append((h.req, None))
        return out

    def control(self, msg: LoRAControlReq) -> None:
        """Start a load (``msg.path``) or an unload; `control_replies` answers it."""
        read = None if msg.path is None else self.pool.read(msg.name, msg.path)
        self.controls.append(_Control(msg, read))

    def control_replies(self, in_use: Callable[[], Iterable[str]]) -> list[ControlReply]:
        """Apply the controls whose reads have ended, in arrival order, and their replies."""
        out: list[ControlReply] = []
        while self.controls and (self.controls[0].read is None or self.controls[0].read.done()):
            c = self.controls.popleft()
            # the read's error is taken, not raised here: a traceback through this frame would keep
            # the control (and what the error holds) alive until a full garbage collection
            error = None if c.read is None else c.read.exception()
            if error is None:
                try:
                    if c.read is None:
                        self.pool.unregister(c.msg.name)
                    else:
                        self.pool.install(*c.read.result(), set(in_use()))
                except ValueError as e:
                    error = e
            if error is not None:
                logger.info("LoRA adapter %r refused: %s", c.msg.name, error)
                out.append(ControlReply("lora", ok=False, payload={"error": str(error) or type(error).__name__}))
            else:
                out.append(ControlReply("lora", payload={"adapters": self.pool.describe()}))
        return out

    @property
    def busy(self) -> bool:
        return bool(self.held or self.controls)

    def wait(self, timeout_s: float) -> None:
        futures: list[Future] = [h.future for h in self.held]
        futures += [c.read for c in self.controls if c.read is not None]
        if futures:
            wait(futures, timeout=timeout_s, return_when="FIRST_COMPLETED")

    def drop(self, hit: Callable[[Req], bool]) -> list[Req]:
        out = [h.req for h in self.held if hit(h.req)]
        self.held = [h for h in self.held if not hit(h.req)]
        return out


def _bind(req: Req, adapter: LoRAAdapter) -> None:
    """Give ``req`` its adapter and key its KV by it (module docstring): from where
    it applies, and (aLoRA) up to where its KV is the base model's and may enter
    the tree. An aLoRA request whose prompt lacks the invocation tokens runs as
    the base model, as in PEFT."""
    if adapter.invocation_tokens is None:
        req.namespace = lora_namespace(req.namespace, adapter.digest)
    start = adapter.activation_start(req.input_ids)
    if start == NEVER:
        return
    req.lora, req.lora_start = adapter, start
    if adapter.invocation_tokens is not None:
        req.tree_limit = start if req.tree_limit is None else min(req.tree_limit, start)
