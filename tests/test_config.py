"""Config files and the flags on top of them: a file's values are the flags' values, flags win,
an unknown key or a bad value is one sentence, and a value the user did not set (the toy run's,
a recipe's) is dropped rather than refused when a flag makes it inapplicable. Parsing only."""

import json

import pytest
import yaml

from genrl.training.train_args import DEFAULT_MODEL, DEFAULT_TRAIN_PROMPTS, parse_args

# A run on the shipped model spelled out, as flags and as a file.
VALUES = {
    "pretrained_model_name_or_path": DEFAULT_MODEL, "prompt_dataset": DEFAULT_TRAIN_PROMPTS, "reward_fn": "toy_geneval",
    "group_size": 4, "rollout_batch_size": 4, "learning_rate": 2.0e-4, "same_latent": False, "noise_level": 1,
    "sde_window_size": 2, "sde_window_range": [0, 6], "use_lora": True,
}
FLAGS = [
    "--pretrained_model_name_or_path", DEFAULT_MODEL, "--prompt_dataset", DEFAULT_TRAIN_PROMPTS, "--reward_fn", "toy_geneval",
    "--group_size", "4", "--rollout_batch_size", "4", "--learning_rate", "2e-4", "--no-same_latent", "--noise_level", "1",
    "--sde_window_size", "2", "--sde_window_range", "0", "6", "--use_lora",
]


def write(path, values) -> str:
    path.write_text(json.dumps(values) if path.suffix == ".json" else yaml.safe_dump(values))
    return str(path)


def last_error(capsys) -> str:
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[-1].startswith("train_genrl.py: error: "), lines
    return lines[-1]


@pytest.mark.parametrize("suffix", [".yaml", ".json"])
def test_a_config_file_gives_the_same_run_as_its_flags_and_flags_win_over_it(tmp_path, suffix):
    out = ["--output_dir", str(tmp_path / "out")]
    from_file = parse_args(["--config", write(tmp_path / f"run{suffix}", VALUES), *out])
    assert vars(from_file) == vars(parse_args(FLAGS + out))
    assert isinstance(from_file.noise_level, float) and from_file.sde_window_range == [0, 6]
    over = parse_args(["--config", str(tmp_path / f"run{suffix}"), "--learning_rate", "1e-5", "--same_latent", *out])
    assert (over.learning_rate, over.same_latent, over.group_size) == (1e-5, True, 4)


def test_a_mapping_of_reward_options_is_their_json(tmp_path):
    options = {"toy_geneval": {}}
    args = parse_args(["--config", write(tmp_path / "run.yaml", {**VALUES, "reward_options": options}),
                       "--output_dir", str(tmp_path / "out")])
    assert json.loads(args.reward_options) == options


@pytest.mark.parametrize("values, expected", [
    ({"learning_rte": 1e-4}, "unknown key 'learning_rte', not a flag of train_genrl.py (did you mean 'learning_rate'?)."),
    ({"learning_rate": "fast"}, "argument --learning_rate: invalid float value: 'fast'"),
    ({"objective": "ppo"}, "argument --objective: invalid choice: 'ppo'"),
    ({"group_size": [4, 8]}, "group_size takes one value, not a list."),
    ({"group_size": None}, "group_size needs a value (its default is 8), not null."),
])
def test_a_bad_key_or_value_in_a_config_file_is_one_line_naming_the_file(tmp_path, capsys, values, expected):
    path = write(tmp_path / "run.yaml", {**VALUES, **values})
    with pytest.raises(SystemExit) as exit_info:
        parse_args(["--config", path, "--output_dir", str(tmp_path / "out")])
    assert exit_info.value.code == 2
    assert last_error(capsys).startswith(f"train_genrl.py: error: {path}: {expected}")


def test_a_config_file_must_exist_and_name_a_model(tmp_path, capsys):
    with pytest.raises(SystemExit):
        parse_args(["--config", str(tmp_path / "none.yaml")])
    assert "is not a file" in last_error(capsys)
    no_model = {k: v for k, v in VALUES.items() if k != "pretrained_model_name_or_path"}
    with pytest.raises(SystemExit):
        parse_args(["--config", write(tmp_path / "run.yaml", no_model), "--output_dir", str(tmp_path / "out")])
    assert "--pretrained_model_name_or_path is required with --config" in last_error(capsys)


