"""Bad values end with one sentence naming them, before any model loads where the input allows:
reward options (names and paths), reward functions that do not import, sampling without a
stochastic step, an unwritable output folder, malformed prompt files, records without a prompt or
with one that is not a string, fp16 on the CPU, processes the launcher did not start, reward
values beyond float32 or complex; failures during a run (a reward, a full disk) are one sentence
too, their tracebacks in the log folder; under accelerate launch a refusal is said once."""

import logging
import os
import sys

import pytest
import torch

from genrl.data.prompts import load_prompts
from genrl.training import train_args

from conftest import run_python, script_env, script_errors, trainer_exit_in_process


def args_with(model, prompts, output_dir, *extra):
    return ["--pretrained_model_name_or_path", model, "--prompt_dataset", prompts, "--reward_fn", "jpeg_compressibility",
            "--output_dir", output_dir, "--group_size", "4", "--rollout_batch_size", "4", "--train_batch_size", "4",
            "--num_inference_steps", "4", *extra]


def parse_error(capsys, argv) -> str:
    with pytest.raises(SystemExit) as exit_info:
        train_args.parse_args(argv)
    assert exit_info.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error.startswith("train_genrl.py: error: ") or ": error: " in error
    message = error.split("error: ", 1)[1]
    assert message.endswith(".") and message.count(". ") == 0, message
    return message


@pytest.mark.parametrize("options, expected", [
    ('{"jpeg_compressibility": {"quality": 50}', "--reward_options is not valid JSON: Expecting ',' delimiter at line 1 column 41."),
    ("[1, 2]", "--reward_options must be a JSON object mapping reward names to their options, got a list."),
    ('{"jpeg_compressibility": 5}', "--reward_options for 'jpeg_compressibility' must be a JSON object of options, got a number."),
    ('{"jpeg_compressibility": {"qualty": 50}}', "Reward 'jpeg_compressibility' takes no option 'qualty' (its options: ['quality'])."),
    ('{"hpsv3": {}}', "--reward_options names 'hpsv3', which is not in --reward_fn or --eval_reward_fn ['jpeg_compressibility']."),
    ("no_such_options.json", "--reward_options is not valid JSON (nor a file that exists): Expecting value at line 1 column 1."),
])
def test_reward_options_are_checked_when_parsed(tiny_sd3, prompt_file, tmp_path, capsys, options, expected):
    argv = args_with(tiny_sd3, prompt_file, str(tmp_path / "out"), "--reward_options", options)
    assert parse_error(capsys, argv) == expected


def test_reward_options_from_a_file_name_the_file(tiny_sd3, prompt_file, tmp_path, capsys):
    path = tmp_path / "options.json"
    path.write_text('{"jpeg_compressibility": {"quality": }}')
    message = parse_error(capsys, args_with(tiny_sd3, prompt_file, str(tmp_path / "out"), "--reward_options", str(path)))
    assert message == f"--reward_options file {str(path)!r} is not valid JSON: Expecting value at line 1 column 38."
    path.write_text('{"jpeg_compressibility": {"quality": 50}}')
    train_args.parse_args(args_with(tiny_sd3, prompt_file, str(tmp_path / "out"), "--reward_options", str(path)))


