"""What the server's routes share: the tokenizer manager, metrics and the
server's identity and settings (one `ServerContext` per app)."""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Callable, Optional

from starlette.requests import Request

from radixrt.requests.sessions import SessionStore
from radixrt.server.api_keys import presented_key, same_key
from radixrt.server.errors import ServerError
from radixrt.server.metrics import ServerMetrics
from radixrt.server.snapshot_gate import SnapshotGate
from radixrt.server.tokenizer_manager import TokenizerManager


@dataclass
class ServerContext:
    """What the routes need besides the request."""

    tm: TokenizerManager
    metrics: ServerMetrics
    model_path: str  # as given on the command line
    resolved_model_path: str
    served_model_name: str
    other_served_names: list = field(default_factory=list)  # --served-model-name's further names (listed too)
    api_key: Optional[str] = None
    # --admin-api-key: unlocks what only the operator may ask for (e.g. cache explanations that
    # show other clients' cached text); also accepted wherever api_key is. None: nobody is admin.
    admin_api_key: Optional[str] = None
    max_request_bytes: int = 32 * 1024 * 1024
    server_args: dict = field(default_factory=dict)
    process_ids: dict = field(default_factory=dict)
    model_aliases: set = field(default_factory=set)
    lora_adapters: set = field(default_factory=set)  # adapter names: `model` may be "<name>" or "<model>:<name>"
    sessions: SessionStore = field(default_factory=SessionStore)  # SGLang's sessions (session_routes.py)
    snapshot_gate: SnapshotGate = field(default_factory=SnapshotGate)  # paces /debug/radix (snapshot_gate.py)
    weights_path: str = ""  # the checkpoint of the last /update_weights_from_disk ("": the model's own)
    weight_version: str = "default"  # its label (weight_routes.py)
    chat_info: dict = field(default_factory=dict)  # chat_role_markers, chat_default_system_prompt
    healthy: Callable[[], bool] = lambda: True
    # Why /health should answer 503 besides a dead child (the scheduler's
    # heartbeat is late, the server is draining), or None.
    health_problem: Callable[[], Optional[str]] = lambda: None
    started: float = field(default_factory=time.time)
    draining: bool = False  # shutting down: new requests get 503 (GuardMiddleware)
    active_requests: int = 0  # HTTP requests being answered (counted by GuardMiddleware)

    def authorized(self, headers: Iterable[tuple[bytes, bytes]]) -> bool:
        """Whether a request with ``headers`` may use the server (no key set, or
        it presents the API key or the admin key)."""
        if not self.api_key:
            return True
        key = presented_key(headers)
        return key is not None and any(same_key(key, k) for k in (self.api_key, self.admin_api_key) if k)

    def is_admin(self, request: Request) -> bool:
        """Whether ``request`` presents the admin key (never, when none is set)."""
        key = presented_key(request.scope.get("headers", []))
        return bool(self.admin_api_key) and key is not None and same_key(key, self.admin_api_key or "")

    def require_admin(self, request: Request, what: str, param: Optional[str] = None) -> None:
        """ServerError 403 unless ``request`` presents the admin key."""
        if not self.is_admin(request):
            hint = "" if self.admin_api_key else " (this server has none: --admin-api-key)"
            raise ServerError(403, f"{what} needs the server's admin key{hint}.", param, "permission_error")

    def check_cache_info(self, request: Request, return_cache_info: object) -> None:
        """ServerError 403 when ``request`` asks for the operator's view of the
        cache (``return_cache_info: "full"``, which shows other clients' cached
        text) without the admin key."""
        if isinstance(return_cache_info, str) and return_cache_info == "full":
            self.require_admin(
                request, 'return_cache_info "full" (the cached text around the match)', "return_cache_info"
            )

    def lora_of(self, name: Optional[str], lora_path: Optional[str] = None) -> Optional[str]:
        """The LoRA adapter an OpenAI ``model`` names (the adapter's own name, as vLLM takes it, or
        ``"<model>:<adapter>"``, as SGLang does; a name the model answers to wins), else the
        request's ``lora_path`` (SGLang's field), None for the base model; ServerError 404 for a
        name this server does not answer to, 400 for a ``lora_path`` that is not loaded or that
        names another adapter than ``model`` does."""
        adapter = self._adapter_named(name)
        if adapter is not None:
            if lora_path and lora_path != adapter:
                raise ServerError(
                    400,
                    f"model names LoRA adapter {adapter!r} and lora_path names {lora_path[:128]!r}; "
                    "name the adapter in one of them (or the same one in both).",
                    "lora_path",
                )
            return adapter
        self.check_model(name)
        if not lora_path:  # None, or "" as SGLang reads it: the base model
            return None
        if lora_path not in self.lora_adapters:
            raise ServerError(
                400, f"unknown LoRA adapter {lora_path[:128]!r}; load it with /load_lora_adapter.", "lora_path"
            )
        return lora_path

    def _adapter_named(self, name: Optional[str]) -> Optional[str]:
        """The loaded adapter ``model`` names, if it names one rather than the base model."""
        if name is None or name in self.model_aliases:
            return None
        if name in self.lora_adapters:
            return name
        base, sep, adapter = name.rpartition(":")
        return adapter if sep and base in self.model_aliases and adapter in self.lora_adapters else None

    def answering_model(self, lora: Optional[str]) -> str:
        """The ``model`` an OpenAI answer names: the served model, or the adapter that answered
        (its ``/v1/models`` id, its name), as vLLM names it."""
        return lora or self.served_model_name

    def check_model(self, name: Optional[str]) -> None:
        """ServerError 404 unless ``name`` is None or a name this server answers to."""
        if name is None or name in self.model_aliases:
            return
        raise ServerError(
            404,
            f"The model `{name}` does not exist; this server serves `{self.served_model_name}`.",
            "model",
            "model_not_found",
        )

    def model_info(self) -> dict:
        """The body of ``/get_model_info`` (also inside ``/get_server_info``)."""
        return {
            "model_path": self.weights_path or self.resolved_model_path,
            "tokenizer_path": self.resolved_model_path,
            "weight_version": self.weight_version,
            "served_model_name": self.served_model_name,
            "is_generation": True,
            "context_length": self.tm.context_length,
            "vocab_size": self.tm.vocab_size,
            "chat_role_markers": self.chat_info.get("chat_role_markers"),
            "chat_default_system_prompt": self.chat_info.get("chat_default_system_prompt"),
            "preferred_sampling_params": self.tm.limits.preferred_sampling,
        }


def server_context(request: Request) -> ServerContext:
    """FastAPI dependency: the ServerContext of the app serving ``request``."""
    return request.app.state.ctx
