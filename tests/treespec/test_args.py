"""Server args: SGLang flag names, speculative defaults, and errors that name the flag."""

from __future__ import annotations

import pytest

from treespec.args import ArgError, ServerArgs


def test_speculative_defaults_when_all_three_omitted():
    # a model other than the default one: the generic defaults (the shipped heads have tuned ones)
    args = ServerArgs(model_path="/some/model", speculative_algorithm="eagle3")
    args.validate()
    assert args.speculative_algorithm == "EAGLE3"
    assert (args.speculative_num_steps, args.speculative_eagle_topk, args.speculative_num_draft_tokens) == (5, 4, 8)


@pytest.mark.parametrize("steps,topk,ndraft,flag", [
    (3, 1, 5, "--speculative-num-draft-tokens"),  # topk 1 must be a chain
    (2, 2, 6, "--speculative-num-draft-tokens"),  # more than 1 + topk * steps
    (0, 2, 2, "--speculative-num-steps"),
    (2, 0, 2, "--speculative-eagle-topk"),
    (2, 2, None, "--speculative-num-draft-tokens"),
])
def test_bad_speculative_settings_name_the_flag(steps, topk, ndraft, flag):
    args = ServerArgs(speculative_algorithm="EAGLE", speculative_num_steps=steps,
                      speculative_eagle_topk=topk, speculative_num_draft_tokens=ndraft)
    with pytest.raises(ArgError, match=flag):
        args.validate()


@pytest.mark.parametrize("field,value,flag", [
    ("dtype", "float8", "--dtype"), ("schedule_policy", "random", "--schedule-policy"),
    ("speculative_algorithm", "MEDUSA", "--speculative-algorithm"), ("port", 70000, "--port"),
    ("max_total_tokens", 0, "--max-total-tokens"),
])
def test_bad_values_name_the_flag(field, value, flag):
    with pytest.raises(ArgError, match=flag):
        ServerArgs(**{field: value}).validate()


def test_cli_parsing_and_cli_errors(capsys):
    args = ServerArgs.from_cli(["--port", "31000", "--disable-radix-cache", "--speculative-algorithm", "NONE"])
    assert args.port == 31000 and args.disable_radix_cache
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
    args = ServerArgs(speculative_algorithm=algorithm)
    args.validate()
    assert args.speculative_draft_model_path == str(shipped)
    assert (args.speculative_num_steps, args.speculative_eagle_topk, args.speculative_num_draft_tokens) == TUNED[algorithm]
    # explicit settings win; another target model gets no shipped head
    args = ServerArgs(speculative_algorithm=algorithm, speculative_num_steps=3, speculative_eagle_topk=1,
                      speculative_num_draft_tokens=4)
    args.validate()
    assert (args.speculative_num_steps, args.speculative_draft_model_path) == (3, str(shipped))
    args = ServerArgs(model_path="/some/other/model", speculative_algorithm=algorithm)
    args.validate()
    assert args.speculative_draft_model_path is None


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
    args = ServerArgs(speculative_algorithm="EAGLE3")
    args.validate()
    assert args.speculative_config is None  # no tuned schedule shipped: the constant TUNED setting
    (head / "speculative_config.json").write_text('{"schedule": [{"max_batch_size": null, "num_steps": 0}]}')
    args = ServerArgs(speculative_algorithm="EAGLE3")
    args.validate()
    assert args.speculative_config == str(head / "speculative_config.json")
    # explicit settings or an explicit schedule win over the shipped one
    args = ServerArgs(speculative_algorithm="EAGLE3", speculative_num_steps=3, speculative_eagle_topk=1,
                      speculative_num_draft_tokens=4)
    args.validate()
    assert args.speculative_config is None
    mine = tmp_path / "mine.json"
    mine.write_text('{"schedule": [{"max_batch_size": null, "num_steps": 2, "eagle_topk": 1}]}')
    args = ServerArgs(speculative_algorithm="EAGLE3", speculative_config=str(mine))
    args.validate()
    assert args.speculative_config == str(mine)


def test_speculative_token_map_flag(tmp_path, monkeypatch):
    """--speculative-token-map: EAGLE only; the shipped EAGLE head's list is the default for it,
    "none" turns that off, an explicit file wins, a missing file names the flag."""
    head = fake_shipped_head(tmp_path, monkeypatch)
    args = ServerArgs(speculative_algorithm="EAGLE")
    args.validate()
    assert args.speculative_token_map is None  # the head ships no list
    (head / "token_map.pt").write_bytes(b"")
    args = ServerArgs(speculative_algorithm="EAGLE")
    args.validate()
    assert args.speculative_token_map == str(head / "token_map.pt")
    args.validate()  # validating again (the scheduler process does) keeps it
    assert args.speculative_token_map == str(head / "token_map.pt")
    args = ServerArgs(speculative_algorithm="EAGLE", speculative_token_map="none")
    args.validate()
    assert args.speculative_token_map is None
    mine = tmp_path / "mine.pt"
    mine.write_bytes(b"")
    args = ServerArgs(speculative_algorithm="EAGLE", speculative_token_map=str(mine))
    args.validate()
    assert args.speculative_token_map == str(mine)
    with pytest.raises(ArgError, match="--speculative-token-map.*EAGLE only"):
        ServerArgs(speculative_algorithm="EAGLE3", speculative_token_map=str(mine)).validate()
    args = ServerArgs(speculative_algorithm="EAGLE3", speculative_token_map="none")  # asks for nothing: fine
    args.validate()
    assert args.speculative_token_map is None
    with pytest.raises(ArgError, match="--speculative-token-map.*is not a file"):
        ServerArgs(speculative_algorithm="EAGLE", speculative_token_map=str(tmp_path / "nope.pt")).validate()
    args = ServerArgs(speculative_algorithm="NONE", speculative_token_map=str(mine))
    args.validate()  # no speculation: nothing to restrict


def test_shipped_eagle_head_ships_a_token_map():
    from treespec.drafts import shipped_draft_path
    from treespec.models.draft_loader import load_token_map

    shipped = shipped_draft_path("EAGLE")
    if shipped is None:
        pytest.skip("no shipped EAGLE head in this checkout")
    args = ServerArgs(speculative_algorithm="EAGLE")
    args.validate()
    assert args.speculative_token_map == str(shipped / "token_map.pt")
    ids = load_token_map(args.speculative_token_map, 49152)  # SmolLM2's vocabulary
    assert ids.numel() == 8192
