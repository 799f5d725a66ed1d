"""NGRAM speculation (drafts from the shared n-gram cache, no draft model) inside the scheduler: greedy
output equals plain decoding token for token at batch 1 and 4 (fp32) whether drafts are accepted or
rejected; one request's text changes another's drafts, never its output; chunked prefill, stop tokens,
a tight pool (shrunk trees, retraction) and aborts keep the KV pool balanced after every step."""

from __future__ import annotations

import random

import pytest
from eagle_test_models import Lookup, lookup_target, random_target

from treespec.engine import Engine
from treespec.sampling_params import SamplingParams
from treespec.speculative import ngram_worker
from treespec.speculative.ngram_cache import NgramCache


def make_prompts(count: int, seed: int) -> list[list[int]]:
    """Half the prompts repeat a phrase (their own n-grams predict them), half are random."""
    rng = random.Random(seed)
    prompts = []
    for i in range(count):
        if i % 2 == 0:
            phrase = [rng.randrange(256) for _ in range(rng.randrange(3, 7))]
            prompts.append(phrase * 3 + [rng.randrange(256) for _ in range(rng.randrange(0, 4))])
        else:
            prompts.append([rng.randrange(256) for _ in range(rng.randrange(2, 20))])
    return prompts


PROMPTS = make_prompts(12, seed=0)
PARAMS = [{"temperature": 0, "max_new_tokens": 24 + 3 * (i % 5), "ignore_eos": True} for i in range(len(PROMPTS))]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("ngram")
    # lookup: the target mostly follows a fixed successor function, so its output cycles and its own
    # n-grams predict it; random: drafts from the prompts' phrases are mostly wrong
    return {"lookup": lookup_target(root / "lookup", Lookup(seed=0), noise=0.07),
            "random": random_target(root / "random", seed=5)}


def engine_for(model_dirs, kind: str, ngram: bool, **kwargs) -> Engine:
    spec = {"speculative_algorithm": "NGRAM" if ngram else "NONE"}
    if ngram:  # SGLang's minimum match (the default is 2): more drafts, more of them rejected
        spec["speculative_ngram_min_match_window_size"] = kwargs.pop("speculative_ngram_min_match_window_size", 1)
    return Engine(model_path=str(model_dirs[kind]), dtype="float32",
                  max_total_tokens=kwargs.pop("max_total_tokens", 4096), **spec, **kwargs)


def run_all(engine: Engine, batch_size: int, prompts=PROMPTS, params=PARAMS) -> list[list[int]]:
    outs: list[list[int]] = []
    for i in range(0, len(prompts), batch_size):
        res = engine.generate(input_ids=prompts[i : i + batch_size], sampling_params=params[i : i + batch_size])
        outs += [r["output_ids"] for r in res]
        engine.check_pool_balance()
    return outs


def record_drafts(engine: Engine) -> list[list[int]]:
    """Record the draft tokens of every request at every step (wraps the worker's drafting)."""
    worker = engine.scheduler.spec_worker
    drafts: list[list[int]] = []
    real_draft = worker._draft

    def recording_draft(*args):
        tokens, parents = real_draft(*args)
        drafts.append(list(tokens))
        return tokens, parents

    worker._draft = recording_draft
    return drafts


def drive(engine: Engine, on_step=None) -> None:
    """Step the scheduler until idle, checking the pool balance after every step."""
    sched = engine.scheduler
    steps = 0
    while sched.has_work():
        sched.step()
        steps += 1
        sched.check_pool_balance()
        if on_step is not None:
            on_step(steps)
    sched.check_pool_balance()


@pytest.fixture(scope="module")
def references(model_dirs) -> dict:
    return {kind: run_all(engine_for(model_dirs, kind, ngram=False), batch_size=4) for kind in ("lookup", "random")}


@pytest.mark.parametrize("min_match", [1, 2], ids=["match1", "match2-default"])
@pytest.mark.parametrize(("draft_tokens", "min_accept"), [(None, None), (8, None), (8, 0.4)],
                         ids=["default-4", "draft8", "draft8-min-accept"])
