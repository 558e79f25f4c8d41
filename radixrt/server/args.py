"""`ServerArgs`: the HTTP server's own settings, and the flags of `radixrt serve`.

Each field's default and ``--help`` text live here once (as
radixrt/config/sections.py does for `EngineConfig`); the flags are generated
from them.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Optional

from radixrt.config import EngineConfig
from radixrt.config.fields import add_fields_as_args, first_line, setting, values_from_args
from radixrt.requests.reasoning import REASONING_PARSERS
from radixrt.server.slow_clients import (
    BODY_TIMEOUT_HELP,
    DEFAULT_BODY_TIMEOUT_S,
    DEFAULT_HEADER_TIMEOUT_S,
    HEADER_TIMEOUT_HELP,
)
from radixrt.server.tools.parsers import PARSER_CHOICES


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _int_in(name: str, text: str, lo: int, hi: int) -> int:
    value = int(text)
    if not lo <= value <= hi:
        raise argparse.ArgumentTypeError(f"{name} must be {lo} to {hi}, got {value}")
    return value


def _non_negative_float(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


@dataclass
class ServerArgs:
    """The HTTP server: address, keys, request bounds, timeouts, tool calls, stored responses."""

    host: str = setting("127.0.0.1", "address to listen on (0.0.0.0: every interface)")
    port: int = setting(30000, "HTTP port", type=lambda text: _int_in("port", text, 0, 65535))
    api_key: Optional[str] = setting(
        None,
        "require 'Authorization: Bearer KEY' on every route but /dashboard and, as SGLang, paths starting with "
        "/health, /ready or /metrics (default: $RADIXRT_API_KEY)",
        env="RADIXRT_API_KEY",
    )
    admin_api_key: Optional[str] = setting(
        None,
        "the operator's key (default: $RADIXRT_ADMIN_API_KEY): accepted wherever --api-key is, and needed "
        "for what only the operator may ask for (return_cache_info: 'full', which shows other clients' "
        "cached text; /flush_cache, /abort_request, weight and adapter updates, where a key is set); "
        "unset: nobody may see other clients' text, and any client key runs those routes",
        env="RADIXRT_ADMIN_API_KEY",
    )
    served_model_name: Optional[list[str]] = setting(
        None,
        "the model id for the OpenAI routes (default: the model folder's name); several names: the server "
        "answers to each and names itself by the first (as vLLM's)",
    )
    max_request_bytes: int = setting(32 * 1024 * 1024, "largest accepted request body in bytes (413 above)")
    startup_timeout: float = setting(600.0, "seconds to wait for the model to load")
    timeout_graceful_shutdown: float = setting(
        5.0, "uvicorn's, after draining: open connections get this many seconds", cli=False
    )
    shutdown_grace_s: float = setting(
        10.0,
        "on SIGTERM/Ctrl-C, seconds the requests in flight may take to finish (new ones get 503); those "
        "still running then end with an error",
    )
    scheduler_stall_timeout_s: float = setting(
        30.0,
        "/health answers 503 while the scheduler process has shown no progress (no loop iteration; it beats "
        "at least every 0.2 s when idle) for this many seconds; keep it above the longest step (a prefill "
        "chunk)",
    )
    header_read_timeout_s: float = setting(DEFAULT_HEADER_TIMEOUT_S, HEADER_TIMEOUT_HELP)
    body_read_timeout_s: float = setting(DEFAULT_BODY_TIMEOUT_S, BODY_TIMEOUT_HELP)
    tool_call_parser: str = setting(
        "auto",
        "format of the model's tool calls on /v1/chat/completions (default: from the chat template; "
        "'generic' where it renders no tools; docs/tool_calling.md)",
        choices=PARSER_CHOICES,
    )
    reasoning_parser: Optional[str] = setting(
        None,
        "split <think>...</think> into reasoning_content on /v1/chat/completions (vLLM's deepseek_r1 is deepseek-r1)",
        choices=REASONING_PARSERS,
        type=lambda name: name.replace("_", "-"),
    )
    sampling_defaults: str = setting(
        "model",
        "SGLang's: 'model' fills the sampling fields an OpenAI-route request leaves unset (temperature, top_p, "
        "top_k, min_p, repetition_penalty) from the model's generation_config.json, as SGLang and vLLM do; "
        "'openai': OpenAI's defaults",
        choices=("model", "openai"),
    )
    log_level_http: Optional[str] = setting(
        None,
        "SGLang's: uvicorn's log level, its access log included at debug and info (unset: --log-level's)",
        choices=("debug", "info", "warning", "error", "critical"),
    )
    crash_dump_folder: Optional[str] = setting(
        None,
        "SGLang's: when a process of the server dies, write the requests of the last 5 minutes (prompt token "
        "ids, sampling parameters, how each ended) to a JSON-lines file in this folder, ready to send again "
        "(default: none; the file holds prompts)",
    )
    tokenizer_worker_num: Optional[int] = setting(
        None,
        "SGLang's: how many workers tokenize the prompts in the HTTP process; here threads (the tokenizers "
        "library encodes without the interpreter lock, so they run in parallel as SGLang's processes do); "
        "1 to 64 (default: 2)",
        type=lambda text: _int_in("tokenizer_worker_num", text, 1, 64),
    )
    uvicorn_access_log_exclude_prefixes: Optional[list[str]] = setting(
        None,
        "SGLang's: leave out of the access log (shown at --log-level-http debug or info) the requests whose "
        "path starts with any of these prefixes, e.g. /metrics /health (default: none)",
    )
    max_tools: int = setting(
        128, "most function tools one chat request may define (a 400 above; OpenAI's limit is 128)"
    )
    max_tools_chars: int = setting(
        1_000_000, "most characters a chat request's tools may take as compact JSON (a 400 above)"
    )
    responses_store_size: int = setting(
        1024,
        "/v1/responses: how many responses (store: true) are kept for GET /v1/responses/{id} and "
        "previous_response_id; the least recently used go first (0: none is kept)",
        type=_non_negative_int,
    )
    responses_store_mb: float = setting(
        256.0, "/v1/responses: the most memory the stored responses may take, in MiB", type=_non_negative_float
    )

    def __post_init__(self) -> None:
        if isinstance(self.served_model_name, str):  # one name, given in code
            self.served_model_name = [self.served_model_name]
        if self.tokenizer_worker_num is not None and not 1 <= self.tokenizer_worker_num <= 64:
            raise ValueError("tokenizer_worker_num must be 1 to 64")


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    """The flags of one `radixrt serve` server: every EngineConfig flag, then the server's own."""
    EngineConfig.add_cli_args(parser)
    add_fields_as_args(parser.add_argument_group("server", first_line(ServerArgs)), ServerArgs)


def server_args_from_cli(args: argparse.Namespace) -> ServerArgs:
    return ServerArgs(**values_from_args(ServerArgs, args))
