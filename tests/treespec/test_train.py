"""treespec.train on a tiny random target and a tiny ShareGPT-format file."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from tests.treespec.speculative.eagle_test_models import random_target
from treespec.engine import Engine
from treespec.models.draft_loader import load_draft_model
from treespec.train.__main__ import main as train_main
from treespec.train.data import load_conversations, split_conversations
from treespec.train.features import compute_features, load_target
from treespec.train.trainer import TrainConfig, train

torch.set_num_threads(1)
HOLDOUT_TOKENS = range(200, 256)  # only the held-out conversations use these words


def _words(rng: random.Random, lo: int, hi: int, n: int) -> str:
    start = rng.randrange(lo, hi)
    # mostly a counting pattern, so there is something to learn
    return " ".join(f"t{lo + (start + i * 3 + (rng.random() < 0.1)) % (hi - lo)}" for i in range(n))


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("train")
    target = random_target(root / "target")
    tok = AutoTokenizer.from_pretrained(str(target))
    tok.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    tok.save_pretrained(str(target))
    rng = random.Random(0)
    convs = [{"id": str(i), "conversations": [{"from": "human", "value": _words(rng, 1, 150, 12)},
                                              {"from": "gpt", "value": _words(rng, 1, 150, 24)}]} for i in range(40)]
    convs += [{"id": f"h{i}", "conversations": [{"from": "human", "value": _words(rng, 200, 256, 12)},
                                                {"from": "gpt", "value": _words(rng, 200, 256, 12)}]} for i in range(8)]
    data = root / "sharegpt.json"
    text = json.dumps(convs, indent=1)
    data.write_text(text[: len(text) - 40])  # cut mid-record, like the wheel's file
    return {"root": root, "target": target, "data": data, "tok": tok}


def _examples(setup, n: int = 32) -> list[dict]:
    from treespec.train.data import format_conversation

    train_pool, _ = split_conversations(load_conversations(setup["data"]), 7)
    return [format_conversation(setup["tok"], c, 64) for c in train_pool[:n]]


def test_truncated_file_and_holdout_split(setup) -> None:
    convs = load_conversations(setup["data"])
    assert len(convs) == 47  # the cut record is dropped
    train_pool, held = split_conversations(convs, 7)
    assert len(held) == 7 and all("t2" in c[0]["content"] for c in held)
    for e in _examples(setup, 100):
        assert not any(t in HOLDOUT_TOKENS for t in e["input_ids"])
        assert any(e["loss_mask"]) and len(e["loss_mask"]) == len(e["input_ids"])


@pytest.mark.parametrize("algorithm", ["EAGLE3", "EAGLE"])
def test_training_reduces_loss_and_resumes_exactly(setup, tmp_path: Path, algorithm: str) -> None:
    examples = _examples(setup)
    target = load_target(setup["target"], 256)
    capture = [2, 2, 1] if algorithm == "EAGLE3" else []
    feats = compute_features(target, examples, capture, tmp_path / "f")
    again = compute_features(target, examples, capture, tmp_path / "f")  # from the cache
    assert torch.equal(again.final, feats.final)
    cfg = TrainConfig(algorithm=algorithm, steps=40, batch_size=4, lr=3e-3, warmup=5, ttt_steps=3,
                      draft_vocab_size=128, save_every=10)
    first = train(cfg, target, examples, feats, tmp_path / "a.pt", False, 256, progress=False)
    hist = first.history
    assert torch.equal(first.vocab_ids, torch.load(tmp_path / "a.pt", weights_only=False)["vocab_ids"])
    assert first.vocab_ids.numel() == 128 and bool((first.vocab_ids.diff() > 0).all())
    assert sum(hist[-5:]) / 5 < (0.9 if algorithm == "EAGLE3" else 0.97) * sum(hist[:5]) / 5
    # interrupted after 13 steps, resumed to 20: same step, data position and weights as straight through
    cfg.steps = 20
    full = train(cfg, target, examples, feats, tmp_path / "b.pt", False, 256, progress=False)
    stopped = train(cfg, target, examples, feats, tmp_path / "d.pt", False, 256, progress=False, stop_at=0)
    assert stopped.history == []  # --stop-after 0: no step (exports a checkpoint's head as it is)
    train(cfg, target, examples, feats, tmp_path / "c.pt", False, 256, progress=False, stop_at=13)
    assert torch.load(tmp_path / "c.pt", weights_only=False)["step"] == 13
    resumed = train(cfg, target, examples, feats, tmp_path / "c.pt", True, 256, progress=False)
    b, c = (torch.load(tmp_path / p, weights_only=False) for p in ("b.pt", "c.pt"))
    assert b["step"] == c["step"] == 20 and b["data"] == c["data"]
    assert torch.equal(full.vocab_ids, resumed.vocab_ids)
    assert torch.allclose(torch.tensor(full.history), torch.tensor(resumed.history), atol=1e-5)
    for name, t in full.model.state_dict().items():
        assert torch.allclose(t.float(), resumed.model.state_dict()[name].float(), atol=1e-6), name


def test_cli_self_distill_head_runs_in_engine(setup, tmp_path: Path) -> None:
    out = tmp_path / "head"
    train_main(["--algorithm", "EAGLE3", "--target-model-path", str(setup["target"]), "--data", str(setup["data"]),
                "--num-conversations", "16", "--holdout", "7", "--max-new-tokens", "16", "--max-seq-len", "64",
                "--steps", "6", "--batch-size", "4", "--ttt-steps", "2", "--draft-vocab-size", "64",
                "--output", str(out), "--checkpoint-dir", str(tmp_path / "ck"), "--distill-batch", "8"])
    head = load_draft_model(out, "EAGLE3", 256)
    assert head.draft_vocab_size == 64 and int(head.t2d.sum()) == 64
    prompts = [[3, 5, 7, 9, 11], [40, 41, 42, 43, 44, 45]]
    params = {"max_new_tokens": 12, "temperature": 0}
    plain = Engine(str(setup["target"]), dtype="float32", max_total_tokens=2048)
    spec = Engine(str(setup["target"]), dtype="float32", max_total_tokens=2048, speculative_algorithm="EAGLE3",
                  speculative_draft_model_path=str(out), speculative_num_steps=3, speculative_eagle_topk=2,
                  speculative_num_draft_tokens=5)
    want = [o["output_ids"] for o in plain.generate(input_ids=prompts, sampling_params=params)]
    got = [o["output_ids"] for o in spec.generate(input_ids=prompts, sampling_params=params)]
    assert got == want
    # a rerun finds the self-distilled replies and the finished checkpoint and does not redo them
    train_main(["--algorithm", "EAGLE3", "--target-model-path", str(setup["target"]), "--data", str(setup["data"]),
                "--num-conversations", "16", "--holdout", "7", "--max-new-tokens", "16", "--max-seq-len", "64",
                "--steps", "6", "--batch-size", "4", "--ttt-steps", "2", "--draft-vocab-size", "64",
                "--checkpoint-dir", str(tmp_path / "ck"), "--resume", "--distill-batch", "8"])
    assert torch.load(tmp_path / "ck" / "checkpoint.pt", weights_only=False)["step"] == 6
    # the reply cache is named by generation dtype: bf16 greedy replies are a different data set
    assert [f.name.rsplit("-", 1)[1] for f in tmp_path.glob("distill-*.jsonl")] == ["float32.jsonl"]
    with pytest.raises(SystemExit):
        train_main(["--distill-dtype", "bf16"])  # argparse names the flag and the allowed values


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error a host without CUDA gives")
def test_cli_device_errors_name_the_flag() -> None:
    for device, why in (("cuda", "CUDA was requested but is not available"), ("tpu", "unknown device 'tpu'")):
        with pytest.raises(SystemExit, match=f"--device: {why}"):
            train_main(["--device", device])


def test_cli_eagle_head_writes_its_token_map(setup, tmp_path: Path) -> None:
    """An EAGLE head comes with the hot-token list its CE was trained over; the engine drafts with it."""
    from treespec.models.draft_loader import load_token_map

    out = tmp_path / "head"
    train_main(["--algorithm", "EAGLE", "--target-model-path", str(setup["target"]), "--data", str(setup["data"]),
                "--num-conversations", "16", "--holdout", "7", "--max-new-tokens", "16", "--max-seq-len", "64",
                "--steps", "4", "--batch-size", "4", "--draft-vocab-size", "64",
                "--output", str(out), "--checkpoint-dir", str(tmp_path / "ck"), "--distill-batch", "8"])
    ids = load_token_map(out / "token_map.pt", 256)
    assert torch.equal(ids, torch.load(tmp_path / "ck" / "checkpoint.pt", weights_only=False)["vocab_ids"])
    assert ids.numel() == 64
    prompts, params = [[3, 5, 7, 9, 11], [40, 41, 42, 43, 44, 45]], {"max_new_tokens": 12, "temperature": 0}
    plain = Engine(str(setup["target"]), dtype="float32", max_total_tokens=2048)
    spec = Engine(str(setup["target"]), dtype="float32", max_total_tokens=2048, speculative_algorithm="EAGLE",
                  speculative_draft_model_path=str(out), speculative_token_map=str(out / "token_map.pt"),
                  speculative_num_steps=3, speculative_eagle_topk=2, speculative_num_draft_tokens=5)
    assert spec.scheduler.spec_worker.draft.model.head_weight.shape[0] == 64
    want = [o["output_ids"] for o in plain.generate(input_ids=prompts, sampling_params=params)]
    assert [o["output_ids"] for o in spec.generate(input_ids=prompts, sampling_params=params)] == want


def test_cli_trains_a_head_further_on_conversations_it_has_not_seen(setup, tmp_path: Path, monkeypatch) -> None:
    """--init-head + --skip-conversations: the head starts from the given weights, keeps its draft
    vocabulary, trains on the next slice of the pool, and the reply cache is keyed by pool index.
    Self-distillation decodes without speculation (same greedy replies, no draft work per step)."""
    import treespec.engine
    from treespec.train.data import prompt_ids
    from treespec.train.trainer import load_init_head

    engine_kwargs: list[dict] = []

    def recording_engine(*a, **kw):
        engine_kwargs.append(kw)
        return Engine(*a, **kw)

    monkeypatch.setattr(treespec.engine, "Engine", recording_engine)

    common = ["--algorithm", "EAGLE3", "--target-model-path", str(setup["target"]), "--data", str(setup["data"]),
              "--holdout", "7", "--max-new-tokens", "16", "--max-seq-len", "64", "--batch-size", "4",
              "--ttt-steps", "2", "--draft-vocab-size", "64", "--distill-batch", "8"]
    first, second = tmp_path / "first", tmp_path / "second"
    train_main([*common, "--num-conversations", "16", "--steps", "4", "--output", str(first),
                "--checkpoint-dir", str(tmp_path / "ck1")])
    train_main([*common, "--skip-conversations", "16", "--num-conversations", "8", "--steps", "4",
                "--init-head", str(first), "--output", str(second), "--checkpoint-dir", str(tmp_path / "ck2")])
    assert len(engine_kwargs) == 2 and all(kw["speculative_algorithm"] == "NONE" for kw in engine_kwargs)
    a, b = load_draft_model(first, "EAGLE3", 256), load_draft_model(second, "EAGLE3", 256)
    assert torch.equal(a.d2t, b.d2t)  # the vocabulary of the head it started from, not one chosen anew
    assert not torch.equal(a.fc.weight, b.fc.weight)  # and it trained
    # the second run's reply cache holds conversations 16..23 of the pool under their pool indices
    (cache,) = tmp_path.glob("distill-*.jsonl")
    recs = [json.loads(line) for line in cache.read_text().splitlines()]
    assert sorted(r["idx"] for r in recs) == list(range(24))
    train_pool, _ = split_conversations(load_conversations(setup["data"]), 7)
    rec16 = next(r for r in recs if r["idx"] == 16)
    want = prompt_ids(setup["tok"], train_pool[16][0]["content"], 256)
    assert rec16["input_ids"][: len(want)] == want and rec16["loss_mask"][: len(want)] == [0] * len(want)
    # the starting point is the given head's weights exactly
    cfg = TrainConfig(algorithm="EAGLE3", draft_vocab_size=64)
    target = load_target(setup["target"], 256)
    start, vocab = load_init_head(cfg, first, target, 256, [])
    assert torch.equal(vocab, a.hot_token_map)
    for name, t in a.state_dict().items():
        if not name.startswith("rotary."):
            assert torch.equal(start.state_dict()[name], t.float()), name
    with pytest.raises(ValueError, match="does not match"):  # an EAGLE-3 head cannot start an EAGLE run
        load_init_head(TrainConfig(algorithm="EAGLE"), first, target, 256, [])
    with pytest.raises(SystemExit, match="--skip-conversations"):
        train_main([*common, "--skip-conversations", "40", "--checkpoint-dir", str(tmp_path / "ck3")])


@pytest.mark.parametrize("variant", ["EAGLE3", "EAGLE3-norm_before_residual", "EAGLE"])
def test_unrolled_training_forward_matches_the_inference_drafter(setup, variant: str) -> None:
    """Step 0 = draft extend; step j = the j-th draft decode step of the chain (prefix + ancestors)."""
    from treespec.attention.metadata import build_metadata
    from treespec.attention.torch_backend import TorchAttnBackend
    from treespec.forward_batch import ForwardBatch, ForwardContext, ForwardMode
    from treespec.mem.kv_pool import KVPool
    from treespec.models.draft_loader import create_draft_model
    from treespec.train.unroll import unroll

    target = load_target(setup["target"], 256)
    cfg = target.config
    algorithm = variant.split("-")[0]
    head = create_draft_model(algorithm, cfg, 256, draft_vocab_ids=torch.arange(0, 256, 2) if algorithm == "EAGLE3"
                              else None, init_std=0.1).eval()
    if variant.endswith("norm_before_residual"):  # a speculators head trained further: the residual after the norm
        head.midlayer.norm_before_residual = True
    head.set_target_weights(target.embed_tokens.weight, target.lm_head_weight)
    gen = torch.Generator().manual_seed(1)
    t, steps = 10, 3
    ids = torch.randint(0, 256, (1, t + steps), generator=gen)
    feats = torch.randn(1, t + steps, head.input_hidden_size, generator=gen)
    with torch.no_grad():
        outs = unroll(head, target.embed_tokens.weight, ids, feats, steps)
    ctx = ForwardContext(kv_pool=KVPool(64, 1, cfg.num_kv_heads, cfg.head_dim, torch.float32, torch.device("cpu")),
                         attn_backend=TorchAttnBackend(torch.device("cpu")))

    def run(mode, tok, pos, slots, kv, hidden):
        batch = ForwardBatch(mode=mode, input_ids=tok, positions=pos, out_cache_loc=slots,
                             attn=build_metadata([tok.numel()], [kv], None if mode == ForwardMode.DRAFT_EXTEND
                                                 else [torch.ones(1, kv.numel(), dtype=torch.bool)]),
                             input_hidden=hidden)
        ctx.attn_backend.init_forward_metadata(batch.attn)
        with torch.no_grad():
            return head(batch, ctx, return_all_hidden=True).hidden_states

    slots = torch.arange(t)
    h = run(ForwardMode.DRAFT_EXTEND, ids[0, 1 : t + 1], torch.arange(t), slots, slots, feats[0, :t])
    torch.testing.assert_close(outs[0][0, :t], h, atol=1e-4, rtol=1e-4)
    h = h[-1:]
    for j in range(1, steps):  # the chain from origin p = t-1
        kv = torch.arange(t + j)
        h = run(ForwardMode.DRAFT_DECODE, ids[0, t + j : t + j + 1], torch.tensor([t - 1 + j]), kv[-1:], kv, h)
        torch.testing.assert_close(outs[j][0, t - 1], h[0], atol=1e-4, rtol=1e-4)


def test_ngram_corpus_holds_the_models_greedy_replies_after_their_header(setup, tmp_path) -> None:
    """python -m treespec.train.ngram_corpus: per training-pool first turn from --skip-conversations on,
    the prompt's last --header-tokens then the model's greedy reply; never a held-out conversation."""
    from treespec.engine import Engine
    from treespec.speculative.ngram_corpus import load_corpus
    from treespec.train import ngram_corpus
    from treespec.train.data import prompt_ids

    out = tmp_path / "corpus.json.gz"
    ngram_corpus.main(["--model-path", str(setup["target"]), "--data", str(setup["data"]), "--holdout", "7",
                       "--skip-conversations", "36", "--num-replies", "6", "--max-new-tokens", "8",
                       "--header-tokens", "2", "--batch-size", "4", "--out", str(out)])
    texts = load_corpus(out, 256)
    train_pool, _ = split_conversations(load_conversations(setup["data"]), 7)
    firsts = [c[0]["content"] for c in train_pool[36:]]
    assert len(firsts) == 4 and len(texts) == 4  # the pool ends before the held-out seven
    engine = Engine(model_path=str(setup["target"]), speculative_algorithm="NONE")
    for text, first in zip(texts, firsts, strict=True):
        prompt = prompt_ids(engine.tokenizer, first, 768)
        reply = engine.generate(input_ids=prompt, sampling_params={"temperature": 0, "max_new_tokens": 8})
        assert text == prompt[-2:] + reply["output_ids"]