@pytest.mark.parametrize("kind", ["lookup", "random"])
def test_greedy_ngram_matches_plain_decoding(model_dirs, references, kind, draft_tokens, min_accept, min_match) -> None:
    engine = engine_for(model_dirs, kind, ngram=True, speculative_num_draft_tokens=draft_tokens,
                        speculative_ngram_min_match_window_size=min_match,
                        speculative_ngram_min_accept_prob=min_accept)
    assert engine.server_args.speculative_num_draft_tokens == (draft_tokens or 4)
    drafts = record_drafts(engine)
    ragged = []  # per batch-4 verify: whether requests' trees differed in size (padding left out of the forward)
    real_tree = ngram_worker.tree_from_parents

    def recording_tree(*args):
        tree = real_tree(*args)
        ragged.append(tree.ragged)
        return tree

    for batch_size in (1, 4):
        ragged.clear()
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(ngram_worker, "tree_from_parents", recording_tree)
            assert run_all(engine, batch_size) == references[kind], f"batch size {batch_size}"
    stats = engine.get_stats()
    proposed = sum(len(d) for d in drafts)
    accepted = stats["spec_emitted_tokens"] - stats["spec_verify_ct"]
    assert proposed > 0 and stats["spec_shrunk_steps"] == 0
    assert any(ragged), "no batch-4 step verified trees of different sizes"
    if kind == "lookup":  # drafts are accepted: the test has power
        assert stats["avg_spec_accept_length"] > 1.5, stats["avg_spec_accept_length"]
    elif min_match == 1 and min_accept is None:  # drafts proposed and mostly rejected (longer matches: fewer, better)
        assert accepted < 0.5 * proposed, (accepted, proposed)


def test_one_requests_text_changes_anothers_drafts_not_its_output(model_dirs, references) -> None:
    """Request A's text fills the shared cache with wrong successors of every token B will say; B's
    drafts change (and get rejected), B's output stays plain greedy decoding."""
    b_prompt, b_params = PROMPTS[1], PARAMS[1]
    b_plain = references["lookup"][1]
    wrong_pairs = [tok for v in sorted(set(b_plain)) for tok in (v, (v * 7 + 3) % 256)]
    a_prompt = (wrong_pairs * 3)[:300]
    runs = {}
    for mode in ("alone", "after_a"):
        engine = engine_for(model_dirs, "lookup", ngram=True)
        if mode == "after_a":
            engine.generate(input_ids=a_prompt, sampling_params={"temperature": 0, "max_new_tokens": 2})
        drafts = record_drafts(engine)
        out = engine.generate(input_ids=b_prompt, sampling_params=b_params)["output_ids"]
        engine.check_pool_balance()
        runs[mode] = (out, drafts)
    assert runs["alone"][0] == runs["after_a"][0] == b_plain
    assert runs["alone"][1] != runs["after_a"][1]
    assert sum(map(len, runs["after_a"][1])) > sum(map(len, runs["alone"][1]))


def test_no_draft_deeper_than_the_tokens_a_request_may_still_emit(model_dirs, references) -> None:
    """A step emits its accepted drafts and one more token, and max_new_tokens ends the request: near its
    end a request drafts at most (tokens left - 1) nodes, and with one token left it decodes plain. The
    outputs stay plain greedy decoding."""
    engine = engine_for(model_dirs, "lookup", ngram=True, speculative_num_draft_tokens=8)
    worker = engine.scheduler.spec_worker
    real_draft, seen = worker._draft, []

    def recording_draft(req, ids, own, max_drafts, min_accept):
        tokens, parents = real_draft(req, ids, own, max_drafts, min_accept)
        left = req.sampling_params.max_new_tokens - len(req.output_ids)
        seen.append((left, max_drafts, len(tokens)))
        return tokens, parents

    worker._draft = recording_draft
    assert run_all(engine, 1) == references["lookup"]
    assert all(drafted <= budget == min(7, left - 1) for left, budget, drafted in seen), seen
    assert all(left > 1 for left, _, _ in seen)  # one token left: a plain step, no verify
    assert any(left <= 7 and drafted == left - 1 for left, _, drafted in seen)  # the cap was reached