def test_group_size_2_on_the_toy_run_trains_every_sample_of_a_group(tmp_path, capsys):
    """The toy run keeps 8 of 16 samples per group (PODS): a user's smaller group drops that value
    with one line, as it is not theirs; given as a flag, the same value is refused."""
    args = parse_args(["--group_size", "2", "--output_dir", str(tmp_path / "out")])
    assert (args.group_size, args.train_samples_per_group) == (2, None)
    notes = capsys.readouterr().err.strip().splitlines()
    assert notes == ["train_genrl.py: note: recipes/toy_nft.yaml sets --train_samples_per_group 8, more than "
                     "--group_size 2: every sample of a group trains."]
    assert parse_args(["--group_size", "8", "--output_dir", str(tmp_path / "out")]).train_samples_per_group == 8
    with pytest.raises(SystemExit):
        parse_args(["--group_size", "2", "--train_samples_per_group", "8", "--output_dir", str(tmp_path / "out")])
    assert "--train_samples_per_group must be between 2" in last_error(capsys)


def test_another_objective_drops_the_files_values_only_the_first_reads(tmp_path, capsys):
    out = ["--output_dir", str(tmp_path / "out")]
    awm = parse_args(["--config", "recipes/toy_nft.yaml", "--objective", "awm", *out])
    assert awm.nft_beta == 1.0 and awm.train_sigma_range == [0.4, 1.0]  # awm reads the sigma range too
    assert "sets --nft_beta 0.5, which only --objective nft reads" in capsys.readouterr().err
    # DiffusionNFT's soft-updated sampling policy is refused as GRPO's flag, dropped as the recipe's value.
    recipe = ["--config", "recipes/sd35_medium_diffusionnft.yaml", "--objective", "grpo", "--noise_level", "0.7", *out]
    assert parse_args(recipe).sampling_policy_decay_rate == 0.0
    assert "sets --sampling_policy_decay_rate 0.001, which only --objective nft or awm reads" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_args(recipe + ["--sampling_policy_decay_rate", "0.001"])
    assert "soft-updates the sampling policy of --objective nft or awm" in last_error(capsys)


@pytest.mark.parametrize("flags, expected", [
    (["--no-same_latent"], False), (["--no_same_latent"], False),
    (["--same_latent", "false"], False), (["--same_latent"], True),
])
def test_every_spelling_of_a_switch_works(tmp_path, flags, expected):
    args = parse_args(["--objective", "grpo", *flags, "--output_dir", str(tmp_path / "out")])
    assert args.same_latent is expected


def test_shipped_paths_in_a_config_file_are_read_from_the_repository_wherever_the_script_runs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    args = parse_args(["--config", "recipes/toy_grpo.yaml", "--output_dir", "out"])
    assert args.pretrained_model_name_or_path == DEFAULT_MODEL and args.prompt_dataset == DEFAULT_TRAIN_PROMPTS
    assert args.output_dir == str(tmp_path / "out")  # the run's own paths stay relative to where it runs
    assert vars(args) == vars(parse_args(["--objective", "grpo", "--output_dir", "out"]))


@pytest.mark.parametrize("flags, expected", [
    (["--learning_rate", "-1"], "--learning_rate must be a finite number >= 0, got -1.0."),
    (["--learning_rate", "nan"], "--learning_rate must be a finite number >= 0, got nan."),
    (["--adam_beta2", "1"], "--adam_beta2 must be in [0, 1), got 1.0."),
    (["--max_grad_norm", "0"], "--max_grad_norm > 0"),
    (["--num_epochs", "0"], "--num_epochs must be at least 1, got 0."),
    (["--max_train_steps", "0"], "--max_train_steps must be at least 1"),
])
def test_optimizer_values_torch_would_refuse_after_the_models_load_are_one_line_now(tmp_path, capsys, flags, expected):
    with pytest.raises(SystemExit) as exit_info:
        parse_args([*flags, "--output_dir", str(tmp_path / "out")])
    assert exit_info.value.code == 2 and expected in last_error(capsys)
