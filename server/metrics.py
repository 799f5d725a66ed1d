"""Prometheus text exposition (GET /metrics): the scheduler's statistics, and the request latency
histograms the HTTP process measures (SGLang's metric names under our `treespec:` prefix)."""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Any

# upper bounds in seconds; a CPU server's latencies reach tens of seconds
TOKEN_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0)
REQUEST_LATENCY_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 15.0, 30.0, 60.0, 120.0, 300.0, 600.0)

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


@dataclass
class Histogram:
    """A Prometheus histogram: observations counted per bucket (the `le` bounds), their sum and count."""

    bounds: tuple[float, ...]
    bucket_counts: list[int] = field(default_factory=list)  # non-cumulative, one per bound plus +Inf
    total: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        self.bucket_counts = [0] * (len(self.bounds) + 1)

    def observe(self, value: float, times: int = 1) -> None:
        self.bucket_counts[bisect.bisect_left(self.bounds, value)] += times
        self.total += value * times
        self.count += times

    def render(self, full_name: str, help_text: str, model_label: str) -> list[str]:
        lines = [f"# HELP {full_name} {help_text}", f"# TYPE {full_name} histogram"]
        cumulative = 0
        for bound, n in zip((*self.bounds, float("inf")), self.bucket_counts, strict=True):
            cumulative += n
            le = "+Inf" if bound == float("inf") else f"{bound:g}"
            lines.append(f'{full_name}_bucket{{le="{le}",{model_label}}} {cumulative}')
        lines.append(f"{full_name}_sum{{{model_label}}} {self.total:.6g}")
        lines.append(f"{full_name}_count{{{model_label}}} {self.count}")
        return lines


@dataclass
class LatencyMetrics:
    """SGLang's three request latency histograms, observed by the TokenizerManager."""

    time_to_first_token: Histogram = field(default_factory=lambda: Histogram(REQUEST_LATENCY_BUCKETS))
    inter_token_latency: Histogram = field(default_factory=lambda: Histogram(TOKEN_LATENCY_BUCKETS))
    e2e_request_latency: Histogram = field(default_factory=lambda: Histogram(REQUEST_LATENCY_BUCKETS))

    def render(self, model_name: str, prefix: str = "treespec") -> str:
        label = f'model_name="{_label_value(model_name)}"'
        lines = []
        for name, hist, help_text in (
            ("time_to_first_token_seconds", self.time_to_first_token, "Histogram of time to first token in seconds."),
            ("inter_token_latency_seconds", self.inter_token_latency, "Histogram of inter-token latency in seconds."),
            ("e2e_request_latency_seconds", self.e2e_request_latency,
             "Histogram of end-to-end request latency in seconds."),
        ):
            lines += hist.render(f"{prefix}:{name}", help_text, label)
        return "\n".join(lines) + "\n"


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
    # committed draft tokens by source (eagle, ngram), one labelled series each
    full = f"{prefix}:spec_accepted_drafts_total"
    lines.append(f"# HELP {full} Draft tokens accepted and committed since start, by draft source.")
    lines.append(f"# TYPE {full} counter")
    for key in sorted(k for k in stats if k.startswith("spec_accepted_drafts_")):
        source = _label_value(key.removeprefix("spec_accepted_drafts_"))
        lines.append(f'{full}{{model_name="{_label_value(model_name)}",source="{source}"}} {int(stats[key])}')
    return "\n".join(lines) + "\n"
