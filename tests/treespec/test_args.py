"""Server args: SGLang flag names, resolve() (checks naming the flag, "auto" resolved, ServerArgs left
as it is), speculative defaults, and the tree-shape rules taken from treespec/speculative/shapes.py."""

from __future__ import annotations

import dataclasses
import pickle
import subprocess
import sys

import pytest
import torch

from treespec.args import FLAG_HELP, ArgError, ResolvedArgs, ServerArgs


def test_resolve_leaves_server_args_unchanged_and_is_repeatable():
    args = ServerArgs(model_path="/some/model", speculative_algorithm="eagle3",
                      speculative_draft_model_path="/some/head")
    given = dataclasses.asdict(args)
    first, second = args.resolve(), args.resolve()
    assert dataclasses.asdict(args) == given
    assert first == second and isinstance(first, ResolvedArgs)
    assert first.resolve() is first  # resolving a resolved config is a no-op
    with pytest.raises(dataclasses.FrozenInstanceError):
        args.speculative_algorithm = "EAGLE3"  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        first.speculative_num_steps = 1  # type: ignore[misc]


def test_speculative_defaults_when_all_three_omitted():
    # a model other than the default one: the generic defaults (the shipped heads have tuned ones)
    resolved = ServerArgs(model_path="/some/model", speculative_algorithm="eagle3",
                          speculative_draft_model_path="/some/head").resolve()
    assert resolved.speculative_algorithm == "EAGLE3"
    assert (resolved.speculative_num_steps, resolved.speculative_eagle_topk,
            resolved.speculative_num_draft_tokens) == (5, 4, 8)


def test_speculation_without_a_draft_head_names_the_flag():
    with pytest.raises(ArgError, match="^--speculative-draft-model-path: is required"):
        ServerArgs(model_path="/some/model", speculative_algorithm="EAGLE").resolve()
    assert ServerArgs(model_path="/some/model").resolve().speculative_algorithm == "NONE"  # auto: off


@pytest.mark.parametrize("steps,topk,ndraft,flag", [
    (3, 1, 5, "--speculative-num-draft-tokens"),  # topk 1 must be a chain
    (2, 2, 6, "--speculative-num-draft-tokens"),  # more than 1 + topk * steps
    (0, 2, 2, "--speculative-num-steps"),
    (2, 0, 2, "--speculative-eagle-topk"),
    (2, 2, None, "--speculative-num-draft-tokens"),
])
def test_bad_speculative_settings_name_the_flag(steps, topk, ndraft, flag):
    args = ServerArgs(speculative_algorithm="EAGLE", speculative_draft_model_path="/some/head",
                      speculative_num_steps=steps, speculative_eagle_topk=topk, speculative_num_draft_tokens=ndraft)
    with pytest.raises(ArgError, match=f"^{flag}"):
        args.resolve()


def test_tree_shape_rules_come_from_shapes_py(monkeypatch):
    import treespec.speculative.shapes as shapes

    seen = []

    def recording_validate_shape(steps, topk, ndraft, where):
        seen.append((steps, topk, ndraft))
        raise shapes.ScheduleError(f"{where}: rejected by shapes.py")

    monkeypatch.setattr(shapes, "validate_shape", recording_validate_shape)
    args = ServerArgs(speculative_algorithm="EAGLE", speculative_draft_model_path="/some/head",
                      speculative_num_steps=3, speculative_eagle_topk=2, speculative_num_draft_tokens=5)
    with pytest.raises(ArgError, match=r"^--speculative-num-draft-tokens 5 .*--speculative-num-steps 3.*"
                                       r"--speculative-eagle-topk 2.*rejected by shapes.py"):
        args.resolve()
    assert seen == [(3, 2, 5)]


