"""`@function` programs, run / run_batch, and the default backend."""

from __future__ import annotations

import functools
import sys
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, as_completed
from typing import Any

from treespec.lang.backends import Backend
from treespec.lang.interpreter import ProgramState

_default_backend: Backend | None = None
SAMPLING_DEFAULTS = ("max_new_tokens", "temperature", "top_p", "top_k", "min_p", "stop", "seed")


def set_default_backend(backend: Backend | None) -> None:
    global _default_backend
    _default_backend = backend


def get_default_backend() -> Backend | None:
    return _default_backend


class Program:
    """A decorated program `f(s, **kwargs)`; run it with `run` or many at once with `run_batch`."""

    def __init__(self, func: Callable[..., Any]) -> None:
        self.func = func
        functools.update_wrapper(self, func)

    def _backend(self, backend: Backend | None) -> Backend:
        b = backend or _default_backend
        if b is None:
            raise RuntimeError("no backend: pass backend=... or call set_default_backend(...)")
        return b

    def _execute(self, state: ProgramState, kwargs: dict[str, Any]) -> ProgramState:
        try:
            self.func(state, **kwargs)
        except BaseException as e:  # noqa: BLE001 - the state carries its program's error
            if state.error is None:
                state.error = e
        state.sync()
        return state

    def run(self, *, backend: Backend | None = None, stream: bool = False, raise_errors: bool = True,
            max_new_tokens: int | None = None, temperature: float | None = None, top_p: float | None = None,
            top_k: int | None = None, min_p: float | None = None, stop: str | list[str] | None = None,
            seed: int | None = None, **kwargs: Any) -> ProgramState:
        """Run once. Sampling arguments are defaults for every gen of the program. With stream=True the
        program runs in the background: iterate `state.text_iter()` for text deltas."""
        defaults = {"max_new_tokens": max_new_tokens, "temperature": temperature, "top_p": top_p, "top_k": top_k,
                    "min_p": min_p, "stop": stop, "seed": seed}
        state = ProgramState(self._backend(backend), defaults, stream=stream)
        if stream:
            def target() -> None:
                self._execute(state, kwargs)
                state._finish_stream()

            threading.Thread(target=target, name="treespec-lang-stream", daemon=True).start()
            return state
        self._execute(state, kwargs)
        if raise_errors and state.error is not None:
            raise state.error
        return state

    def run_batch(self, batch_kwargs: list[dict[str, Any]], *, backend: Backend | None = None,
                  num_threads: int | str = "auto", progress_bar: bool = False, **defaults: Any) -> list[ProgramState]:
        """Run one program per kwargs dict concurrently. Never raises for a program's error: each state
        carries its own (`state.error`), and the other programs go on."""
        unknown = set(defaults) - set(SAMPLING_DEFAULTS)
        if unknown:
            raise TypeError(f"unknown run_batch argument(s): {sorted(unknown)}")
        b = self._backend(backend)
        n = len(batch_kwargs)
        workers = min(max(n, 1), 128) if num_threads == "auto" else max(int(num_threads), 1)
        states = [ProgramState(b, defaults) for _ in batch_kwargs]
        bar = _progress(n) if progress_bar else None
        with ThreadPoolExecutor(workers, thread_name_prefix="treespec-lang-batch") as pool:
            futs = [pool.submit(self._execute, st, kw) for st, kw in zip(states, batch_kwargs, strict=True)]
            for _ in as_completed(futs):
                if bar is not None:
                    bar.update(1)
        if bar is not None:
            bar.close()
        return states

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.func(*args, **kwargs)


def _progress(total: int) -> Any:
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover
        return None
    return tqdm(total=total, file=sys.stderr, desc="run_batch")


def function(func: Callable[..., Any]) -> Program:
    """Decorator: `@function def prog(s, question): s += ...`."""
    return Program(func)


def run(program: Program, *, backend: Backend | None = None, **kwargs: Any) -> ProgramState:
    return program.run(backend=backend, **kwargs)
