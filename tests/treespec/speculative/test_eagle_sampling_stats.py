"""Lossless speculative sampling: with EAGLE / EAGLE-3 / NGRAM speculation the first sampled tokens follow
the exact distribution of plain sampling (temperature / top-k / top-p / min-p applied), by chi-square
goodness of fit against the distribution computed directly from the target."""

from __future__ import annotations

import pytest
import torch
from eagle_test_models import Lookup, lookup_eagle3_head, lookup_eagle_head, lookup_target
from scipy.stats import chisquare
from transformers import LlamaForCausalLM

from treespec.engine import Engine
from treespec.sampling import apply_sampling_filters

VOCAB, SAMPLES, PROMPT, HEAD_SCALE = 32, 2000, [3, 17, 9, 25, 4, 11], 0.1
SETTINGS = [  # (algorithm, (steps, topk, draft tokens), sampling params); NGRAM: the draft tokens only
    ("EAGLE", (5, 4, 16), {"temperature": 1.0}),
    ("EAGLE3", (3, 1, 4), {"temperature": 0.7, "top_p": 0.8}),
    ("EAGLE", (6, 8, 48), {"temperature": 1.3, "top_k": 12, "min_p": 0.05}),
    # n-gram trees: drafts from earlier samples' text, several children per node (distinct tokens)
    ("NGRAM", (None, None, 8), {"temperature": 0.8, "top_p": 0.9}),
    ("NGRAM", (None, None, 6), {"temperature": 1.2, "top_k": 10, "min_p": 0.02}),
    # hybrid: EAGLE-3 chains plus up to 5 n-gram nodes merged into one tree
    ("EAGLE3+NGRAM", (2, 1, 3), {"temperature": 0.7, "top_p": 0.8, "min_p": 0.01}),
]
HYBRID_TOKENS = 5


