"""treespec: an LLM serving runtime (EAGLE tree speculation + radix prefix cache) and its frontend DSL.

`import treespec` is cheap: the frontend API (`treespec.function`, `treespec.gen`, ...) and `Engine`
are imported on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

_LANG = ("Backend", "EngineBackend", "ForkedStates", "Program", "ProgramState", "RuntimeEndpoint", "assistant",
         "assistant_begin", "assistant_end", "function", "gen", "get_default_backend", "run", "select",
         "set_default_backend", "system", "system_begin", "system_end", "user", "user_begin", "user_end")
_LAZY = {**{name: "treespec.lang" for name in _LANG}, "Engine": "treespec.engine"}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'treespec' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
