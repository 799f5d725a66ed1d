"""Per-request adaptivity (speculative/adaptivity.py): a request whose head drafts keep failing stops
getting head nodes (and, when no request of the batch has drafts worth a verify, the step is a plain
one), probes again every HEAD_PROBE_EVERY steps, and its output stays equal to plain decoding; a request whose drafts hit
keeps drafting."""

from __future__ import annotations

from eagle_test_models import Lookup, lookup_eagle3_head, lookup_target, random_head, random_target

from treespec.engine import Engine
from treespec.forward_batch import ForwardMode
from treespec.speculative.adaptivity import HEAD_PROBE_EVERY, HeadRecord

PARAMS = {"temperature": 0, "max_new_tokens": 48, "ignore_eos": True}
PROMPT = [5, 17, 99, 3, 42, 42, 7, 130]


def test_head_record_stops_probes_and_recovers() -> None:
    record = HeadRecord()
    assert record.drafts
    for _ in range(8):
        record = record.after_step(offered=True, accepted=0)
    assert not record.drafts
    for _ in range(HEAD_PROBE_EVERY - 1):
        record = record.after_step(offered=False, accepted=0)
        assert not record.drafts
    record = record.after_step(offered=False, accepted=0)
    assert record.drafts  # the probe
    record = record.after_step(offered=True, accepted=0)
    assert not record.drafts  # failed again
    for _ in range(HEAD_PROBE_EVERY):
        record = record.after_step(offered=False, accepted=0)
    for _ in range(3):
        record = record.after_step(offered=True, accepted=3)
    assert record.drafts  # the drafts hit again: it keeps drafting


def count_draft_steps(engine: Engine) -> list[int]:
    """Counts the draft tree forwards the engine runs from now on."""
    draft, counts = engine.scheduler.spec_worker.draft, [0]
    real = draft.forward

    def counting(batch):
        counts[0] += batch.mode == ForwardMode.DRAFT_DECODE
        return real(batch)

    draft.forward = counting
    return counts


def run(target, head, **kw) -> tuple[dict, int]:
    engine = Engine(model_path=str(target), dtype="float32", max_total_tokens=2048, speculative_algorithm="EAGLE3",
                    speculative_draft_model_path=str(head), speculative_num_steps=3, speculative_eagle_topk=1,
                    speculative_num_draft_tokens=4, **kw)
    counts = count_draft_steps(engine)
    out = engine.generate(input_ids=PROMPT, sampling_params=PARAMS)
    engine.check_pool_balance()
    return out, counts[0]


def test_failing_head_stops_drafting_and_stays_exact(tmp_path) -> None:
    target = random_target(tmp_path / "target", seed=3)
    head = random_head(tmp_path / "head", "EAGLE3", target, std=0.1)
    expect = Engine(model_path=str(target), dtype="float32").generate(input_ids=PROMPT, sampling_params=PARAMS)
    out, draft_forwards = run(target, head)
    assert out["output_ids"] == expect["output_ids"]
    # the head is dropped after a few failed steps; then plain steps, with a probe every HEAD_PROBE_EVERY
    steps = out["meta_info"].get("spec_verify_ct", 0)
    assert 0 < steps <= 8 + PARAMS["max_new_tokens"] // HEAD_PROBE_EVERY
    assert draft_forwards == 2 * steps


def test_hitting_head_keeps_drafting(tmp_path) -> None:
    lookup = Lookup(seed=1)
    target = lookup_target(tmp_path / "target", lookup, noise=0.07)
    head = lookup_eagle3_head(tmp_path / "head", lookup)
    out, draft_forwards = run(target, head)
    assert draft_forwards == 2 * out["meta_info"]["spec_verify_ct"]