@pytest.fixture(autouse=True)
def head_drafts_every_step(monkeypatch):
    """Every step speculates (per-request adaptivity would turn plain steps on for low-acceptance
    settings): the checks below are about the tree sampler."""
    from treespec.speculative import adaptivity

    monkeypatch.setattr(adaptivity, "HEAD_MIN_ACCEPT", 0.0)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("eagle_stats")
    # A soft lookup pair: the target's distribution favours succ(current token) without being one-hot,
    # and the heads propose succ first, so drafts are often but not always accepted.
    lookup = Lookup(seed=2, vocab=VOCAB, draft_vocab=VOCAB // 2)
    return {"target": lookup_target(root / "target", lookup, noise=0.07, head_scale=HEAD_SCALE),
            "EAGLE": lookup_eagle_head(root / "eagle", lookup),
            "EAGLE3": lookup_eagle3_head(root / "eagle3", lookup, head_scale=HEAD_SCALE)}


def filtered(logits: torch.Tensor, params: dict) -> torch.Tensor:
    rows = logits.shape[0]
    return apply_sampling_filters(
        logits.float(), torch.full((rows,), float(params.get("temperature", 1.0))),
        torch.full((rows,), int(params.get("top_k", -1))), torch.full((rows,), float(params.get("top_p", 1.0))),
        torch.full((rows,), float(params.get("min_p", 0.0))))


@torch.no_grad()
def exact_distributions(target_dir, params: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """P(t1, t2) [V, V] and P(t3) [V] of plain sampling, from the transformers implementation."""
    model = LlamaForCausalLM.from_pretrained(str(target_dir), torch_dtype=torch.float32).eval()

    def next_probs(prefixes: torch.Tensor) -> torch.Tensor:
        return filtered(model(prefixes).logits[:, -1], params)

    prompt = torch.tensor([PROMPT])
    p1 = next_probs(prompt)[0]
    t1 = torch.arange(VOCAB).view(VOCAB, 1)
    p2 = next_probs(torch.cat([prompt.expand(VOCAB, -1), t1], 1))  # [t1, t2]
    pairs = torch.cartesian_prod(torch.arange(VOCAB), torch.arange(VOCAB))
    p3 = next_probs(torch.cat([prompt.expand(VOCAB * VOCAB, -1), pairs], 1)).view(VOCAB, VOCAB, VOCAB)
    joint12 = p1[:, None] * p2
    return joint12, (joint12[:, :, None] * p3).sum((0, 1))


def goodness_of_fit(observed: torch.Tensor, probs: torch.Tensor) -> float:
    """Chi-square p-value; cells expecting fewer than 5 samples are pooled into one."""
    expected = probs.flatten().double() * observed.sum()
    observed = observed.flatten().double()
    small = expected < 5
    obs = torch.cat([observed[~small], observed[small].sum().view(1)])
    exp = torch.cat([expected[~small], expected[small].sum().view(1)])
    keep = exp > 0
    return float(chisquare(obs[keep].numpy(), exp[keep].numpy() * obs[keep].sum().item() / exp[keep].sum().item()).pvalue)


def record_ngram_parents(engine: Engine) -> list[list[int]]:
    """The parent lists of every n-gram draft the engine makes from now on."""
    worker = engine.scheduler.spec_worker
    real_draft, parent_lists = worker._draft, []

    def recording_draft(*args):
        tokens, parents = real_draft(*args)
        parent_lists.append(parents)
        return tokens, parents

    worker._draft = recording_draft
    return parent_lists


@pytest.mark.parametrize("setting", SETTINGS, ids=lambda s: f"{s[0]}-{s[1]}-{'-'.join(map(str, s[2].values()))}")
def test_speculative_sampling_matches_plain_distribution(model_dirs, setting) -> None:
    algorithm, (steps, topk, draft_tokens), params = setting
    if algorithm == "NGRAM":
        spec = {"speculative_num_draft_tokens": draft_tokens}
        steps = draft_tokens - 1  # the deepest tree
    else:
        head = algorithm.removesuffix("+NGRAM")
        spec = {"speculative_draft_model_path": str(model_dirs[head]), "speculative_num_steps": steps,
                "speculative_eagle_topk": topk, "speculative_num_draft_tokens": draft_tokens}
        if algorithm != head:
            spec["speculative_hybrid_ngram_tokens"] = HYBRID_TOKENS
            steps += HYBRID_TOKENS  # the deepest hybrid tree
        algorithm = head
    engine = Engine(model_path=str(model_dirs["target"]), dtype="float32", max_total_tokens=8192,
                    max_running_requests=128, speculative_algorithm=algorithm, **spec)
    # NGRAM drafts no deeper than a request may still emit: room for its whole tree at the first step
    max_new = 4 if algorithm != "NGRAM" else 1 + draft_tokens
    sampling = [{**params, "max_new_tokens": max_new, "ignore_eos": True, "sampling_seed": seed} for seed in range(SAMPLES)]
    parent_lists = record_ngram_parents(engine) if algorithm == "NGRAM" else None
    outs = engine.generate(input_ids=[PROMPT] * SAMPLES, sampling_params=sampling)
    if parent_lists is not None:  # real trees: some node had several children
        assert any(len(set(parents)) < len(parents) for parents in parent_lists)
    tokens = torch.tensor([o["output_ids"] for o in outs])
    engine.check_pool_balance()
    # drafts are accepted and rejected: both paths of the walk are exercised (committed tokens beyond
    # one per verify step are accepted drafts; the length limit cuts a few)
    stats = engine.get_stats()
    accepted = stats["spec_emitted_tokens"] - stats["spec_verify_ct"]
    assert 0.2 * stats["spec_verify_ct"] < accepted < 0.8 * stats["spec_verify_ct"] * steps
    if "speculative_hybrid_ngram_tokens" in spec:  # n-gram nodes were accepted too
        assert stats.get("spec_accepted_drafts_ngram", 0) > 0.05 * accepted

    joint12, p3 = exact_distributions(model_dirs["target"], params)
    observed12 = torch.zeros(VOCAB, VOCAB).index_put_((tokens[:, 0], tokens[:, 1]), torch.ones(SAMPLES), accumulate=True)
    observed3 = torch.bincount(tokens[:, 2], minlength=VOCAB).float()
    assert goodness_of_fit(observed12, joint12) > 1e-3
    assert goodness_of_fit(observed3, p3) > 1e-3
    # the test has power: the same samples reject the unfiltered temperature-1 distribution
    wrong12, _ = exact_distributions(model_dirs["target"], {"temperature": 1.0 if params["temperature"] != 1.0 else 0.6})
    assert goodness_of_fit(observed12, wrong12) < 1e-3
