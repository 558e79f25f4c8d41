"""radixrt: a runtime for structured LLM programs built around RadixAttention.

``import radixrt`` stays light (no torch): heavy names such as `Engine` load
on first use.
"""

from __future__ import annotations

from typing import Any

from radixrt.version import __version__ as __version__  # the package's version, re-exported


def _map_checkout_packages() -> None:
    """Make ``radixrt.frontend`` and ``radixrt.kernels`` importable from a plain
    checkout (no install), where they sit beside ``radixrt/`` rather than in it.

    A wheel has them inside ``radixrt/`` and needs no finder. The finder goes
    first on ``sys.meta_path`` so that this checkout's siblings win over the
    mapping of an editable install of another checkout.
    """
    import importlib.abc
    import importlib.util
    import sys
    from pathlib import Path

    here = Path(__file__).resolve().parent
    folders = {
        f"radixrt.{name}": here.parent / name
        for name in ("frontend", "kernels")
        if not (here / name).exists() and (here.parent / name / "__init__.py").exists()
    }
    if not folders:
        return

    class CheckoutFinder(importlib.abc.MetaPathFinder):
        def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
            folder = folders.get(fullname)
            if folder is None:
                return None
            return importlib.util.spec_from_file_location(
                fullname, folder / "__init__.py", submodule_search_locations=[str(folder)]
            )

    if not any(type(f).__name__ == "CheckoutFinder" for f in sys.meta_path):
        sys.meta_path.insert(0, CheckoutFinder())


_map_checkout_packages()

# E402: these imports need the finder installed just above.
from radixrt.frontend import *  # noqa: E402, F403  (the DSL: function, gen, select, fork, roles, ...)
from radixrt.frontend import __all__ as _frontend_all  # noqa: E402

_LAZY = {
    "Engine": ("radixrt.engine", "Engine"),
    "EngineConfig": ("radixrt.config", "EngineConfig"),
    "SamplingParams": ("radixrt.sampling.params", "SamplingParams"),
    "RuntimeEndpoint": ("radixrt.frontend.runtime_endpoint", "RuntimeEndpoint"),
    "Runtime": ("radixrt.frontend.runtime_endpoint", "Runtime"),
    "OpenAI": ("radixrt.frontend.openai_backend", "OpenAI"),
    "EngineBackend": ("radixrt.frontend.engine_backend", "EngineBackend"),
}
__all__ = list(_frontend_all) + list(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        module, attr = _LAZY[name]
        value = getattr(importlib.import_module(module), attr)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'radixrt' has no attribute {name!r}")