@pytest.mark.parametrize("field,value,flag", [
    ("dtype", "float8", "--dtype"), ("schedule_policy", "random", "--schedule-policy"),
    ("speculative_algorithm", "MEDUSA", "--speculative-algorithm"), ("port", 70000, "--port"),
    ("max_total_tokens", 0, "--max-total-tokens"), ("device", "tpu", "--device"),
    ("speculative_draft_dtype", "int8", "--speculative-draft-dtype"), ("num_threads", 0, "--num-threads"),
    ("speculative_draft_model_quantization", "q4_0", "--speculative-draft-model-quantization"),
    ("stream_interval", 0, "--stream-interval"),
])
def test_bad_values_name_the_flag(field, value, flag):
    with pytest.raises(ArgError, match=f"^{flag}"):
        ServerArgs(**{field: value}).resolve()


def test_device_and_dtypes_resolve_to_names_with_torch_objects_on_request():
    resolved = ServerArgs(speculative_algorithm="NONE").resolve()
    assert resolved.device == "auto"  # settled where the model runs, not in the launcher
    assert resolved.torch_device() == torch.device("cuda" if torch.cuda.is_available() else "cpu")
    resolved = ServerArgs(device="cpu", speculative_algorithm="NONE").resolve()
    assert (resolved.device, resolved.dtype, resolved.speculative_draft_dtype) == ("cpu", "auto", "auto")
    assert (resolved.torch_device(), resolved.torch_dtype()) == (torch.device("cpu"), torch.float32)
    assert resolved.torch_draft_dtype() is torch.float32
    resolved = ServerArgs(device="cpu", dtype="bfloat16", speculative_algorithm="NONE").resolve()
    assert resolved.torch_draft_dtype() is torch.bfloat16  # auto: the target's
    resolved = ServerArgs(device="cpu", speculative_draft_dtype="float16", speculative_algorithm="NONE").resolve()
    assert (resolved.torch_dtype(), resolved.torch_draft_dtype()) == (torch.float32, torch.float16)
    assert pickle.loads(pickle.dumps(resolved)) == resolved  # it travels to the scheduler process