def test_flush_cache_forgets_the_shared_corpus(model_dirs, references) -> None:
    """/flush_cache (idle) empties the n-gram corpus too: after it, request A's text no longer shapes B's
    drafts, which are again what B alone gets; the pool balances and B's output is plain greedy."""
    b_prompt, b_params = PROMPTS[1], PARAMS[1]
    alone = engine_for(model_dirs, "lookup", ngram=True)
    alone_drafts = record_drafts(alone)
    alone.generate(input_ids=b_prompt, sampling_params=b_params)
    engine = engine_for(model_dirs, "lookup", ngram=True)
    engine.generate(input_ids=PROMPTS[0] * 3, sampling_params={"temperature": 0, "max_new_tokens": 2})
    assert len(engine.scheduler.spec_worker.cache) > 0
    assert engine.flush_cache()
    assert len(engine.scheduler.spec_worker.cache) == 0
    drafts = record_drafts(engine)
    out = engine.generate(input_ids=b_prompt, sampling_params=b_params)["output_ids"]
    assert out == references["lookup"][1]
    assert drafts == alone_drafts
    engine.check_pool_balance()


def write_corpus(path, texts, vocab_size=256):
    from treespec.speculative.ngram_corpus import save_corpus

    save_corpus(path, texts, vocab_size)
    return str(path)


def test_a_warm_corpus_changes_drafts_never_outputs_and_survives_a_flush(model_dirs, references, tmp_path) -> None:
    """--speculative-ngram-corpus: its texts are in the shared trie before any request, so they shape a
    request's drafts (here wrong successors of every token B says: more drafts, rejected) and never its
    output; after /flush_cache the trie holds the corpus again, and only it."""
    b_prompt, b_params = PROMPTS[1], PARAMS[1]
    b_plain = references["lookup"][1]
    wrong_pairs = [tok for v in sorted(set(b_plain)) for tok in (v, (v * 7 + 3) % 256)]
    corpus = write_corpus(tmp_path / "corpus.json.gz", [wrong_pairs * 3, wrong_pairs[::-1]])
    runs = {}
    for mode in ("none", "corpus"):
        engine = engine_for(model_dirs, "lookup", ngram=True, **({"speculative_ngram_corpus": corpus} if mode == "corpus" else {}))
        start_size = len(engine.scheduler.spec_worker.cache)
        drafts = record_drafts(engine)
        out = engine.generate(input_ids=b_prompt, sampling_params=b_params)["output_ids"]
        engine.check_pool_balance()
        runs[mode] = (out, list(drafts), start_size, engine)  # a copy: a later record_drafts wraps this one
    assert runs["none"][2] == 0 < runs["corpus"][2]
    assert runs["none"][0] == runs["corpus"][0] == b_plain
    assert sum(map(len, runs["corpus"][1])) > sum(map(len, runs["none"][1]))
    engine = runs["corpus"][3]
    assert len(engine.scheduler.spec_worker.cache) > runs["corpus"][2]  # B's text went in after it
    assert engine.flush_cache()
    assert len(engine.scheduler.spec_worker.cache) == runs["corpus"][2]
    drafts = record_drafts(engine)
    assert engine.generate(input_ids=b_prompt, sampling_params=b_params)["output_ids"] == b_plain
    assert drafts == runs["corpus"][1]  # the same drafts as right after start
    engine.check_pool_balance()


def test_a_corpus_beyond_the_capacity_keeps_its_last_texts(model_dirs, tmp_path) -> None:
    """The capacity bounds the corpus like any other text: the trie stays within it."""
    rng = random.Random(3)
    texts = [[rng.randrange(256) for _ in range(40)] for _ in range(30)]
    corpus = write_corpus(tmp_path / "big.json.gz", texts)
    engine = engine_for(model_dirs, "lookup", ngram=True, speculative_ngram_corpus=corpus,
                        speculative_ngram_capacity=500)
    cache = engine.scheduler.spec_worker.cache
    assert len(cache) == 500
    assert cache.has_match(texts[-1][:5], 0)  # the last text went in last: it stays


