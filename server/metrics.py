"""Prometheus text exposition of the scheduler's statistics (GET /metrics)."""

from __future__ import annotations

from typing import Any

# (metric, stats key, kind, help)
_METRICS: list[tuple[str, str, str, str]] = [
    ("num_running_reqs", "num_running_reqs", "gauge", "Requests currently running (decoding or prefilling)."),
    ("num_waiting_reqs", "num_waiting_reqs", "gauge", "Requests waiting to be scheduled."),
    ("token_usage", "token_usage", "gauge", "Fraction of the KV pool in use by running requests."),
    ("max_total_num_tokens", "max_total_num_tokens", "gauge", "KV pool size in tokens."),
    ("free_tokens", "free_tokens", "gauge", "Free KV slots."),
    ("evictable_tokens", "evictable_tokens", "gauge", "KV slots held by the prefix cache and evictable."),
    ("cache_hit_rate", "cache_hit_rate", "gauge", "Prompt tokens served from the prefix cache / prompt tokens."),
    ("spec_accept_length", "avg_spec_accept_length", "gauge",
     "Average tokens emitted per speculative verify step since start."),
    ("gen_throughput", "gen_throughput", "gauge", "Generated tokens per second over the last 10 s."),
    ("generated_tokens_total", "generated_tokens", "counter", "Tokens generated since start."),
    ("prompt_tokens_total", "prompt_tokens", "counter", "Prompt tokens of finished requests."),
    ("cached_tokens_total", "cached_tokens", "counter", "Prompt tokens of finished requests found in the cache."),
    ("num_requests_total", "num_finished", "counter", "Requests finished since start."),
    ("num_aborted_requests_total", "num_aborted_reqs", "counter", "Requests aborted since start."),
    ("num_retractions_total", "num_retractions", "counter", "Running requests retracted for lack of KV space."),
]


def _label_value(v: str) -> str:
    return v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def render_metrics(stats: dict[str, Any], model_name: str, prefix: str = "treespec") -> str:
    labels = f'{{model_name="{_label_value(model_name)}"}}'
    lines = []
    for name, key, kind, help_text in _METRICS:
        value = stats.get(key)
        if value is None:
            value = 0
        full = f"{prefix}:{name}"
        lines.append(f"# HELP {full} {help_text}")
        lines.append(f"# TYPE {full} {kind}")
        lines.append(f"{full}{labels} {float(value):.6g}" if isinstance(value, float) else f"{full}{labels} {int(value)}")
    return "\n".join(lines) + "\n"
