"""Per-request adaptivity: each request's draft tree follows its own measured acceptance, within the
shape the schedule gives the batch.

- The draft head: a request whose head drafts keep failing (fewer than HEAD_MIN_ACCEPT accepted per
  step, as an exponential moving average) stops getting head nodes in its tree, so its verify is the
  root (plus n-gram nodes, if any); when no request of the batch wants head drafts the draft forwards
  are skipped altogether. Every HEAD_PROBE_EVERY steps without head nodes it gets them again, once,
  to measure afresh. Its draft KV stays current either way (the draft extend over committed tokens
  always runs), so a probe drafts from an exact state.
- The hybrid's n-gram nodes (`next_budget`): a request whose n-gram nodes were all accepted (it is
  copying text) gets twice the budget next step, up to HYBRID_GROWTH x the flag; one whose offered
  nodes all failed gets half, down to MIN_BUDGET.
"""

from __future__ import annotations

from dataclasses import dataclass

# Accepted head drafts per step (moving average) to keep drafting with the head. On two Zen 4 cores
# under the CPU default (int8 activations) a 3-row verify costs ~1.15 plain steps, and a head step's
# catch-up extend, tree steps and host work ~0.55 more (bench_step_cost, 2026-11-27): ~1.7 plain steps
# for 1 + accepted tokens, so below ~1 accepted draft per step the head's drafts lose time.
HEAD_MIN_ACCEPT = 1.0
HEAD_PROBE_EVERY = 8  # steps without head drafts before one probe
HEAD_EMA_WEIGHT = 0.2  # weight of the newest step in the moving average
HYBRID_GROWTH = 4  # a request's n-gram budget ranges from MIN_BUDGET to HYBRID_GROWTH x the flag
MIN_BUDGET = 2


@dataclass(frozen=True)
class HeadRecord:
    """One request's measured head acceptance."""

    accept_ema: float = 1.0  # optimistic start: a new request drafts with the head
    steps_without: int = 0  # steps since its tree last had head nodes

    @property
    def drafts(self) -> bool:
        return self.accept_ema >= HEAD_MIN_ACCEPT or self.steps_without >= HEAD_PROBE_EVERY

    def after_step(self, offered: bool, accepted: int) -> HeadRecord:
        if not offered:
            return HeadRecord(self.accept_ema, self.steps_without + 1)
        return HeadRecord((1 - HEAD_EMA_WEIGHT) * self.accept_ema + HEAD_EMA_WEIGHT * accepted, 0)


def next_budget(budget: int, offered: int, accepted: int, start: int) -> int:
    """Per-request adaptivity: a request whose n-gram nodes were all accepted (it is copying text) gets
    twice the budget next step, up to HYBRID_GROWTH x `start`; one whose offered nodes all failed gets
    half, down to MIN_BUDGET; otherwise the budget stays."""
    if offered and accepted >= offered:
        return min(2 * budget, HYBRID_GROWTH * start)
    if offered and accepted == 0:
        return max(budget // 2, MIN_BUDGET)
    return budget