def test_a_corpus_for_another_vocabulary_is_refused_naming_the_flag(model_dirs, tmp_path) -> None:
    from treespec.args import ArgError

    other = write_corpus(tmp_path / "other.json.gz", [[1, 2, 3]], vocab_size=49152)
    with pytest.raises(ArgError, match="^--speculative-ngram-corpus: .*vocabulary of 49152 tokens, the model has 256"):
        engine_for(model_dirs, "lookup", ngram=True, speculative_ngram_corpus=other)
    broken = tmp_path / "broken.json.gz"
    broken.write_text("not gzip")
    with pytest.raises(ArgError, match="^--speculative-ngram-corpus: cannot read"):
        engine_for(model_dirs, "lookup", ngram=True, speculative_ngram_corpus=str(broken))


def test_chunked_prefill_stop_tokens_and_tight_pool(model_dirs, references) -> None:
    ref = references["lookup"]
    stop = [out[len(out) // 2] for out in ref[:4]]
    params = [{**p, "stop_token_ids": [s]} for p, s in zip(PARAMS[:4], stop, strict=True)]
    expected = [out[: out.index(s) + 1] for out, s in zip(ref[:4], stop, strict=True)]
    engine = engine_for(model_dirs, "lookup", ngram=True, chunked_prefill_size=5)
    got = engine.generate(input_ids=PROMPTS[:4], sampling_params=params)
    assert [g["output_ids"] for g in got] == expected
    engine.check_pool_balance()

    # admission that reserves almost nothing for future tokens: trees shrink and requests are retracted
    tight = engine_for(model_dirs, "lookup", ngram=True, max_total_tokens=110, schedule_conservativeness=0.05)
    got = tight.generate(input_ids=PROMPTS[4:12], sampling_params=PARAMS[4:12])
    assert [g["output_ids"] for g in got] == ref[4:12]
    stats = tight.get_stats()
    assert stats["spec_shrunk_steps"] > 0 and stats["num_retractions"] > 0
    tight.check_pool_balance()


def test_a_shrunk_tree_keeps_the_schedules_threshold(model_dirs, references, tmp_path) -> None:
    """When KV is short the Scheduler shrinks the step's chain; the schedule's n-gram threshold stays."""
    config = tmp_path / "spec.json"
    config.write_text('{"schedule": [{"max_batch_size": null, "num_steps": 7, "num_draft_tokens": 8, '
                      '"ngram_min_accept_prob": 0.3}]}')
    tight = engine_for(model_dirs, "lookup", ngram=True, max_total_tokens=110, schedule_conservativeness=0.05,
                       speculative_config=str(config))
    worker = tight.scheduler.spec_worker
    shapes, real_step = [], worker.decode_step

    def recording_step(reqs, shape):
        shapes.append(shape)
        return real_step(reqs, shape)

    worker.decode_step = recording_step
    got = tight.generate(input_ids=PROMPTS[4:12], sampling_params=PARAMS[4:12])
    assert [g["output_ids"] for g in got] == references["lookup"][4:12]
    shrunk = [s for s in shapes if s.num_draft_tokens < 8]
    assert shrunk and all(s.ngram_min_accept_prob == 0.3 for s in shapes)
    tight.check_pool_balance()


def test_aborts_mid_speculation_balance(model_dirs) -> None:
    engine = engine_for(model_dirs, "lookup", ngram=True, chunked_prefill_size=6)
    sched = engine.scheduler
    params = SamplingParams(temperature=0.8, max_new_tokens=30, ignore_eos=True)
    for i in range(5):
        sched.add_request(f"r{i}", PROMPTS[2 * i] + PROMPTS[2 * i + 1][:3], params)
    aborted = []

    def abort_some(step: int) -> None:
        if step == 2 and sched.chunked_req is not None:
            aborted.append(sched.abort_request(sched.chunked_req.rid))  # mid chunked prefill
        if step == 8 and sched.running:
            aborted.append(sched.abort_request(sched.running[0].rid))  # mid speculation
        if step == 9 and sched.waiting:
            aborted.append(sched.abort_request(sched.waiting[-1].rid))

    drive(engine, abort_some)
    assert len(aborted) >= 2 and all(o.finish_reason["type"] == "abort" for o in aborted)
    assert sched.stats["spec_emitted_tokens"] > sched.stats["spec_verify_ct"]  # drafts were accepted


@pytest.mark.parametrize("ngram", [False, True], ids=["plain", "ngram"])
def test_a_non_streamed_request_reports_its_first_token_and_its_end_only(model_dirs, references, ngram) -> None:
    """Req.stream: a streamed request's new tokens go out every step, a non-streamed one's at its first
    token and when it finishes (as SGLang); both carry the same tokens, those of plain decoding."""
    engine = engine_for(model_dirs, "lookup", ngram)
    sched = engine.scheduler
    outputs: dict[str, list] = {"streamed": [], "whole": []}
    for rid, stream in (("streamed", True), ("whole", False)):
        sched.add_request(rid, PROMPTS[0], SamplingParams(**PARAMS[0]), stream=stream)
    steps = 0
    while sched.has_work():
        for out in sched.step():
            outputs[out.rid].append(out)
        steps += 1
    sched.check_pool_balance()
    tokens = {rid: [t for out in outs for t in out.new_token_ids] for rid, outs in outputs.items()}
    assert tokens["streamed"] == tokens["whole"] == references["lookup"][0]
    assert [o.finished for o in outputs["whole"]] == [False, True] and len(outputs["whole"][0].new_token_ids) == 1
    assert len(outputs["streamed"]) == steps > 2  # one a step (the prefill samples the first token)
    assert not ngram or sched.stats["spec_emitted_tokens"] > sched.stats["spec_verify_ct"]


@pytest.mark.parametrize("ngram", [False, True], ids=["plain", "ngram"])
def test_stream_interval_sends_a_streamed_requests_tokens_in_groups(model_dirs, references, ngram) -> None:
    """--stream-interval 5: a streamed request's first token goes out alone, then its tokens once 5 or
    more are new, then the rest when it finishes; the same tokens as plain decoding."""
    engine = engine_for(model_dirs, "lookup", ngram, stream_interval=5)
    chunks = list(engine.generate(input_ids=PROMPTS[0], sampling_params=PARAMS[0], stream=True))
    assert chunks[-1]["output_ids"] == references["lookup"][0]
    lengths = [0] + [len(c["output_ids"]) for c in chunks]  # each chunk carries everything so far
    sizes = [b - a for a, b in zip(lengths, lengths[1:], strict=False)]
    assert sizes[0] == 1 and all(s >= 5 for s in sizes[1:-1]) and 1 <= sizes[-1] and len(sizes) >= 3
    engine.check_pool_balance()


def test_capacity_flag_bounds_the_shared_cache(model_dirs, references) -> None:
    engine = engine_for(model_dirs, "lookup", ngram=True, speculative_ngram_capacity=64,
                        speculative_ngram_branch_length=4)
    cache = engine.scheduler.spec_worker.cache
    assert isinstance(cache, NgramCache) and cache.config.capacity == 64
    assert run_all(engine, batch_size=4) == references["lookup"]
    assert len(cache) == 64  # full, and never above: every insert evicts down to the bound


def test_radix_cache_keys_on_tokens_under_ngram(model_dirs, references) -> None:
    """No draft KV, so no bigram keys: a repeated prompt hits all but its last token, same output."""
    engine = engine_for(model_dirs, "lookup", ngram=True)
    assert not engine.scheduler.cache.bigram_keys
    first = engine.generate(input_ids=PROMPTS[0], sampling_params=PARAMS[0])
    again = engine.generate(input_ids=PROMPTS[0], sampling_params=PARAMS[0])
    assert first["output_ids"] == again["output_ids"] == references["lookup"][0]
    assert again["meta_info"]["cached_tokens"] == len(PROMPTS[0]) - 1
    engine.check_pool_balance()


def test_schedule_speculates_only_where_it_says(model_dirs, references, tmp_path) -> None:
    """--speculative-config under NGRAM (the default model's tuned schedule has this form): a chain of 4
    nodes at batch 1, plain steps above. A batch of 4 that finishes together never verifies; the same
    prompts one at a time do; outputs equal plain decoding either way."""
    schedule = tmp_path / "ngram_schedule.json"
    schedule.write_text('{"schedule": [{"max_batch_size": 1, "num_steps": 3, "num_draft_tokens": 4},'
                        ' {"max_batch_size": null, "num_steps": 0}]}')
    engine = engine_for(model_dirs, "lookup", ngram=True, speculative_config=str(schedule))
    prompts, params = PROMPTS[:4], [{"temperature": 0, "max_new_tokens": 24, "ignore_eos": True}] * 4
    plain = run_all(engine_for(model_dirs, "lookup", ngram=False), 4, prompts, params)
    assert run_all(engine, 4, prompts, params) == plain
    assert engine.get_stats()["spec_verify_ct"] == 0
    assert run_all(engine, 1, prompts, params) == plain
    assert engine.get_stats()["spec_verify_ct"] > 0


def default_model_worker(kind: str, corpus: str | None = "none", **flags):
    """The default model's NGRAM worker (auto -> NGRAM with the shipped schedule), built without a model:
    a runner with only a device, its schedule kind ("cpu", "cpu_avx2", "cuda") and vocabulary size, no
    pools (enough for its schedule and n-gram cache). `corpus`: --speculative-ngram-corpus (default none:
    an empty shared trie; None: the shipped corpus)."""
    from types import SimpleNamespace

    import torch

    from treespec.args import ServerArgs
    from treespec.speculative.ngram_worker import NgramWorker

    runner = SimpleNamespace(device=torch.device("cuda" if kind == "cuda" else "cpu"), schedule_kind=lambda: kind,
                             config=SimpleNamespace(vocab_size=49152))
    return NgramWorker(ServerArgs(speculative_ngram_corpus=corpus, **flags).resolve(), runner, None, None)


@pytest.mark.parametrize(("kind", "flags", "want"), [
    ("cpu", {}, 1), ("cuda", {}, 2),  # the CPU schedule has thresholds; the CUDA one fills its budget
    ("cpu", {"speculative_ngram_min_accept_prob": 0.0}, 2), ("cuda", {"speculative_ngram_min_accept_prob": 0.2}, 1),
    ("cpu", {"speculative_ngram_min_match_window_size": 3}, 3)])
def test_the_minimum_match_follows_the_thresholds_unless_given(kind, flags, want) -> None:
    """--speculative-ngram-min-match-window-size unset: 1 where draft nodes need an estimated acceptance
    (a schedule entry's threshold or the flag's), 2 where trees fill their node budget; set: as given."""
    assert default_model_worker(kind, corpus="none", **flags).config.min_match_window == want


@pytest.mark.parametrize(("kind", "nodes", "min_accept", "max_speculating_batch"),
                         [("cpu", (12, 8), (0.2, 0.7), 16), ("cpu_avx2", (8, 8), (0.5, 0.5), 4),
                          ("cuda", (8, 8), (0.0, 0.0), 4)])
def test_worker_takes_the_shipped_schedule_for_its_device(kind, nodes, min_accept, max_speculating_batch) -> None:
    """The default model's tuned file holds a CPU, a CPU-with-AVX2-kernels and a CUDA schedule; the worker
    picks by its runner's schedule kind (no CUDA needed: the worker only asks it when it is built).
    nodes and min_accept: at batch 1 and at the largest batch that speculates."""
    worker = default_model_worker(kind, corpus=None)
    assert len(worker.cache) > 0  # the shipped warm corpus went in
    for batch, want_nodes, want_accept in zip((1, max_speculating_batch), nodes, min_accept, strict=True):
        shape = worker.schedule.shape_for(batch)
        assert (shape.num_draft_tokens, worker.min_accept_prob(shape)) == (want_nodes, want_accept)
    assert worker.schedule.shape_for(max_speculating_batch + 1).num_steps == 0


def test_the_acceptance_threshold_decides_between_a_plain_step_and_a_verify() -> None:
    """A request whose best draft node is estimated below the threshold gets a plain step; the flag
    overrides the schedule's threshold."""
    from types import SimpleNamespace

    from treespec.speculative.ngram_cache import continuation_accept_prob

    worker = default_model_worker("cpu")
    shape = worker.schedule.shape_for(1)
    req = SimpleNamespace(rid="a", all_ids=[11, 12, 13, 11, 12, 14, 11, 12], kv_len=7, seq_len=8,
                          output_ids=[0], sampling_params=SimpleNamespace(max_new_tokens=64))
    worker.after_prefill([req], [7], None, None)
    # (11, 12) went on as 13 once and 14 once: each half of the 2-token match's estimate (0.28)
    estimate = continuation_accept_prob(2) / 2
    assert worker.wants_drafts([req], shape) == (estimate >= shape.ngram_min_accept_prob)
    worker.min_accept_prob_flag = estimate + 0.02
    assert not worker.wants_drafts([req], shape)
    worker.min_accept_prob_flag = estimate - 0.02
    assert worker.wants_drafts([req], shape)
    req.all_ids += [14, 11, 12, 14, 11]  # (12, 14, 11) has always gone on as 12: a 3-token match
    worker.min_accept_prob_flag = estimate + 0.02
    assert worker.wants_drafts([req], shape)


def test_plain_step_tokens_wait_for_the_next_draft_or_the_release() -> None:
    """Under load the schedule decodes plain: those tokens go into the request's own trie in one run when
    it next asks for drafts, not one by one after every forward. When it leaves, its whole text waits
    for an idle moment, then goes into the shared trie, where other requests draft from it."""
    from types import SimpleNamespace

    worker = default_model_worker("cpu")
    shape = worker.schedule.shape_for(1)
    req = SimpleNamespace(rid="a", all_ids=[11, 12, 13, 14, 15, 16], kv_len=5, seq_len=6,
                          output_ids=[0], sampling_params=SimpleNamespace(max_new_tokens=64))
    worker.after_prefill([req], [5], None, None)  # the prompt and the first sampled token
    own = worker.text["a"]
    assert len(own.cache) == 0 and own.cursor.length == 0  # nothing until it asks for drafts
    for token in (17, 18):  # two plain steps
        req.all_ids.append(token)
        worker.defer_extend([req], [token], None, None)
    assert len(own.cache) == 0 and own.cursor.length == 0  # nothing yet
    assert not worker.wants_drafts([req], shape)  # no 2-token match for (17, 18) before it catches up: none after
    assert own.cursor.length == 8 and len(own.cache) > 0 and len(worker.cache) == 0  # its own trie only
    req.all_ids += [11, 12]
    assert worker.wants_drafts([req], shape)  # (11, 12) is in its own text: 13 follows
    req.all_ids += [13, 14]  # a verify step committed two tokens: they wait for the next step too
    worker.draft_extend([req], None, [2])
    assert own.cursor.length == 10
    assert worker.wants_drafts([req], shape) and own.cursor.length == 12  # (13, 14) went on as 15 before
    req.all_ids += [11, 12]
    worker.defer_extend([req], [12], None, None)
    req.all_ids.append(13)
    worker.release(req, keep_draft_kv=False)
    # the whole text waits for an idle moment, then goes into the shared trie
    assert "a" not in worker.text and len(worker.cache) == 0 and worker.has_idle_work()
    worker.idle_work()
    assert not worker.has_idle_work() and worker.cache.has_match([9, 17, 18], 2)


def test_own_text_first_then_past_requests_at_a_higher_bar() -> None:
    """A request drafts from its own text first, whatever past requests' text says more often; where its
    own text offers nothing, from the shared trie, but only nodes that clear the threshold at
    OTHER_TEXT_WEIGHT of their estimate (0.3 -> 0.5 here)."""
    from types import SimpleNamespace

    from treespec.speculative.ngram_cache import continuation_accept_prob
    from treespec.speculative.ngram_worker import OTHER_TEXT_WEIGHT

    worker = default_model_worker("cpu")
    shape = worker.schedule.shape_for(1)
    threshold = worker.min_accept_prob_flag = 0.3  # the numbers below are for this threshold
    for text in ([[21, 22, 23, 24, 25]] * 3 + [[31, 32, 33, 34]] + [[41, 42, 43]] * 2 + [[41, 42, 44]]):
        worker.cache.insert(text)  # past requests' text
    # (41, 42) went on as 43 twice in 3: estimated 0.37, above the threshold, below the other-text bar
    assert threshold <= continuation_accept_prob(2) * 2 / 3 < threshold / OTHER_TEXT_WEIGHT
    req = SimpleNamespace(rid="a", all_ids=[21, 22, 99, 98, 5, 21, 22], kv_len=6, seq_len=7, grammar=None,
                          output_ids=[0], sampling_params=SimpleNamespace(max_new_tokens=64))
    worker.after_prefill([req], [6], None, None)

    def drafts() -> list[int]:
        assert worker.wants_drafts([req], shape)
        return worker._draft(req, req.all_ids, worker.text["a"], 4, threshold)[0]

    assert drafts()[:2] == [99, 98]  # its own continuation of (21, 22), not the shared 23, 24
    req.all_ids += [31, 32]  # its own text has no continuation of (31, 32): the shared trie's, 0.56 >= 0.5
    assert drafts() == [33]  # then 34: 0.56 x 0.65 = 0.36, which would do for its own text, not for others'
    req.all_ids += [7, 41, 42]  # only the shared 0.37: not drafted, the step is plain
    assert not worker.wants_drafts([req], shape)
    req.all_ids += [43, 8, 41, 42]  # now (41, 42) went on as 43 in its own text
    assert drafts()[0] == 43


def test_a_loaded_server_inserts_no_text_until_idle() -> None:
    """Requests that never ask for drafts (the schedule decodes plain under load) cost the n-gram cache
    no insert while they run or leave: their text waits for `idle_work`, oldest first, and past
    MAX_PENDING_TEXTS the oldest goes in at once. `flush` drops what waits."""
    from types import SimpleNamespace

    from treespec.speculative.ngram_worker import MAX_PENDING_TEXTS

    worker = default_model_worker("cpu")
    reqs = [SimpleNamespace(rid=f"r{i}", all_ids=[100 + i, 7, 8, 9], kv_len=3, seq_len=4) for i in range(3)]
    worker.after_prefill(reqs, [3] * 3, None, None)
    for req in reqs:
        req.all_ids.append(10)
        worker.defer_extend([req], [10], None, None)
        worker.release(req, keep_draft_kv=False)
    assert len(worker.cache) == 0 and len(worker.pending) == 3 and not worker.text
    worker.idle_work()
    assert worker.cache.has_match([100, 7], 2) and not worker.cache.has_match([101, 7], 2)  # the oldest first
    worker.idle_work()
    worker.idle_work()
    assert worker.cache.has_match([102, 7], 2) and not worker.has_idle_work()
    for i in range(MAX_PENDING_TEXTS + 1):
        req = SimpleNamespace(rid=f"s{i}", all_ids=[500 + i, 7, 8], kv_len=2, seq_len=3)
        worker.after_prefill([req], [2], None, None)
        worker.release(req, keep_draft_kv=False)
    assert len(worker.pending) == MAX_PENDING_TEXTS and worker.cache.has_match([500, 7], 2)
    worker.flush()
    assert not worker.has_idle_work() and len(worker.cache) == 0
