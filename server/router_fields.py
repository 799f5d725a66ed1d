"""The request fields sglang-router adds to every body it forwards.

The router (sglang-router 0.3.2) parses each request into its own typed structs and serializes them
again, so a worker receives SGLang fields the client never sent, each at SGLang's default value (e.g.
`"return_hidden_states": false` on /generate and the OpenAI routes, `"model": "unknown"` on a chat
request that named no model). treespec accepts each such field at that default only, where it changes
nothing; any other value is a 400 naming the field, as for every field treespec does not implement.
"""

from __future__ import annotations

from typing import Any

# /generate: SGLang's GenerateReqInput defaults, as the router writes them
GENERATE_DEFAULTS: dict[str, Any] = {
    "model": None,
    "log_metrics": True,
    "return_hidden_states": False,
    "background": False,
    "no_logs": False,
    "return_bytes": False,
    "return_entropy": False,
}

# /v1/chat/completions and /v1/completions: SGLang's extensions of the OpenAI bodies, at their defaults
# (treespec has no reasoning parser, so separating reasoning text is already a no-op)
OPENAI_DEFAULTS: dict[str, Any] = {
    "return_hidden_states": False,
    "continue_final_message": False,
    "separate_reasoning": True,
    "stream_reasoning": True,
}

# what the router writes as `model` on a chat request that named none
ROUTER_UNNAMED_MODEL = "unknown"


def drop_router_defaults(body: dict[str, Any], defaults: dict[str, Any], route: str,
                         chat: bool = False) -> dict[str, Any]:
    """`body` without the fields of `defaults` that hold their default value (and, for a chat request,
    without the router's placeholder model name); a field of `defaults` with another value is an
    ApiError (400) naming it."""
    from treespec.server.protocol import ApiError  # here: protocol.py imports this module

    kept = {}
    for name, value in body.items():
        if name not in defaults:
            kept[name] = value
        elif value != defaults[name] or type(value) is not type(defaults[name]):
            raise ApiError(f"{name} is not a {route} field this server implements (only its default "
                           f"{defaults[name]!r} is accepted, as sglang-router sends it)", param=name)
    if chat and kept.get("model") == ROUTER_UNNAMED_MODEL:
        del kept["model"]
    return kept
