"""Speculation settings chosen by the running batch size (`--speculative-config FILE`).

Users' most common complaint about EAGLE serving is that the speed-up turns into a slow-down at
high concurrency. A schedule maps batch-size ranges to (num_steps, topk, num_draft_tokens); an entry
with num_steps 0 means a plain decode step for that range (the draft's extend over its tokens is
deferred and batched: EagleWorker.defer_extend; speculation resumes as soon as the batch shrinks).

File format (JSON), entries in increasing max_batch_size, the last may have max_batch_size null:

    {"schedule": [
        {"max_batch_size": 1, "num_steps": 5, "eagle_topk": 4, "num_draft_tokens": 8},
        {"max_batch_size": 4, "num_steps": 3, "eagle_topk": 1, "num_draft_tokens": 4},
        {"max_batch_size": null, "num_steps": 0}
    ]}

An NGRAM entry may add "ngram_min_accept_prob" (default 0): draft nodes whose estimated chance of
acceptance is lower stay out of the tree, so the tree is sized by what its n-gram matches promise, up
to num_draft_tokens (--speculative-ngram-min-accept-prob overrides it for every entry).

A file may add "schedule_cuda", a list in the same format that replaces "schedule" when the target runs
on a CUDA device: there a verified node costs almost nothing (the step is bound by kernel launches), on
two CPU cores ~0.1-0.2 of a decode step, so the two tune to different trees. Likewise "schedule_avx2"
replaces it on a CPU whose block-quant matmuls run their AVX2 code (no AVX-512 VNNI there, or
TREESPEC_CPU_QUANT_ISA=avx2): a verified row costs ~0.3 of a decode step there, so fewer, likelier nodes
pay. Which one a worker takes is its target runner's `schedule_kind()`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

FLAG = "--speculative-config"
# the file's lists that replace its "schedule" for a runner kind (ModelRunner.schedule_kind)
SCHEDULE_KEYS = {"schedule_cuda": "cuda", "schedule_avx2": "cpu_avx2"}


class ScheduleError(ValueError):
    """A malformed speculative config; the message names the flag."""


@dataclass(frozen=True)
class SpecShape:
    num_steps: int
    topk: int
    num_draft_tokens: int
    # NGRAM only: a draft node joins the tree only if its estimated chance of acceptance is at least this
    # (0: fill the node budget, as SGLang does; ngram_cache.NgramCache.draft)
    ngram_min_accept_prob: float = 0.0

    @property
    def slots_per_request(self) -> int:
        # drafting and verifying allocate one after the other, never together
        return max(self.num_draft_tokens, self.topk * max(self.num_steps - 1, 0))


def validate_shape(steps: int, topk: int, ndraft: int, where: str) -> None:
    """The tree-shape rules shared by the three flags and every schedule entry."""
    if steps == 0:
        return
    if steps < 0 or topk < 1 or ndraft < 2:
        raise ScheduleError(f"{where}: steps, topk must be positive and draft tokens >= 2")
    if topk == 1 and ndraft != steps + 1:
        raise ScheduleError(f"{where}: with topk 1 the tree is a chain, draft tokens must be steps + 1")
    if ndraft > 1 + topk * steps:
        raise ScheduleError(f"{where}: draft tokens must be <= 1 + topk * steps = {1 + topk * steps}")


@dataclass
class SpecSchedule:
    entries: list[tuple[int | None, SpecShape]]  # (max batch size or None = any, shape)

    @property
    def pinned(self) -> bool:
        """One shape for every batch size (the shape flags, or a one-entry config)."""
        return len(self.entries) == 1

    @classmethod
    def constant(cls, steps: int, topk: int, ndraft: int) -> SpecSchedule:
        return cls([(None, SpecShape(steps, topk, ndraft))])

    @classmethod
    def from_flags(cls, path: str | None, steps: int, topk: int, ndraft: int, kind: str = "cpu") -> SpecSchedule:
        """A worker's schedule: the --speculative-config file when one is given (its entries for `kind`,
        the target runner's `schedule_kind()`), else this one shape."""
        return cls.from_file(path, kind) if path else cls.constant(steps, topk, ndraft)

    @classmethod
    def from_file(cls, path: str | Path, kind: str = "cpu") -> SpecSchedule:
        """The file's schedule for `kind` ("cpu", "cpu_avx2" or "cuda"): its "schedule_cuda" or
        "schedule_avx2" where it has one, else its "schedule"."""
        schedules = cls.all_from_file(path)
        return schedules.get(kind, schedules["cpu"])

    @classmethod
    def all_from_file(cls, path: str | Path) -> dict[str, SpecSchedule]:
        """Every schedule in the file, checked: {"cpu": "schedule"} and, where present, {"cuda": ...}
        and {"cpu_avx2": ...}."""
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ScheduleError(f"{FLAG}: cannot read {path}: {e}") from e
        raw = data.get("schedule") if isinstance(data, dict) else None
        if not isinstance(raw, list) or not raw:
            raise ScheduleError(f'{FLAG}: {path} needs a non-empty "schedule" list')
        schedules = {"cpu": cls._parse(raw, "")}
        for key, kind in SCHEDULE_KEYS.items():
            if key in data:
                raw_kind = data[key]
                if not isinstance(raw_kind, list) or not raw_kind:
                    raise ScheduleError(f'{FLAG}: {path}: "{key}" must be a non-empty list')
                schedules[kind] = cls._parse(raw_kind, f"{key} ")
        return schedules

    @classmethod
    def _parse(cls, raw: list, which: str) -> SpecSchedule:
        entries: list[tuple[int | None, SpecShape]] = []
        last = 0
        for i, e in enumerate(raw):
            where = f"{FLAG} {which}entry {i}"
            try:
                bound = e.get("max_batch_size")
                steps = int(e["num_steps"])
                topk = int(e.get("eagle_topk", 1)) if steps else 1
                ndraft = int(e.get("num_draft_tokens", steps + 1)) if steps else 1
                min_accept = float(e.get("ngram_min_accept_prob", 0.0))
            except (AttributeError, KeyError, TypeError, ValueError) as err:
                raise ScheduleError(f"{where}: {err!r}") from err
            if not 0.0 <= min_accept < 1.0:
                raise ScheduleError(f"{where}: ngram_min_accept_prob must be in [0, 1)")
            if bound is not None and (not isinstance(bound, int) or bound <= last):
                raise ScheduleError(f"{where}: max_batch_size must increase and be a positive integer")
            if entries and entries[-1][0] is None:
                raise ScheduleError(f"{where}: comes after an entry without max_batch_size")
            validate_shape(steps, topk, ndraft, where)
            entries.append((bound, SpecShape(steps, topk, ndraft, min_accept)))
            last = bound or last
        return cls(entries)

    def shape_for(self, batch_size: int) -> SpecShape:
        for bound, shape in self.entries:
            if bound is None or batch_size <= bound:
                return shape
        return SpecShape(0, 1, 1)  # past the last range: plain decoding
