"""Workloads for speculative-decoding benchmarks, each built from material no draft was tuned on.

- `chat`: first user turns of the held-out ShareGPT split (`treespec.train.data`, the `train` extra).
- `multiturn`: held-out ShareGPT conversations with at least two user turns; the prompt is the first
  user turn, the dataset's first assistant reply and the second user turn, so the turn being answered
  can refer to text already in the context.
- `code_edit`: functions from the source of the `click` package (installed with the server's
  dependencies; never trained on), each with an instruction to rewrite it with comments: long stretches
  of the output repeat the prompt.
- `summarise`: docstrings of `click` and `httpx` functions, summarised with quotes of key phrases.

Prompts are chat-templated token ids, cut to `max_prompt_tokens`. No benchmark dataset (MT-bench,
HumanEval, GSM8K, ...) is used: those are how treespec is judged from outside.
"""

from __future__ import annotations

import ast
import importlib.util
import textwrap
from pathlib import Path

WORKLOADS = ("chat", "multiturn", "code_edit", "summarise")
CODE_EDIT = ("Rewrite the following Python function. Keep the code exactly as it is, but add a short comment "
             "above each block explaining what it does. Reply with the code only.\n\n```python\n{code}\n```")
SUMMARISE = ("Summarise the following documentation in three sentences. Quote the most important phrases "
             "exactly, in double quotes.\n\n{text}")


def _templated(tokenizer, conversations: list[list[dict]], n: int, max_prompt_tokens: int) -> list[list[int]]:
    """Chat-templated ids of `n` of the conversations spread over the list, skipping those longer than
    `max_prompt_tokens` (cutting one would break its template)."""
    from treespec.tokenizer import chat_input_ids

    fitting = [ids for ids in (chat_input_ids(tokenizer, c) for c in conversations) if len(ids) <= max_prompt_tokens]
    return _spread(fitting, n)


def _module_sources(package: str) -> list[str]:
    """The text of the package's own .py files, read (not imported), in name order."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package {package!r} is not installed")
    return [p.read_text(encoding="utf-8") for loc in spec.submodule_search_locations
            for p in sorted(Path(loc).glob("*.py"))]


def _functions(package: str, min_lines: int, max_lines: int) -> list[str]:
    """Top-level and method function sources of `package`, between min and max lines, in file order."""
    out = []
    for source in _module_sources(package):
        lines = source.splitlines()
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.end_lineno is not None:
                n = node.end_lineno - node.lineno + 1
                if min_lines <= n <= max_lines:
                    out.append(textwrap.dedent("\n".join(lines[node.lineno - 1 : node.end_lineno])))
    return out


def _docstrings(packages: tuple[str, ...], min_chars: int) -> list[str]:
    out = []
    for package in packages:
        for source in _module_sources(package):
            for node in ast.walk(ast.parse(source)):
                if isinstance(node, ast.FunctionDef | ast.ClassDef | ast.AsyncFunctionDef):
                    doc = ast.get_docstring(node)
                    if doc and len(doc) >= min_chars:
                        out.append(doc)
    return out


def _spread(items: list, n: int) -> list:
    """n items spread evenly over the list (deterministic), all of them if there are fewer."""
    if len(items) <= n:
        return items
    return [items[i * len(items) // n] for i in range(n)]


def workload_prompts(name: str, tokenizer, n: int, max_prompt_tokens: int = 768) -> list[list[int]]:
    """`n` prompts (token ids) of workload `name`."""
    if name == "chat":
        from treespec.train.data import holdout_prompts

        return holdout_prompts(tokenizer, None, 500, n, max_prompt_tokens=max_prompt_tokens)
    if name == "multiturn":
        from treespec.train.data import load_conversations, split_conversations

        _, held = split_conversations(load_conversations(None), 500)
        convs = [[dict(m) for m in c[:3]] for c in held
                 if len(c) >= 3 and [m["role"] for m in c[:3]] == ["user", "assistant", "user"]]
        return _templated(tokenizer, convs, n, max_prompt_tokens)
    if name == "code_edit":
        funcs = _functions("click", 8, 30)
        return _templated(tokenizer, [[{"role": "user", "content": CODE_EDIT.format(code=f)}] for f in funcs], n,
                          max_prompt_tokens)
    if name == "summarise":
        docs = _docstrings(("click", "httpx"), 400)
        return _templated(tokenizer, [[{"role": "user", "content": SUMMARISE.format(text=d)}] for d in docs], n,
                          max_prompt_tokens)
    raise ValueError(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")
