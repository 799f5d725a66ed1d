"""Lossless speculative sampling under a grammar: with EAGLE-3 and NGRAM speculation, constrained
sampled tokens follow the exact distribution of plain sampling restricted to the grammar's tokens (the
target's filtered distribution over the allowed tokens), by chi-square goodness of fit against the
distribution computed directly from the target with the same mask."""

from __future__ import annotations

import pytest
import torch
from eagle_test_models import Lookup, lookup_eagle3_head, lookup_target
from test_eagle_sampling_stats import filtered, goodness_of_fit
from transformers import LlamaForCausalLM

from treespec.engine import Engine

VOCAB, SAMPLES, PROMPT, HEAD_SCALE = 32, 2000, [3, 17, 9, 25, 4, 11], 0.1
# token strings are "t<id>": no allowed id has a digit 7, so no forbidden token prefixes an allowed one
ALLOWED = [t for t in range(1, VOCAB) if "7" not in str(t)]
GRAMMAR = {"ebnf": "root ::= tok+\ntok ::= " + " | ".join(f'"t{t}"' for t in ALLOWED)}
SETTINGS = [
    ("EAGLE3", {"speculative_num_steps": 3, "speculative_eagle_topk": 2, "speculative_num_draft_tokens": 6},
     {"temperature": 0.8, "top_p": 0.9}),
    ("NGRAM", {"speculative_num_draft_tokens": 6}, {"temperature": 1.0}),
]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("constrained_stats")
    lookup = Lookup(seed=2, vocab=VOCAB, draft_vocab=VOCAB // 2)
    return {"target": lookup_target(root / "target", lookup, noise=0.07, head_scale=HEAD_SCALE),
            "EAGLE3": lookup_eagle3_head(root / "eagle3", lookup, head_scale=HEAD_SCALE)}


@torch.no_grad()
def exact_joint(target_dir, params: dict, mask: torch.Tensor) -> torch.Tensor:
    """P(t1, t2) [V, V] of plain sampling with forbidden tokens at -inf before the filters."""
    model = LlamaForCausalLM.from_pretrained(str(target_dir), torch_dtype=torch.float32).eval()

    def next_probs(prefixes: torch.Tensor) -> torch.Tensor:
        return filtered(model(prefixes).logits[:, -1].masked_fill(~mask, float("-inf")), params)

    prompt = torch.tensor([PROMPT])
    p1 = next_probs(prompt)[0]
    p2 = next_probs(torch.cat([prompt.expand(VOCAB, -1), torch.arange(VOCAB).view(VOCAB, 1)], 1))
    return p1[:, None] * p2


@pytest.mark.parametrize("setting", SETTINGS, ids=lambda s: s[0])
def test_constrained_speculative_sampling_matches_plain_distribution(model_dirs, setting):
    algorithm, spec, params = setting
    if algorithm == "EAGLE3":
        spec = {**spec, "speculative_draft_model_path": str(model_dirs["EAGLE3"])}
    engine = Engine(model_path=str(model_dirs["target"]), dtype="float32", max_total_tokens=8192,
                    max_running_requests=128, speculative_algorithm=algorithm, **spec)
    # NGRAM drafts no deeper than a request may still emit: room for its whole tree at the first step
    max_new = 3 if algorithm != "NGRAM" else 1 + spec["speculative_num_draft_tokens"]
    sampling = [{**params, **GRAMMAR, "max_new_tokens": max_new, "ignore_eos": True, "seed": s} for s in range(SAMPLES)]
    outs = engine.generate(input_ids=[PROMPT] * SAMPLES, sampling_params=sampling)
    engine.check_pool_balance()
    tokens = torch.tensor([o["output_ids"] for o in outs])
    assert set(tokens.flatten().tolist()) <= set(ALLOWED)
    stats = engine.get_stats()
    accepted = stats["spec_emitted_tokens"] - stats["spec_verify_ct"]
    assert accepted > 0.1 * stats["spec_verify_ct"], stats  # drafts are accepted under the grammar
    mask = torch.zeros(VOCAB, dtype=torch.bool)
    mask[ALLOWED] = True
    observed = torch.zeros(VOCAB, VOCAB).index_put_((tokens[:, 0], tokens[:, 1]), torch.ones(SAMPLES),
                                                    accumulate=True)
    assert goodness_of_fit(observed, exact_joint(model_dirs["target"], params, mask)) > 1e-3
    # the test has power: the unmasked distribution (renormalised over the allowed tokens is what a
    # grammar must give; without the mask the forbidden tokens' mass is missing) is rejected
    assert goodness_of_fit(observed, exact_joint(model_dirs["target"], {**params, "temperature": 0.5}, mask)) < 1e-3