def test_importing_and_resolving_on_cpu_does_not_load_torch():
    code = ("import sys; from treespec.args import ServerArgs; assert 'torch' not in sys.modules; "
            "ServerArgs().resolve(); ServerArgs(device='cuda').resolve(); "
            "ServerArgs(device='cpu').resolve(); ServerArgs(device='cpu', speculative_algorithm='EAGLE', "
            "speculative_draft_model_path='/h').resolve(); assert 'torch' not in sys.modules, 'torch'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_cli_parsing_and_cli_errors(capsys):
    args = ServerArgs.from_cli(["--port", "31000", "--disable-radix-cache", "--speculative-algorithm", "NONE"])
    assert isinstance(args, ResolvedArgs) and args.port == 31000 and args.disable_radix_cache
    with pytest.raises(SystemExit):
        ServerArgs.from_cli(["--speculative-algorithm", "EAGLE", "--speculative-eagle-topk", "1",
                             "--speculative-num-steps", "3", "--speculative-num-draft-tokens", "8"])
    assert "--speculative-num-draft-tokens" in capsys.readouterr().err


@pytest.mark.parametrize("algorithm", ["EAGLE3", "EAGLE"])
def test_shipped_head_is_the_default_draft_for_the_default_model(algorithm):
    from treespec.drafts import TUNED, shipped_draft_path

    shipped = shipped_draft_path(algorithm)
    if shipped is None:
        pytest.skip(f"no shipped {algorithm} head in this checkout")
    resolved = ServerArgs(speculative_algorithm=algorithm).resolve()
    assert resolved.speculative_draft_model_path == str(shipped)
    assert (resolved.speculative_num_steps, resolved.speculative_eagle_topk,
            resolved.speculative_num_draft_tokens) == TUNED[algorithm]
    # explicit settings win; another target model gets no shipped head
    resolved = ServerArgs(speculative_algorithm=algorithm, speculative_num_steps=3, speculative_eagle_topk=1,
                          speculative_num_draft_tokens=4).resolve()
    assert (resolved.speculative_num_steps, resolved.speculative_draft_model_path) == (3, str(shipped))
    with pytest.raises(ArgError, match="^--speculative-draft-model-path"):
        ServerArgs(model_path="/some/other/model", speculative_algorithm=algorithm).resolve()


def test_auto_speculation_is_ngram_on_the_default_model_only():
    resolved = ServerArgs().resolve()
    assert resolved.speculative_algorithm == "NGRAM"
    assert ServerArgs(model_path="/some/model").resolve().speculative_algorithm == "NONE"


def test_ngram_corpus_is_the_shipped_one_on_the_default_model_or_the_file_given(tmp_path):
    from treespec.drafts import ngram_corpus_path

    shipped = ngram_corpus_path()
    assert shipped is not None  # shipped in the package
    assert ServerArgs().resolve().speculative_ngram_corpus == str(shipped)
    # the tree flags do not touch it: the corpus is for the model, not a tree shape
    assert ServerArgs(speculative_num_draft_tokens=6).resolve().speculative_ngram_corpus == str(shipped)
    assert ServerArgs(speculative_ngram_corpus="none").resolve().speculative_ngram_corpus is None
    assert ServerArgs(model_path="/some/model", speculative_algorithm="NGRAM").resolve().speculative_ngram_corpus is None
    assert ServerArgs(speculative_algorithm="NONE").resolve().speculative_ngram_corpus is None
    mine = tmp_path / "mine.json.gz"
    mine.write_bytes(b"")
    resolved = ServerArgs(model_path="/some/model", speculative_algorithm="NGRAM", speculative_ngram_corpus=str(mine))
    assert resolved.resolve().speculative_ngram_corpus == str(mine)
    with pytest.raises(ArgError, match="^--speculative-ngram-corpus: no such file"):
        ServerArgs(speculative_ngram_corpus=str(tmp_path / "missing.json.gz")).resolve()
    with pytest.raises(ArgError, match="^--speculative-ngram-corpus: applies to NGRAM only"):
        ServerArgs(speculative_algorithm="EAGLE3", speculative_ngram_corpus=str(mine)).resolve()


def test_ngram_takes_the_tuned_schedule_on_the_default_model_unless_settings_are_given(tmp_path):
    from treespec.drafts import ngram_schedule_path
    from treespec.speculative.shapes import SpecSchedule

    tuned = ngram_schedule_path()
    assert tuned is not None  # shipped in the package
    assert ServerArgs().resolve().speculative_config == str(tuned)
    shapes = SpecSchedule.from_file(tuned)
    # on CPU up to 12 nodes, each of an estimated acceptance >= 0.2 (a verified node costs ~0.1-0.2 decode
    # steps with int8 activations; benchmarks/ngram_accept_fit.py's replay); at batch 2-4, 8 of >= 0.4
    # (each request verifies its own nodes only); at batch 5-16, 8 of >= 0.7 (a verified row costs ~0.7 of
    # a batch-16 step's cost per token); plain above
    assert shapes.shape_for(1).num_draft_tokens == 12 and shapes.shape_for(1).ngram_min_accept_prob == 0.2
    assert shapes.shape_for(4).num_draft_tokens == 8 and shapes.shape_for(4).ngram_min_accept_prob == 0.4
    assert shapes.shape_for(5).num_draft_tokens == 8 and shapes.shape_for(16).ngram_min_accept_prob == 0.7
    assert shapes.shape_for(17).num_steps == 0
    # verified nodes cost almost nothing on CUDA: fill 8, up to batch 4 (measured on an H100, performance.md)
    on_cuda = SpecSchedule.from_file(tuned, "cuda")
    assert on_cuda.shape_for(4).num_draft_tokens == 8 and on_cuda.shape_for(5).num_steps == 0
    assert on_cuda.shape_for(1).ngram_min_accept_prob == 0.0
    # where the CPU kernels run their AVX2 code a verified row costs ~0.3 decode steps: 8 nodes >= 0.5,
    # up to batch 4
    on_avx2 = SpecSchedule.from_file(tuned, "cpu_avx2")
    assert on_avx2.shape_for(4).num_draft_tokens == 8 and on_avx2.shape_for(5).num_steps == 0
    assert on_avx2.shape_for(1).ngram_min_accept_prob == 0.5
    # another model, or a tree size given: the same chain at every batch size
    assert ServerArgs(model_path="/some/model", speculative_algorithm="NGRAM").resolve().speculative_config is None
    resolved = ServerArgs(speculative_algorithm="NGRAM", speculative_num_draft_tokens=6).resolve()
    assert (resolved.speculative_config, resolved.speculative_num_draft_tokens) == (None, 6)
    mine = tmp_path / "mine.json"
    mine.write_text('{"schedule": [{"max_batch_size": 2, "num_steps": 5, "num_draft_tokens": 6}]}')
    assert ServerArgs(speculative_algorithm="NGRAM", speculative_config=str(mine)).resolve().speculative_config == str(mine)
    mine.write_text('{"schedule": [{"max_batch_size": null, "num_steps": 2, "eagle_topk": 2, "num_draft_tokens": 4}]}')
    with pytest.raises(ArgError, match="^--speculative-config.*eagle_topk must be 1"):
        ServerArgs(speculative_algorithm="NGRAM", speculative_config=str(mine)).resolve()
    # the CUDA entries are checked as strictly, though this host may never use them
    mine.write_text('{"schedule": [{"num_steps": 1}], '
                    '"schedule_cuda": [{"num_steps": 2, "eagle_topk": 2, "num_draft_tokens": 4}]}')
    with pytest.raises(ArgError, match="^--speculative-config.*eagle_topk must be 1"):
        ServerArgs(speculative_algorithm="NGRAM", speculative_config=str(mine)).resolve()
    with pytest.raises(ArgError, match="^--speculative-config: cannot read"):
        ServerArgs(speculative_algorithm="NGRAM", speculative_config=str(tmp_path / "missing.json")).resolve()


def fake_shipped_head(tmp_path, monkeypatch):
    """An empty head folder that treespec.drafts reports as the shipped head for every algorithm."""
    import treespec.drafts as drafts

    head = tmp_path / "head"
    head.mkdir()
    (head / "config.json").write_text("{}")
    (head / "model.safetensors").write_bytes(b"")
    monkeypatch.setattr(drafts, "shipped_draft_path", lambda algorithm: head)
    return head


def test_shipped_tuned_schedule_is_used_unless_settings_are_given(tmp_path, monkeypatch):
    head = fake_shipped_head(tmp_path, monkeypatch)
    resolved = ServerArgs(speculative_algorithm="EAGLE3").resolve()
    assert resolved.speculative_config is None  # no tuned schedule shipped: the constant TUNED setting
    (head / "speculative_config.json").write_text('{"schedule": [{"max_batch_size": null, "num_steps": 0}]}')
    resolved = ServerArgs(speculative_algorithm="EAGLE3").resolve()
    assert resolved.speculative_config == str(head / "speculative_config.json")
    # explicit settings or an explicit schedule win over the shipped one
    resolved = ServerArgs(speculative_algorithm="EAGLE3", speculative_num_steps=3, speculative_eagle_topk=1,
                          speculative_num_draft_tokens=4).resolve()
    assert resolved.speculative_config is None
    mine = tmp_path / "mine.json"
    mine.write_text('{"schedule": [{"max_batch_size": null, "num_steps": 2, "eagle_topk": 1}]}')
    resolved = ServerArgs(speculative_algorithm="EAGLE3", speculative_config=str(mine)).resolve()
    assert resolved.speculative_config == str(mine)
    mine.write_text('{"schedule": []}')
    with pytest.raises(ArgError, match="^--speculative-config"):
        ServerArgs(speculative_algorithm="EAGLE3", speculative_config=str(mine)).resolve()


def test_speculative_token_map_flag(tmp_path, monkeypatch):
    """--speculative-token-map: EAGLE only; the shipped EAGLE head's list is the default for it,
    "none" turns that off, an explicit file wins, a missing file names the flag."""
    head = fake_shipped_head(tmp_path, monkeypatch)
    assert ServerArgs(speculative_algorithm="EAGLE").resolve().speculative_token_map is None  # the head ships none
    (head / "token_map.pt").write_bytes(b"")
    args = ServerArgs(speculative_algorithm="EAGLE")
    assert args.resolve().speculative_token_map == str(head / "token_map.pt")
    assert args.speculative_token_map is None  # the given flag is left as given
    resolved = ServerArgs(speculative_algorithm="EAGLE", speculative_token_map="none").resolve()
    assert resolved.speculative_token_map is None
    mine = tmp_path / "mine.pt"
    mine.write_bytes(b"")
    resolved = ServerArgs(speculative_algorithm="EAGLE", speculative_token_map=str(mine)).resolve()
    assert resolved.speculative_token_map == str(mine)
    with pytest.raises(ArgError, match="^--speculative-token-map.*EAGLE only"):
        ServerArgs(speculative_algorithm="EAGLE3", speculative_token_map=str(mine)).resolve()
    resolved = ServerArgs(speculative_algorithm="EAGLE3", speculative_token_map="none").resolve()  # asks for nothing
    assert resolved.speculative_token_map is None
    with pytest.raises(ArgError, match="^--speculative-token-map.*is not a file"):
        ServerArgs(speculative_algorithm="EAGLE", speculative_token_map=str(tmp_path / "nope.pt")).resolve()
    ServerArgs(speculative_algorithm="NONE", speculative_token_map=str(mine)).resolve()  # nothing to restrict


def test_shipped_eagle_head_ships_a_token_map():
    from treespec.drafts import shipped_draft_path
    from treespec.models.draft_loader import load_token_map

    shipped = shipped_draft_path("EAGLE")
    if shipped is None:
        pytest.skip("no shipped EAGLE head in this checkout")
    resolved = ServerArgs(speculative_algorithm="EAGLE").resolve()
    assert resolved.speculative_token_map == str(shipped / "token_map.pt")
    ids = load_token_map(resolved.speculative_token_map, 49152)  # SmolLM2's vocabulary
    assert ids.numel() == 8192


def test_every_flag_has_help_text(capsys):
    assert set(FLAG_HELP) == {f.name for f in dataclasses.fields(ServerArgs)}
    with pytest.raises(SystemExit):
        ServerArgs.from_cli(["--help"])
    out = capsys.readouterr().out
    assert "KV pool size in tokens" in out and "(default: 30000)" in out


def test_ngram_needs_no_draft_model_and_sizes_its_tree_with_num_draft_tokens():
    resolved = ServerArgs(model_path="/some/model", speculative_algorithm="ngram").resolve()
    assert resolved.speculative_algorithm == "NGRAM" and resolved.speculative_draft_model_path is None
    # 4 nodes by default; num_steps / eagle_topk derived: the deepest tree, the widest branching
    assert (resolved.speculative_num_draft_tokens, resolved.speculative_num_steps,
            resolved.speculative_eagle_topk) == (4, 3, 10)
    resolved = ServerArgs(speculative_algorithm="NGRAM", speculative_num_draft_tokens=5,
                          speculative_ngram_max_bfs_breadth=3).resolve()  # the default model: no shipped head used
    assert (resolved.speculative_num_draft_tokens, resolved.speculative_num_steps,
            resolved.speculative_eagle_topk, resolved.speculative_config) == (5, 4, 3, None)
    assert ServerArgs(speculative_algorithm="NGRAM", speculative_token_map="none").resolve().speculative_token_map is None


@pytest.mark.parametrize("field,value,flag", [
    ("speculative_draft_model_path", "/some/head", "--speculative-draft-model-path"),
    ("speculative_num_steps", 3, "--speculative-num-steps"),
    ("speculative_eagle_topk", 2, "--speculative-eagle-topk"),
    ("speculative_token_map", "/some/map.pt", "--speculative-token-map"),
    ("speculative_num_draft_tokens", 1, "--speculative-num-draft-tokens"),
])
def test_ngram_refuses_eagle_flags_naming_them(field, value, flag):
    with pytest.raises(ArgError, match=f"^{flag}"):
        ServerArgs(speculative_algorithm="NGRAM", **{field: value}).resolve()


@pytest.mark.parametrize("values,flag", [
    ({"speculative_ngram_min_match_window_size": 0}, "--speculative-ngram-min-match-window-size"),
    ({"speculative_ngram_min_match_window_size": 4, "speculative_ngram_max_match_window_size": 3},
     "--speculative-ngram-max-match-window-size"),
    ({"speculative_ngram_max_bfs_breadth": 0}, "--speculative-ngram-max-bfs-breadth"),
    ({"speculative_ngram_min_bfs_breadth": 5, "speculative_ngram_max_bfs_breadth": 2},
     "--speculative-ngram-max-bfs-breadth"),
    ({"speculative_ngram_branch_length": 1}, "--speculative-ngram-branch-length"),
    ({"speculative_ngram_capacity": 0}, "--speculative-ngram-capacity"),
    ({"speculative_ngram_min_accept_prob": 1.0}, "--speculative-ngram-min-accept-prob"),
    ({"speculative_ngram_min_accept_prob": -0.1}, "--speculative-ngram-min-accept-prob"),
])
@pytest.mark.parametrize("algorithm", ["NGRAM", "NONE"])
def test_bad_ngram_flags_name_the_flag(values, flag, algorithm):
    with pytest.raises(ArgError, match=f"^{flag}"):
        ServerArgs(speculative_algorithm=algorithm, **values).resolve()


def test_ngram_cli_flags_parse():
    args = ServerArgs.from_cli(["--speculative-algorithm", "NGRAM", "--speculative-ngram-capacity", "5000",
                                "--speculative-ngram-max-match-window-size", "6"])
    assert (args.speculative_algorithm, args.speculative_ngram_capacity,
            args.speculative_ngram_max_match_window_size) == ("NGRAM", 5000, 6)
    assert args.speculative_ngram_min_accept_prob is None  # the schedule entry's
    assert ServerArgs.from_cli(["--speculative-ngram-min-accept-prob", "0.25"]).resolve().speculative_algorithm == "NGRAM"
    with pytest.raises(ArgError, match="^--speculative-ngram-min-accept-prob: applies to --speculative-algorithm NGRAM"):
        ServerArgs(speculative_algorithm="EAGLE3", speculative_ngram_min_accept_prob=0.3).resolve()
    assert ServerArgs.from_cli(["--speculative-ngram-min-accept-prob", "0.25"]).speculative_ngram_min_accept_prob == 0.25


@pytest.mark.parametrize("algorithm", ["NONE", "NGRAM"])
def test_draft_quantization_needs_a_draft_head(algorithm):
    with pytest.raises(ArgError, match="^--speculative-draft-model-quantization"):
        ServerArgs(speculative_algorithm=algorithm, speculative_draft_model_quantization="q8_0").resolve()


def test_draft_quantization_defaults_to_q8_0_for_the_shipped_head_only(tmp_path):
    shipped = ServerArgs(speculative_algorithm="EAGLE3").resolve()
    assert shipped.speculative_draft_model_quantization == "q8_0"
    kept = ServerArgs(speculative_algorithm="EAGLE3", speculative_draft_model_quantization="none").resolve()
    assert kept.speculative_draft_model_quantization == "none"
    own = ServerArgs(speculative_algorithm="EAGLE3", speculative_draft_model_path=str(tmp_path)).resolve()
    assert own.speculative_draft_model_quantization == "none"
    assert ServerArgs(speculative_algorithm="NONE").resolve().speculative_draft_model_quantization is None
