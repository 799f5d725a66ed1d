"""With topk > 1 the draft follows the real tree: the draft logits of every tree node equal those of
running the draft on that node's path alone (prefix KV + the path's own tokens, one at a time)."""

from __future__ import annotations

import pytest
import torch
from eagle_test_models import random_head, random_target

import treespec.speculative.eagle_worker as eagle_worker
from treespec.attention.metadata import build_metadata
from treespec.engine import Engine
from treespec.forward_batch import ForwardBatch, ForwardMode
from treespec.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("eagle_tree")
    target = random_target(root / "target")
    return {"target": target, "EAGLE": random_head(root / "eagle", "EAGLE", target, std=0.3),
            "EAGLE3": random_head(root / "eagle3", "EAGLE3", target, std=0.5)}


def path_alone_logits(worker, prefix_slots: torch.Tensor, start_hidden: torch.Tensor, path: list[int]) -> torch.Tensor:
    """Draft logits after each token of `path`, run as a plain chain: one row per forward, causal
    attention over the prefix and the path's own earlier KV (fresh slots, given back afterwards)."""
    draft, allocator = worker.draft, worker.allocator
    slots = allocator.alloc(len(path))
    hidden, kv_len, out_logits = start_hidden.view(1, -1), prefix_slots.numel(), []
    try:
        for depth, token in enumerate(path):
            batch = ForwardBatch(
                mode=ForwardMode.DRAFT_DECODE, input_ids=torch.tensor([token]),
                positions=torch.tensor([kv_len + depth]), out_cache_loc=slots[depth : depth + 1],
                attn=build_metadata([1], [torch.cat([prefix_slots, slots[: depth + 1]])]), input_hidden=hidden)
            out = draft.forward(batch)
            hidden = out.hidden_states
            out_logits.append(out.logits[0])
    finally:
        allocator.free(slots)
    return torch.stack(out_logits)


def record_draft_steps(worker, rids: list[str], monkeypatch) -> list:
    """Wrap the worker's draft tree steps so that each one records (rids, token path of every frontier
    row [bs, k, s+1], the row's draft logits [bs, k, V]). Paths are read back from the scratch slots:
    each step writes its rows' tokens at step_slots[-1], and a row's branch lists its ancestors' slots."""
    records, pending, slot_token = [], [], {}
    real_batch, real_forward = eagle_worker.draft_tree_step_batch, worker.draft.forward

    def recording_batch(input_ids, hidden, positions, prefix_slots, step_slots, branch_slots, device):
        slot_token.update(zip(step_slots[-1].reshape(-1).tolist(), input_ids.reshape(-1).tolist(), strict=True))
        pending.append(torch.tensor([[[slot_token[s] for s in row] for row in req]
                                     for req in branch_slots.tolist()]))
        return real_batch(input_ids, hidden, positions, prefix_slots, step_slots, branch_slots, device)

    def recording_forward(batch):
        out = real_forward(batch)
        if batch.mode == ForwardMode.DRAFT_DECODE:
            paths = pending.pop()
            records.append((rids, paths, out.logits.view(*paths.shape[:2], -1).cpu().clone()))
        return out

    monkeypatch.setattr(eagle_worker, "draft_tree_step_batch", recording_batch)
    monkeypatch.setattr(worker.draft, "forward", recording_forward)
    return records


def draft_one_step(engine: Engine, prompts: list[list[int]], monkeypatch) -> tuple[list, dict, dict]:
    """Prefill the prompts, then run one speculative step recording the draft rows. Returns the
    records, each request's prefix slots and its draft state before the step."""
    sched = engine.scheduler
    worker = sched.spec_worker
    params = SamplingParams(temperature=0, max_new_tokens=64, ignore_eos=True)
    reqs = [sched.add_request(f"r{i}", p, params) for i, p in enumerate(prompts)]
    while len(sched.running) < len(reqs):
        sched.step()
    worker.catch_up(reqs)  # the prompts' draft extend (deferred) runs first, as the step would run it
    prefixes = {r.rid: sched.req_to_token_pool.read(r.req_pool_idx, 0, r.kv_len).clone() for r in reqs}
    states = {rid: (logits.clone(), hidden.clone()) for rid, (logits, hidden) in worker.draft_states.items()}
    with monkeypatch.context() as patch:
        records = record_draft_steps(worker, [r.rid for r in sched.running], patch)
        sched.step()
    return records, prefixes, states


def check_records(engine: Engine, records, prefixes, states) -> tuple[int, float]:
    """Compare every recorded row with its path run alone; returns (rows checked, worst difference
    relative to the row's largest logit: a random EAGLE-1 head feeding its own unnormalised output back
    grows its logits step by step)."""
    worker = engine.scheduler.spec_worker
    rows, worst = 0, 0.0
    for rids, paths, logits in records:  # one record per draft step
        for b, rid in enumerate(rids):
            for r in range(paths.shape[1]):
                path = paths[b, r].tolist()
                alone = path_alone_logits(worker, prefixes[rid], states[rid][1], path)[-1]
                scale = float(logits[b, r].abs().max())
                worst = max(worst, float((alone - logits[b, r]).abs().max()) / scale)
                rows += 1
    return rows, worst


@pytest.mark.parametrize("algorithm", ["EAGLE", "EAGLE3"])
def test_tree_draft_logits_equal_path_alone(model_dirs, algorithm, monkeypatch) -> None:
    engine = Engine(model_path=str(model_dirs["target"]), dtype="float32", max_total_tokens=2048,
                    speculative_algorithm=algorithm, speculative_draft_model_path=str(model_dirs[algorithm]),
                    speculative_num_steps=5, speculative_eagle_topk=4, speculative_num_draft_tokens=16)
    records, prefixes, states = draft_one_step(engine, [[3, 14, 15, 92, 65, 35], [8, 9, 7, 9, 3, 2, 3, 8, 4, 6, 2]],
                                                  monkeypatch)
    assert len(records) == 4  # num_steps - 1 draft forwards
    rows, worst = check_records(engine, records, prefixes, states)
    assert rows == 4 * 2 * 4
    assert worst < 1e-5, worst


def test_column_attention_would_be_caught(model_dirs, monkeypatch) -> None:
    """Control: if each draft row attended to its own column of scratch slots (the flaw described in
    the issue) instead of its ancestors, the comparison above fails."""
    real = eagle_worker.draft_tree_step_batch

    def column_attention(input_ids, hidden, positions, prefix_slots, step_slots, branch_slots, device):
        columns = step_slots.permute(1, 2, 0)  # [bs, k, s+1]: row r's own column at every step
        return real(input_ids, hidden, positions, prefix_slots, step_slots, columns, device)

    monkeypatch.setattr(eagle_worker, "draft_tree_step_batch", column_attention)
    engine = Engine(model_path=str(model_dirs["target"]), dtype="float32", max_total_tokens=2048,
                    speculative_algorithm="EAGLE3", speculative_draft_model_path=str(model_dirs["EAGLE3"]),
                    speculative_num_steps=5, speculative_eagle_topk=4, speculative_num_draft_tokens=16)
    records, prefixes, states = draft_one_step(engine, [[3, 14, 15, 92, 65, 35], [8, 9, 7, 9, 3, 2, 3, 8, 4, 6, 2]],
                                                  monkeypatch)
    _, worst = check_records(engine, records, prefixes, states)
    assert worst > 1e-3
