"""What the server's routes share: the tokenizer manager, metrics and the
server's identity and settings (one `ServerContext` per app)."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Optional

from starlette.requests import Request

from radixrt.server.errors import ServerError
from radixrt.server.metrics import ServerMetrics
from radixrt.server.tokenizer_manager import TokenizerManager


@dataclass
class ServerContext:
    """What the routes need besides the request."""

    tm: TokenizerManager
    metrics: ServerMetrics
    model_path: str  # as given on the command line
    resolved_model_path: str
    served_model_name: str
    api_key: Optional[str] = None
    max_request_bytes: int = 32 * 1024 * 1024
    server_args: dict = field(default_factory=dict)
    process_ids: dict = field(default_factory=dict)
    model_aliases: set = field(default_factory=set)
    chat_info: dict = field(default_factory=dict)  # chat_role_markers, chat_default_system_prompt
    healthy: Callable[[], bool] = lambda: True
    # Why /health should answer 503 besides a dead child (the scheduler's
    # heartbeat is late, the server is draining), or None.
    health_problem: Callable[[], Optional[str]] = lambda: None
    started: float = field(default_factory=time.time)
    draining: bool = False  # shutting down: new requests get 503 (GuardMiddleware)
    active_requests: int = 0  # HTTP requests being answered (counted by GuardMiddleware)

    def check_model(self, name: Optional[str]) -> None:
        """ServerError 404 unless ``name`` is None or a name this server answers to."""
        if name is None or name in self.model_aliases:
            return
        raise ServerError(404, f"The model `{name}` does not exist; this server serves "
                               f"`{self.served_model_name}`.", "model", "model_not_found")

    def model_info(self) -> dict:
        """The body of ``/get_model_info`` (also inside ``/get_server_info``)."""
        return {
            "model_path": self.resolved_model_path,
            "tokenizer_path": self.resolved_model_path,
            "served_model_name": self.served_model_name,
            "is_generation": True,
            "context_length": self.tm.context_length,
            "vocab_size": self.tm.vocab_size,
            "chat_role_markers": self.chat_info.get("chat_role_markers"),
            "chat_default_system_prompt": self.chat_info.get("chat_default_system_prompt"),
            "preferred_sampling_params": None,
        }


def server_context(request: Request) -> ServerContext:
    """FastAPI dependency: the ServerContext of the app serving ``request``."""
    return request.app.state.ctx