@pytest.mark.parametrize("extra, expected", [
    (["--max_sequence_length", "0"], "--max_sequence_length must be at least 1 token; got 0."),
    (["--noise_level", "nan"], "--noise_level must be a finite number >= 0 (0: deterministic sampling), got nan."),
    (["--noise_level", "nan", "--objective", "nft"], "--noise_level must be a finite number >= 0 (0: deterministic sampling), got nan."),
    (["--noise_level", "-0.5", "--objective", "awm"], "--noise_level must be a finite number >= 0 (0: deterministic sampling), got -0.5."),
    (["--cfg_truncation", "inf"], "--cfg_truncation must be a finite number (1: guide every step), got inf."),
    (["--cfg_normalization", "-1"], "--cfg_normalization must be a finite number >= 0 (0: off), got -1.0."),
    (["--num_inference_steps", "1", "--sde_window_size", "1"],
     "--objective grpo trains on stochastic steps and the last sampling step is always deterministic, "
     "so it needs --num_inference_steps >= 2 (got 1)."),
    (["--sde_window_size", "2", "--sde_window_range", "2", "3"],
     "sde_window_range=(2, 3) cannot hold a window of 2 steps among the 3 stochastic-capable steps of 4; "
     "need 0 <= lo and hi - lo >= window size."),
    (["--grpo_guard", "--sde_type", "flow_cps"],
     "--grpo_guard normalises GRPO's ratio of flow_sde steps; it does not apply to --objective grpo with --sde_type "
     "flow_cps (use --objective grpo --sde_type flow_sde, or drop --grpo_guard)."),
    (["--sde_window_shift_every", "2"],
     "--sde_window_shift_every slides an SDE window of --sde_window_size steps every so many epochs: it must be >= 0 "
     "and needs --sde_window_size > 0, got 2 with --sde_window_size 0."),
    (["--grpo_guard_reweight", "--objective", "nft"],
     "--grpo_guard_reweight weights GRPO's flow_sde steps by 1 / (T dt); it does not apply to --objective nft with "
     "--sde_type flow_sde (use --objective grpo --sde_type flow_sde, or drop it)."),
    (["--train_sigma_range", "0.5", "1"],
     "--train_sigma_range chooses the re-noised timesteps of --objective nft or awm; GRPO trains on its recorded SDE "
     "steps (choose them with --sde_window_size and --sde_window_range)."),
    (["--objective", "nft", "--train_sigma_range", "0.5", "1.5"],
     "--train_sigma_range 0.5 1.5 must satisfy 0 <= LO < HI <= 1 (noise levels, 1: pure noise)."),
])
def test_sampling_without_a_usable_stochastic_step_is_refused(tiny_sd3, prompt_file, tmp_path, capsys, extra, expected):
    assert parse_error(capsys, args_with(tiny_sd3, prompt_file, str(tmp_path / "out"), *extra)) == expected


def test_an_output_dir_that_cannot_be_written_is_refused(tiny_sd3, prompt_file, tmp_path, capsys):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    out = str(blocker / "out")
    message = parse_error(capsys, args_with(tiny_sd3, prompt_file, out))
    assert message == f"--output_dir {out!r} cannot be written to ({blocker} is a file); choose another folder."
    train_args.parse_args(args_with(tiny_sd3, prompt_file, str(tmp_path / "fine" / "out")))
    assert not os.path.exists(tmp_path / "fine"), "parsing the arguments created the folder"
    if os.geteuid() != 0:  # root writes anywhere
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        assert "cannot be written to (Permission denied)" in parse_error(capsys, args_with(tiny_sd3, prompt_file, str(locked)))


@pytest.mark.parametrize("name, content, expected", [
    ("bad.jsonl", '{"prompt": "a red circle"}\n\n{"prompt": "a blue square"\n',
     "line 3 is not valid JSON (Expecting ',' delimiter at column 27)."),
    ("list.jsonl", '{"prompt": "a red circle"}\n["a blue square"]\n', "line 2 is not a JSON object (one record per line)."),
    ("empty.jsonl", "", "is empty."),
    ("empty.csv", "", "is empty."),
    ("bad.csv", 'prompt,x\n"a red circle,1\n', ": ParserError: Error tokenizing data."),
])
def test_a_malformed_prompt_file_names_the_file_and_line(tmp_path, name, content, expected):
    path = tmp_path / name
    path.write_text(content)
    with pytest.raises(ValueError) as failure:
        load_prompts(str(path))
    assert repr(str(path)) in str(failure.value) and expected in str(failure.value)


def test_records_without_a_prompt_are_counted_in_a_warning(tmp_path, caplog):
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "a red circle", "tag": 1}\n{"caption": "x"}\n{"prompt": "  "}\n{"prompt": "a blue square"}\n')
    with caplog.at_level(logging.WARNING, logger="genrl.data.prompts"):
        assert load_prompts(str(path)).prompts == ["a red circle", "a blue square"]
    assert [r.getMessage() for r in caplog.records] == [
        f"2 of 4 records of {str(path)!r} have no 'prompt' (missing or empty) and were skipped."
    ]
    caplog.clear()
    text = tmp_path / "prompts.txt"
    text.write_text("a red circle\n\n\na blue square\n")
    with caplog.at_level(logging.WARNING, logger="genrl.data.prompts"):
        load_prompts(str(text))
    assert not caplog.records, "blank lines of a text file are not records"


