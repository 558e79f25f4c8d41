"""The runtime's configuration, shared by the Engine, the server and the CLI:
`EngineConfig` and its sections (radixrt/config/sections.py), each field's
default and help once; the flags are generated from them (fields.py)."""

from radixrt.config.engine_config import SECTIONS, EngineConfig, flag_defaults, flag_sections
from radixrt.config.host_cache import HostCacheSettings
from radixrt.config.limits import LimitSettings
from radixrt.config.model_settings import ModelSettings
from radixrt.config.sections import (
    CacheSettings,
    DebugSettings,
    ExecutionSettings,
    GrammarSettings,
    OutputSettings,
    SchedulingSettings,
)

__all__ = [
    "SECTIONS",
    "EngineConfig",
    "flag_defaults",
    "flag_sections",
    "CacheSettings",
    "DebugSettings",
    "ExecutionSettings",
    "GrammarSettings",
    "HostCacheSettings",
    "LimitSettings",
    "ModelSettings",
    "OutputSettings",
    "SchedulingSettings",
]
