"""Process-wide frontend settings."""

from __future__ import annotations

from typing import Any, Optional


class GlobalConfig:
    def __init__(self) -> None:
        # The backend used when run()/run_batch() get none.
        self.default_backend: Optional[Any] = None
        # Insert the chat template's default system prompt (SmolLM2's ChatML has
        # one) when a program opens a non-system role first, as the template does.
        self.insert_default_system_prompt: bool = True
        # run_batch: trace up to this many programs to find the prefix they share.
        self.prefix_trace_samples: int = 16
        # run_batch: prefill the shared prefix only when it has at least this many characters.
        self.min_shared_prefix_chars: int = 16
        # s.fork(n>1): prefill the parent's text first so the branches hit the cache.
        self.prefill_before_fork: bool = True


global_config = GlobalConfig()