def test_a_malformed_prompt_file_fails_the_script_before_any_model_loads(tiny_sd3, tmp_path, monkeypatch):
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "a red circle"}\n{"prompt": \n')
    message = trainer_exit_in_process(args_with(tiny_sd3, str(path), str(tmp_path / "out")), monkeypatch)
    assert message == f"train_genrl.py: error: Prompt file {str(path)!r} line 2 is not valid JSON (Expecting value at column 11)."


@pytest.mark.usefixtures("isolated_rewards")
def test_a_float64_reward_beyond_float32_is_named_as_an_overflow(tmp_path, monkeypatch):
    from genrl.rewards import build_reward_fn

    (tmp_path / "huge_reward.py").write_text("def huge(samples, prompts, metadata):\n    return [1.0, 1e39]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    reward = build_reward_fn("huge_reward:huge")
    with pytest.raises(ValueError) as failure:
        reward(torch.rand(2, 3, 1, 8, 8), ["a", "b"], [{}, {}])
    assert "Reward 'huge_reward:huge' returned 1e+39, which overflows float32 (largest 3.4e+38)" in str(failure.value)
    assert "inf" not in str(failure.value)


# The README's example of local reward weights, on a machine that has none of them.
README_HPSV3 = '{"hpsv3": {"checkpoint": "/models/HPSv3/HPSv3.safetensors", "base_model": "/models/Qwen2-VL-7B-Instruct"}}'


@pytest.mark.parametrize("reward_fn, options, expected", [
    ("hpsv3", '{"hpsv3": {"chekpoint": "MizzenAI/HPSv3"}}',
     "Reward 'hpsv3' takes no option 'chekpoint' (its options: ['attn_implementation', 'base_model', 'batch_size', "
     "'checkpoint', 'dtype', 'lora_alpha', 'on_meta', 'pixels', 'template_path'])."),
    ("hpsv3", README_HPSV3,
     "Reward 'hpsv3' option 'checkpoint': '/models/HPSv3/HPSv3.safetensors' does not exist (nor is it a Hub repo id "
     "like 'org/name')."),
    ("hpsv3", '{"hpsv3": {"checkpoint": "MizzenAI/HPSv3", "base_model": "./Qwen2-VL-7B-Instruct"}}',
     "Reward 'hpsv3' option 'base_model': './Qwen2-VL-7B-Instruct' does not exist (nor is it a Hub repo id like 'org/name')."),
    ("videoalign_mq", '{"videoalign_mq": {"template_path": "KwaiVGI/prompt_template.json"}}',
     "Reward 'videoalign_mq' option 'template_path': 'KwaiVGI/prompt_template.json' does not exist."),
    ("pickscore", '{"pickscore": {"processor": 224}}', "Reward 'pickscore' option 'processor': 224 must be a path or a Hub repo id, not a number."),
    ("toy_geneval", '{"toy_geneval": {"threshold": 0.5}}', "Reward 'toy_geneval' takes no option 'threshold' (its options: ['min_area_fraction'])."),
])
def test_options_a_reward_model_does_not_take_or_paths_that_are_not_there_are_refused_when_parsed(
        tiny_sd3, prompt_file, tmp_path, capsys, reward_fn, options, expected):
    argv = args_with(tiny_sd3, prompt_file, str(tmp_path / "out"), "--reward_options", options)
    argv[argv.index("--reward_fn") + 1] = reward_fn
    assert parse_error(capsys, argv) == expected


def test_reward_model_paths_that_exist_or_hub_ids_pass_the_parse(tiny_sd3, prompt_file, tmp_path):
    (tmp_path / "HPSv3.safetensors").write_bytes(b"")
    (tmp_path / "template.json").write_text("{}")
    options = ('{"hpsv3": {"checkpoint": "%s", "base_model": "%s", "template_path": "%s"}, "pickscore": {"checkpoint": '
               '"yuvalkirstain/PickScore_v1"}}' % (tmp_path / "HPSv3.safetensors", tmp_path, tmp_path / "template.json"))
    argv = args_with(tiny_sd3, prompt_file, str(tmp_path / "out"), "--reward_options", options,
                     "--eval_reward_fn", "hpsv3,pickscore")
    argv[argv.index("--reward_fn") + 1] = "hpsv3"
    train_args.parse_args(argv)  # nothing fetched or loaded: a Hub id is resolved when the model loads


@pytest.fixture
def user_rewards(tmp_path, monkeypatch):
    """An importable module ``bad_input_rewards`` with ``scaled(samples, prompts, metadata, scale=1.0)``."""
    (tmp_path / "bad_input_rewards.py").write_text(
        "import torch\ndef scaled(samples, prompts, metadata, scale=1.0):\n    return torch.zeros(len(samples)) + scale\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "bad_input_rewards"
    sys.modules.pop("bad_input_rewards", None)


@pytest.mark.parametrize("flag, spec, options, expected", [
    ("--reward_fn", "nosuchmod:fn", None,
     "Could not import module 'nosuchmod' for reward 'nosuchmod:fn' (No module named 'nosuchmod'); it must be importable "
     "from where the script runs (PYTHONPATH)."),
    ("--eval_reward_fn", "nosuchmod:fn", None,
     "Could not import module 'nosuchmod' for reward 'nosuchmod:fn' (No module named 'nosuchmod'); it must be importable "
     "from where the script runs (PYTHONPATH)."),
    ("--reward_fn", "bad_input_rewards:nosuchfn", None,
     "bad_input_rewards.nosuchfn for reward 'bad_input_rewards:nosuchfn' does not exist or is not callable."),
    ("--reward_fn", "bad_input_rewards:scaled", '{"bad_input_rewards:scaled": {"sclae": 2}}',
     "Reward 'bad_input_rewards:scaled' takes no option 'sclae' (its options: ['scale'])."),
])
def test_a_reward_function_that_cannot_be_imported_or_given_its_options_is_refused_when_parsed(
        tiny_sd3, prompt_file, tmp_path, capsys, user_rewards, flag, spec, options, expected):
    argv = args_with(tiny_sd3, prompt_file, str(tmp_path / "out"), flag, spec, *(["--reward_options", options] if options else []))
    assert parse_error(capsys, argv) == expected


def test_a_reward_function_and_its_options_pass_the_parse(tiny_sd3, prompt_file, tmp_path, user_rewards):
    argv = args_with(tiny_sd3, prompt_file, str(tmp_path / "out"), "--reward_options", '{"bad_input_rewards:scaled": {"scale": 2}}')
    argv[argv.index("--reward_fn") + 1] = "bad_input_rewards:scaled"
    assert train_args.parse_args(argv).reward_fn == "bad_input_rewards:scaled"


def test_eval_refuses_a_reward_function_that_cannot_be_imported_before_any_model_loads(tmp_path, capsys):
    import eval_genrl

    with pytest.raises(SystemExit) as exit_info:
        eval_genrl.parse_args(["--model", str(tmp_path / "no-model"), "--reward_fn", "nosuchmod:fn"])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "eval_genrl.py: error: Could not import module 'nosuchmod' for reward 'nosuchmod:fn' (No module named 'nosuchmod'); "
        "it must be importable from where the script runs (PYTHONPATH).")


@pytest.mark.parametrize("line, kind", [
    ('{"prompt": ["a red circle", "a blue square"]}', "list"),
    ('{"prompt": {"text": "a red circle"}}', "object"),
    ('{"prompt": 5}', "number"),
    ('{"prompt": true}', "boolean"),
])
def test_a_prompt_that_is_not_a_string_is_refused_not_trained_on_as_its_str(tmp_path, line, kind):
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "a red circle"}\n' + line + "\n")
    with pytest.raises(ValueError) as failure:
        load_prompts(str(path))
    message = str(failure.value)
    assert message.startswith(f"Prompt dataset {str(path)!r} record 2 has a {kind} as its 'prompt' (")
    assert message.endswith("not text; every prompt must be a string (--prompt_column chooses the field).")


def test_a_prompt_file_of_lists_fails_the_script_before_any_model_loads(tiny_sd3, tmp_path, monkeypatch):
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": ["a red circle"]}\n')
    message = trainer_exit_in_process(args_with(tiny_sd3, str(path), str(tmp_path / "out")), monkeypatch)
    assert message == (f"train_genrl.py: error: Prompt dataset {str(path)!r} record 1 has a list as its 'prompt' "
                       "(['a red circle']), not text; every prompt must be a string (--prompt_column chooses the field).")


@pytest.mark.usefixtures("isolated_rewards")
def test_complex_reward_values_are_refused_not_cut_to_their_real_part(tmp_path, monkeypatch):
    from genrl.rewards import build_reward_fn

    (tmp_path / "complex_reward.py").write_text("def rotated(samples, prompts, metadata):\n    return [1 + 2j, 3 + 0j]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ValueError) as failure:
        build_reward_fn("complex_reward:rotated")(torch.rand(2, 3, 1, 8, 8), ["a", "b"], [{}, {}])
    assert str(failure.value) == "Reward 'complex_reward:rotated' returned complex scores ((1+2j), ...); a reward must be real numbers."


def test_a_reward_that_fails_in_training_is_one_sentence_and_its_traceback_goes_to_the_log(tiny_sd3, prompt_file, tmp_path):
    """The sentence on the console, the reward's own traceback (and the trainer's) in logs/error.log."""
    (tmp_path / "failing_reward.py").write_text("def ratio(samples, prompts, metadata):\n    return [1 / 0] * len(samples)\n")
    out = tmp_path / "out"
    env = {**script_env(), "PYTHONPATH": f"{tmp_path}{os.pathsep}{script_env()['PYTHONPATH']}"}
    proc = run_python("train_genrl.py", args_with(tiny_sd3, prompt_file, str(out), "--reward_fn", "failing_reward:ratio",
                                                  "--report_to", "none"), env=env, text=False)
    stderr = proc.stderr.decode()
    log = out / "logs" / "error.log"
    assert proc.returncode == 1 and "Traceback" not in stderr, stderr[-3000:]
    # A line of its own, not after the progress bar's last state (split as a terminal shows carriage returns).
    assert stderr.strip().split("\n")[-1] == (
        f"train_genrl.py: error: Reward 'failing_reward:ratio' failed: ZeroDivisionError: division by zero (the traceback "
        f"is in {log}).")
    traceback = log.read_text()
    assert 'failing_reward.py", line 2, in ratio' in traceback and "RewardError: Reward 'failing_reward:ratio' failed" in traceback


@pytest.mark.usefixtures("isolated_rewards")
def test_a_reward_out_of_memory_says_what_to_change_in_one_sentence():
    from genrl.rewards import build_reward_fn, register_reward

    def factory(name, device):
        def reward(samples, prompts, metadata):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB.\nSee the documentation.")
        return reward

    register_reward("greedy", factory)
    with pytest.raises(RuntimeError) as failure:
        build_reward_fn("greedy")(torch.rand(3, 3, 1, 8, 8), ["a"] * 3)
    assert str(failure.value) == (
        "Reward 'greedy' ran out of memory on a batch of 3 (OutOfMemoryError): give it a smaller batch_size in "
        "--reward_options if it takes one, a smaller --rollout_batch_size, or another --reward_device.")
    assert isinstance(failure.value.__cause__, torch.OutOfMemoryError)


def test_a_full_disk_at_a_checkpoint_is_one_sentence_and_its_traceback_goes_to_the_log(tiny_sd3, prompt_file, tmp_path,
                                                                                        monkeypatch):
    """What run() makes of save_checkpoint's error (tests/test_checkpointing.py: its sentence and cause)."""
    import errno

    import train_genrl
    from genrl.checkpoints.checkpointing import CheckpointSaveError

    def save_fails(args, held=None):
        os.makedirs(args.output_dir)
        try:
            raise OSError(errno.ENOSPC, "No space left on device", os.path.join(args.output_dir, "optimizer.bin"))
        except OSError as error:
            raise CheckpointSaveError("Could not save checkpoint-2: the disk is full.") from error

    monkeypatch.setattr(train_genrl, "main", save_fails)
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as exit_info:
        train_genrl.run(args_with(tiny_sd3, prompt_file, str(out)))
    log = out / "logs" / "error.log"
    assert exit_info.value.code == (
        f"train_genrl.py: error: Could not save checkpoint-2: the disk is full (the traceback is in {log}).")
    assert "OSError: [Errno 28] No space left on device" in log.read_text()


def test_a_traceback_is_written_only_when_an_exception_lies_behind_the_sentence(tmp_path, monkeypatch):
    from genrl.errors import SetupError, stop_line

    alone = SetupError("Stopped at step 4.")
    assert stop_line("train_genrl.py", alone, alone, str(tmp_path / "logs")) == "train_genrl.py: error: Stopped at step 4."
    assert not (tmp_path / "logs").exists()
    try:
        try:
            raise KeyError("checkpoint")
        except KeyError as error:
            raise SetupError("Could not build it.") from error
    except SetupError as error:
        caused = error
    monkeypatch.setenv("RANK", "1")  # each rank of a multi-process run writes its own file
    log = tmp_path / "logs" / "error-rank1.log"
    assert stop_line("train_genrl.py", caused, caused, str(tmp_path / "logs")) == (
        f"train_genrl.py: error: Could not build it (the traceback is in {log}).")
    assert "KeyError: 'checkpoint'" in log.read_text()


def test_eval_with_a_missing_prompt_file_is_one_sentence_before_any_model_loads(tmp_path, monkeypatch):
    import eval_genrl

    def no_model(*args, **kwargs):
        raise AssertionError("a model was loaded before the input was refused")

    monkeypatch.setattr(eval_genrl, "load_model", no_model)
    missing = str(tmp_path / "prompts.txt")
    with pytest.raises(SystemExit) as exit_info:
        eval_genrl.run(["--model", str(tmp_path / "model"), "--prompts", missing, "--output_dir", str(tmp_path / "out")])
    assert exit_info.value.code == f"eval_genrl.py: error: Prompt file {missing!r} does not exist."


@pytest.mark.slow
@pytest.mark.parametrize("config, processes", [(None, 1), ("multi_gpu", 2)])
def test_a_refusal_under_accelerate_launch_is_said_once(tiny_sd3, prompt_file, tmp_path, config, processes):
    """``accelerate launch --quiet`` (README "Bad input"): one process shows the sentence alone; on
    two, every process refuses the same command line but only the first says it (the launcher
    then adds torch's summary of the failed processes). The launcher's exit status is 1."""
    import subprocess

    from conftest import ROOT, launch_command

    args = args_with(tiny_sd3, prompt_file, str(tmp_path / "out"), "--group_size", "3")
    if config is None:  # the quickstart's launcher without a config file, its defaults given so that it does not list them
        command = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "1", "--num_machines", "1",
                   "--mixed_precision", "no", "--dynamo_backend", "no", os.path.join(ROOT, "train_genrl.py"), *args]
    else:
        command = launch_command("train_genrl.py", args, config, processes)
    command.insert(command.index("accelerate.commands.launch") + 1, "--quiet")
    proc = subprocess.run(command, cwd=ROOT, env=script_env(), capture_output=True, text=True, timeout=300)
    sentence = ("train_genrl.py: error: --rollout_batch_size 4 × --rollout_batches_per_epoch 2 = 8 samples per process per "
                "epoch is not a multiple of --group_size 3, so a prompt's group would be split; use e.g. --rollout_batch_size 6.")
    assert proc.returncode == 1 and script_errors(proc.stderr) == [sentence], proc.stderr[-3000:]
    if config is None:
        assert proc.stderr.strip().splitlines() == [sentence]


def test_a_prompt_file_refusal_is_left_to_the_first_process_of_the_machine(tiny_sd3, tmp_path, monkeypatch, capsys):
    path = tmp_path / "prompts.txt"
    path.write_text("")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert trainer_exit_in_process(args_with(tiny_sd3, str(path), str(tmp_path / "out")), monkeypatch) == 1
    with pytest.raises(SystemExit) as exit_info:
        train_args.parse_args(args_with(tiny_sd3, str(path), str(tmp_path / "out"), "--group_size", "3"))
    assert exit_info.value.code == 2 and capsys.readouterr().err == ""


FP16_ON_CPU = ("--mixed_precision fp16 is for GPUs: on the CPU it runs the models in float16, far slower than in float32 "
               "and with other scores; use --mixed_precision bf16 (the CPU's fast reduced precision) or no.")


@pytest.mark.parametrize("flag, exported", [("fp16", None), (None, "fp16")])
def test_fp16_on_the_cpu_is_refused_when_parsed(tiny_sd3, prompt_file, tmp_path, capsys, monkeypatch, flag, exported):
    """Given as the script's flag or by `accelerate launch --mixed_precision fp16` (exported); bf16 is fine."""
    monkeypatch.setenv("ACCELERATE_USE_CPU", "true")  # the CPU, as `accelerate launch --cpu` asks, on any machine
    if exported:
        monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", exported)
    extra = ["--mixed_precision", flag] if flag else []
    assert parse_error(capsys, args_with(tiny_sd3, prompt_file, str(tmp_path / "out"), *extra)) == FP16_ON_CPU
    assert train_args.parse_args(args_with(tiny_sd3, prompt_file, str(tmp_path / "out"), "--mixed_precision", "bf16"))


def test_eval_refuses_fp16_on_the_cpu(tmp_path, capsys, monkeypatch):
    import eval_genrl

    monkeypatch.setenv("ACCELERATE_USE_CPU", "true")
    with pytest.raises(SystemExit) as exit_info:
        eval_genrl.parse_args(["--model", str(tmp_path / "model"), "--mixed_precision", "fp16"])
    assert exit_info.value.code == 2 and capsys.readouterr().err.strip().splitlines()[-1] == f"eval_genrl.py: error: {FP16_ON_CPU}"


def test_a_master_address_the_launcher_inherited_is_no_sign_of_missing_processes(tiny_sd3, prompt_file, tmp_path,
                                                                                 capsys, monkeypatch):
    """accelerate launch sets MASTER_ADDR for the processes it was asked for; a cluster job may have set it already."""
    from genrl.distributed import launch as distributed
    for name, value in {"ACCELERATE_DYNAMO_BACKEND": "NO", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    argv = args_with(tiny_sd3, prompt_file, str(tmp_path / "out"))
    monkeypatch.setattr(distributed, "_launcher_environment", lambda: [b"PATH=/usr/bin", b"MASTER_ADDR=10.0.0.1"])
    train_args.parse_args(argv)
    monkeypatch.setattr(distributed, "_launcher_environment", lambda: [b"PATH=/usr/bin"])
    assert parse_error(capsys, argv).startswith("accelerate launch was asked for more than one process but started this one alone")


@pytest.mark.slow
def test_accelerate_launch_num_processes_3_without_a_config_says_it_runs_one(tiny_sd3, prompt_file, tmp_path):
    """The launcher without a config starts several processes only on 2+ GPUs: here it would train
    as one process, silently, and the script says so instead."""
    import subprocess

    from conftest import ROOT

    command = ["env", "CUDA_VISIBLE_DEVICES=", sys.executable, "-m", "accelerate.commands.launch", "--quiet", "--num_processes",
               "3", "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
               os.path.join(ROOT, "train_genrl.py"), *args_with(tiny_sd3, prompt_file, str(tmp_path / "out"), "--num_epochs", "1")]
    proc = subprocess.run(command, cwd=ROOT, env=script_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1 and proc.stderr.strip().splitlines() == [
        "train_genrl.py: error: accelerate launch was asked for more than one process but started this one alone "
        "(without a multi-process config file it starts several only on 2 or more GPUs, and this machine shows 0): add "
        "--config_file accelerate_configs/multi_gpu.yaml to run them (on the CPU over gloo), or launch one process."
    ], proc.stderr[-3000:]
