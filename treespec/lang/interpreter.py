"""ProgramState: the `s` of a program. Appended nodes run in order on the state's own worker thread, so
`s += gen(...)` returns at once and fork branches run in parallel; reading a value waits for them."""

from __future__ import annotations

import queue
import threading
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from treespec.lang.backends import Backend, render_chat
from treespec.lang.ir import ROLES, Gen, Node, RoleBegin, RoleEnd, Select, Seq, Text, VarSet, as_node


class ProgramState:
    def __init__(self, backend: Backend, defaults: dict[str, Any] | None = None, stream: bool = False) -> None:
        self.backend = backend
        self.defaults = dict(defaults or {})
        self.error: BaseException | None = None
        self.variables: dict[str, Any] = {}
        self.meta_infos: dict[str, Any] = {}
        self._base = ""  # text already rendered (raw text, and chat turns folded in before raw text)
        self._messages: list[dict] = []
        self._rendered = 0  # self._messages[:_rendered] are part of _base
        self._open: list[str] | None = None  # [role, content so far] of an open chat turn
        self._pending: deque[Node] = deque()
        self._cond = threading.Condition()
        self._running = False
        self._stream: queue.Queue | None = queue.Queue() if stream else None
        self._emitted = ""

    # ---- appending (asynchronous) ----
    def __iadd__(self, other: Any) -> ProgramState:
        self.submit(as_node(other))
        return self

    def submit(self, node: Node) -> None:
        with self._cond:
            self._pending.append(node)
            if not self._running:
                self._running = True
                threading.Thread(target=self._work, name="treespec-lang-state", daemon=True).start()

    def _work(self) -> None:
        while True:
            with self._cond:
                if not self._pending:
                    self._running = False
                    self._cond.notify_all()
                    return
                node = self._pending.popleft()
            if self.error is None:
                try:
                    self._execute(node)
                except BaseException as e:  # noqa: BLE001 - the state carries the error of its program
                    self.error = e
                self._emit_diff()

    def sync(self) -> ProgramState:
        """Wait until every appended node has run."""
        with self._cond:
            self._cond.wait_for(lambda: not self._running and not self._pending)
        return self

    # ---- execution ----
    def _execute(self, node: Node) -> None:
        if isinstance(node, Text):
            self._append(node.text)
        elif isinstance(node, Seq):
            for item in node.items:
                self._execute(item)
        elif isinstance(node, Gen):
            self._gen(node)
        elif isinstance(node, Select):
            self._select(node)
        elif isinstance(node, RoleBegin):
            if self._open is not None:
                raise ValueError(f"cannot open a {node.role} turn inside an open {self._open[0]} turn")
            if node.role not in ROLES:
                raise ValueError(f"unknown role {node.role!r}")
            self._open = [node.role, ""]
        elif isinstance(node, RoleEnd):
            if self._open is None or self._open[0] != node.role:
                raise ValueError(f"{node.role} turn ended but it is not open")
            self._messages.append({"role": node.role, "content": self._open[1]})
            self._open = None
        elif isinstance(node, VarSet):
            self.variables[node.name] = node.value
        else:
            raise TypeError(f"unknown node {node!r}")

    def _append(self, text: str) -> None:
        if self._open is not None:
            self._open[1] += text
            return
        if self._rendered < len(self._messages):  # raw text after chat turns: freeze the turns first
            self._base += render_chat(self.backend.tokenizer, self._messages[self._rendered:], None, "")
            self._rendered = len(self._messages)
        self._base += text

    def _text_now(self) -> str:
        tail = self._messages[self._rendered:]
        if not tail and self._open is None:
            return self._base
        role, content = self._open if self._open is not None else (None, "")
        return self._base + render_chat(self.backend.tokenizer, tail, role, content)

    def _gen(self, node: Gen) -> None:
        params = node.sampling_params(self.defaults)
        on_delta = None
        if self._stream is not None:
            self._emit_diff()  # the prompt's text first, then the generated deltas
            on_delta = self._put_delta
        out = self.backend.generate(self._text_now(), params, on_delta)
        text = out["text"]
        self._append(text)
        if node.name:
            self.variables[node.name] = text
            self.meta_infos[node.name] = out.get("meta_info", {})

    def _select(self, node: Select) -> None:
        index, scores, metas = self.backend.select(self._text_now(), node.choices)
        choice = node.choices[index]
        self._append(choice)
        if node.name:
            self.variables[node.name] = choice
            self.meta_infos[node.name] = {"normalized_logprobs": scores, "choice_meta_infos": metas}

    # ---- streaming ----
    def _put_delta(self, delta: str) -> None:
        if self._stream is not None and delta:
            self._emitted += delta
            self._stream.put(delta)

    def _emit_diff(self) -> None:
        if self._stream is None:
            return
        text = self._text_now()
        if text.startswith(self._emitted):
            self._put_delta(text[len(self._emitted):])
        else:  # a template re-rendered earlier text: resynchronise without re-sending it
            self._emitted = text

    def _finish_stream(self) -> None:
        if self._stream is not None:
            self._stream.put(None)

    def text_iter(self) -> Iterator[str]:
        """Text deltas while the program runs (stream=True); otherwise the whole text once."""
        if self._stream is None:
            yield self.text()
            return
        while (delta := self._stream.get()) is not None:
            yield delta

    # ---- reading (synchronous) ----
    def text(self) -> str:
        self.sync()
        return self._text_now()

    def messages(self) -> list[dict]:
        self.sync()
        msgs = [dict(m) for m in self._messages]
        if self._open is not None:
            msgs.append({"role": self._open[0], "content": self._open[1]})
        return msgs

    def __getitem__(self, name: str) -> Any:
        self.sync()
        if name not in self.variables and self.error is not None:
            raise RuntimeError(f"variable {name!r} missing: the program failed") from self.error
        return self.variables[name]

    def get_var(self, name: str) -> Any:
        return self[name]

    def set_var(self, name: str, value: Any) -> None:
        self.submit(VarSet(name, value))

    def __contains__(self, name: str) -> bool:
        self.sync()
        return name in self.variables

    def get_meta_info(self, name: str) -> dict:
        self.sync()
        return self.meta_infos.get(name, {})

    def __repr__(self) -> str:
        return f"ProgramState(error={self.error!r}, text={self.text()!r})"

    # ---- roles as context managers ----
    @contextmanager
    def _role(self, role: str) -> Iterator[None]:
        self.submit(RoleBegin(role))
        yield
        self.submit(RoleEnd(role))

    def system(self) -> Any:
        return self._role("system")

    def user(self) -> Any:
        return self._role("user")

    def assistant(self) -> Any:
        return self._role("assistant")

    # ---- fork ----
    def fork(self, n: int) -> ForkedStates:
        """n branches that continue from the current state (their prompts share its prefix)."""
        self.sync()
        if self.error is not None:
            raise RuntimeError("cannot fork a failed program") from self.error
        return ForkedStates([self._copy() for _ in range(n)])

    def _copy(self) -> ProgramState:
        c = ProgramState(self.backend, self.defaults)
        c._base, c._rendered = self._base, self._rendered
        c._messages = [dict(m) for m in self._messages]
        c._open = list(self._open) if self._open is not None else None
        c.variables, c.meta_infos = dict(self.variables), dict(self.meta_infos)
        return c


class ForkedStates:
    """Branches of a fork: index them, append to all with `+=`, `join()` to wait for all."""

    def __init__(self, states: list[ProgramState]) -> None:
        self.states = states

    def __getitem__(self, i: int) -> ProgramState:
        return self.states[i]

    def __len__(self) -> int:
        return len(self.states)

    def __iter__(self) -> Iterator[ProgramState]:
        return iter(self.states)

    def __iadd__(self, other: Any) -> ForkedStates:
        node = as_node(other)
        for st in self.states:
            st.submit(node)
        return self

    def join(self) -> ForkedStates:
        for st in self.states:
            st.sync()
        for st in self.states:
            if st.error is not None:
                raise RuntimeError("a fork branch failed") from st.error
        return self

    def values(self, name: str) -> list[Any]:
        return [st[name] for st in self.states]
