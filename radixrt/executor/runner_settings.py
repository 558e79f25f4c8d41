"""`RunnerSettings`: what the model runner reads of the configuration."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

from radixrt.config import CacheSettings, EngineConfig, ExecutionSettings, ModelSettings


@dataclass(frozen=True)
class RunnerSettings:
    """The model, where and how it runs, its KV pool, and how many requests its
    tables hold (the scheduling section's ``max_running_requests``: request-to-
    slot rows, and the cap on CUDA-graph batch sizes)."""

    model: ModelSettings
    execution: ExecutionSettings
    cache: CacheSettings
    max_running_requests: int

    @classmethod
    def of(cls, config: EngineConfig) -> "RunnerSettings":
        return cls(config.model, config.execution, config.cache, config.scheduling.max_running_requests)

    def to_json(self) -> str:
        """For the follower ranks' command line (`from_json` reads it back)."""
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "RunnerSettings":
        d = json.loads(text)
        return cls(
            ModelSettings(**d["model"]),
            ExecutionSettings(**d["execution"]),
            CacheSettings(**d["cache"]),
            int(d["max_running_requests"]),
        )
