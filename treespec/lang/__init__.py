"""The frontend DSL: programs over a state `s` (`s += gen(...)`), run on an Engine or a server."""

from treespec.lang.api import Program, function, get_default_backend, run, set_default_backend
from treespec.lang.backends import Backend, EngineBackend, RuntimeEndpoint
from treespec.lang.interpreter import ForkedStates, ProgramState
from treespec.lang.ir import (
    assistant,
    assistant_begin,
    assistant_end,
    gen,
    select,
    system,
    system_begin,
    system_end,
    user,
    user_begin,
    user_end,
)

__all__ = [
    "Backend", "EngineBackend", "ForkedStates", "Program", "ProgramState", "RuntimeEndpoint", "assistant",
    "assistant_begin", "assistant_end", "function", "gen", "get_default_backend", "run", "select",
    "set_default_backend", "system", "system_begin", "system_end", "user", "user_begin", "user_end",
]
