"""`EngineConfig`: the runtime's configuration, in sections.

``EngineConfig(**flags)`` takes the flat flag names (``page_size=4``, as
``Engine(**flags)`` and ``radixrt serve --page-size 4`` spell them) and sorts
them into their sections; sections may also be given whole
(``EngineConfig(cache=CacheSettings(page_size=4))``, or a dict of a section's
fields, as `dataclasses.asdict` of an EngineConfig gives). Construction then
applies radixrt/config_deps.py (flags that need another: implied or refused)
on the flags, and builds and checks each section.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
from dataclasses import dataclass
from typing import Any, Optional, Union

from radixrt.config.fields import add_fields_as_args, check_number, first_line
from radixrt.config.host_cache import HostCacheSettings
from radixrt.config.kv_events import KVEventSettings
from radixrt.config.limits import LimitSettings
from radixrt.config.lora import LoRASettings
from radixrt.config.model_settings import ModelSettings
from radixrt.config.sections import (
    CacheSettings,
    DebugSettings,
    ExecutionSettings,
    GrammarSettings,
    KVBudgetSettings,
    OutputSettings,
    SchedulingSettings,
    SpeculativeSettings,
)
from radixrt.config.sglang_flags import SGLangFlagSettings
from radixrt.config.storage import StorageSettings
from radixrt.config_deps import ENGINE_NEEDS, apply_needs, field_defaults

# EngineConfig's attribute for each section, in the order of `--help`
SECTIONS: dict[str, type] = {
    "model": ModelSettings,
    "execution": ExecutionSettings,
    "cache": CacheSettings,
    "host_cache": HostCacheSettings,
    "storage": StorageSettings,
    "scheduling": SchedulingSettings,
    "limits": LimitSettings,
    "grammar": GrammarSettings,
    "speculative": SpeculativeSettings,
    "kv_budgets": KVBudgetSettings,
    "kv_events": KVEventSettings,
    "lora": LoRASettings,
    "output": OutputSettings,
    "debug": DebugSettings,
    "sglang": SGLangFlagSettings,
}


@functools.cache
def flag_sections() -> dict[str, str]:
    """Each flag (a section's field) -> the section holding it."""
    owner: dict[str, str] = {}
    for section, cls in SECTIONS.items():
        for f in dataclasses.fields(cls):
            assert f.name not in owner, f"flag {f.name} is in two sections"
            owner[f.name] = section
    return owner


@functools.cache
def keyword_only_flags() -> frozenset[str]:
    """The settings an Engine takes as keywords that have no command-line flag (``cli=False``)."""
    return frozenset(
        f.name for cls in SECTIONS.values() for f in dataclasses.fields(cls) if not f.metadata.get("cli", True)
    )


@functools.cache
def flag_defaults() -> dict[str, Any]:
    """Every flag's default (shared: read it, do not change it)."""
    return {name: value for cls in SECTIONS.values() for name, value in field_defaults(cls).items()}


_Section = Union[Any, dict, None]


@dataclass(init=False)
class EngineConfig:
    """The runtime's configuration: one attribute per section (see the module docstring)."""

    model: ModelSettings
    execution: ExecutionSettings
    cache: CacheSettings
    host_cache: HostCacheSettings
    storage: StorageSettings
    scheduling: SchedulingSettings
    limits: LimitSettings
    grammar: GrammarSettings
    speculative: SpeculativeSettings
    kv_budgets: KVBudgetSettings
    kv_events: KVEventSettings
    lora: LoRASettings
    output: OutputSettings
    debug: DebugSettings
    sglang: SGLangFlagSettings

    def __init__(
        self,
        model: _Section = None,
        execution: _Section = None,
        cache: _Section = None,
        host_cache: _Section = None,
        storage: _Section = None,
        scheduling: _Section = None,
        limits: _Section = None,
        grammar: _Section = None,
        speculative: _Section = None,
        kv_budgets: _Section = None,
        kv_events: _Section = None,
        lora: _Section = None,
        output: _Section = None,
        debug: _Section = None,
        sglang: _Section = None,
        **flags: Any,
    ) -> None:
        given = {
            "model": model,
            "execution": execution,
            "cache": cache,
            "host_cache": host_cache,
            "storage": storage,
            "scheduling": scheduling,
            "limits": limits,
            "grammar": grammar,
            "speculative": speculative,
            "kv_budgets": kv_budgets,
            "kv_events": kv_events,
            "lora": lora,
            "output": output,
            "debug": debug,
            "sglang": sglang,
        }
        values = dict(flag_defaults())
        for section, value in given.items():
            values.update(_section_values(section, value))
        owner = flag_sections()
        for name in flags:
            if name not in owner:
                raise TypeError(f"EngineConfig got an unexpected keyword argument {name!r}")
        for name, value in flags.items():
            check_number(SECTIONS[owner[name]], name, value)
        values.update(flags)
        # flags that need another: implied or refused (one table: radixrt/config_deps.py)
        view = argparse.Namespace(**values)
        apply_needs(view, ENGINE_NEEDS, flag_defaults())
        for section, cls in SECTIONS.items():
            setattr(self, section, cls(**{f.name: getattr(view, f.name) for f in dataclasses.fields(cls)}))
        if self.scheduling.chunked_prefill_size < self.cache.page_size:
            raise ValueError("chunked_prefill_size must be at least page_size (or -1: no chunking)")
        if self.storage.block_tokens(self.cache.page_size) % self.cache.page_size:
            raise ValueError("hicache_storage_block_tokens must be a multiple of page_size")

    def to_flat(self) -> dict[str, Any]:
        """Every flag and its value, by the flag's name (what `EngineConfig(**flags)` takes back)."""
        return {name: getattr(getattr(self, section), name) for name, section in flag_sections().items()}

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> None:
        """Add one ``--flag-name`` per flag (``--model`` for model_path), one argument group per section."""
        for section, scls in SECTIONS.items():
            add_fields_as_args(parser.add_argument_group(section, first_line(scls)), scls)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> "EngineConfig":
        return cls(**{name: getattr(args, name) for name in flag_sections() if name not in keyword_only_flags()})


def _section_values(section: str, value: Optional[Any]) -> dict[str, Any]:
    """The flags a section given to `EngineConfig` sets (all of its fields)."""
    cls = SECTIONS[section]
    if value is None:
        return {}
    if isinstance(value, dict):
        return dataclasses.asdict(cls(**value))  # checks the names (TypeError) and the values
    if isinstance(value, cls):
        return {f.name: getattr(value, f.name) for f in dataclasses.fields(cls)}
    raise TypeError(f"EngineConfig {section} must be a {cls.__name__} or a dict, got {type(value).__name__}")
