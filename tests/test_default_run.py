"""What the no-argument run sets, per objective, and that a user's own model leaves it."""

import pytest

from genrl.training import train_args
from genrl.training.train_args import parse_args, toy_run


def test_no_argument_run_is_the_toy_nft_config_file():
    args = parse_args([])
    assert args.objective == "nft"
    for key, value in toy_run().items():
        assert getattr(args, key) == value, key
    assert args.pretrained_model_name_or_path == train_args.DEFAULT_MODEL


@pytest.mark.parametrize("objective", ["grpo", "nft", "awm"])
def test_choosing_an_objective_on_the_toy_run_loads_its_config_file(objective):
    args = parse_args(["--objective", objective])
    assert args.objective == objective == toy_run(objective)["objective"]
    for key, value in toy_run(objective).items():
        assert getattr(args, key) == value, key
    if objective == "grpo":
        assert args.noise_level > 0 and args.same_latent  # GRPO needs stochastic steps to train on
    else:
        assert args.train_sigma_range == [0.4, 1.0] and not args.same_latent


def test_flags_on_the_command_line_win_over_the_default_run():
    args = parse_args(["--objective", "awm", "--learning_rate", "1e-5", "--noise_level", "0.3"])
    assert (args.learning_rate, args.noise_level) == (1e-5, 0.3)


def test_a_users_own_model_gets_the_plain_defaults_not_the_toy_run(tmp_path):
    prompts = tmp_path / "p.txt"
    prompts.write_text("a red circle\n")
    args = parse_args(["--pretrained_model_name_or_path", train_args.DEFAULT_MODEL, "--prompt_dataset", str(prompts),
                       "--reward_fn", "toy_geneval"])
    assert args.objective == "grpo" and args.noise_level == 0.7 and args.same_latent
    assert args.max_train_steps is None and args.eval_prompt_dataset is None
    assert args.vae_decode_batch_size == 1  # a video VAE's memory stays bounded unless asked
    # The toy run's NFT beta (0.5) and learning rate (2e-4) are tuned to the toy model: a user's own
    # NFT run keeps DiffusionNFT's beta 1 and the plain 1e-4.
    own_nft = parse_args(["--pretrained_model_name_or_path", train_args.DEFAULT_MODEL, "--prompt_dataset", str(prompts),
                          "--reward_fn", "toy_geneval", "--objective", "nft", "--noise_level", "0"])
    assert own_nft.nft_beta == 1.0 and parse_args([]).nft_beta == 0.5
    assert own_nft.learning_rate == 1e-4 and parse_args([]).learning_rate == 2e-4


def test_the_toy_run_decodes_in_chunks_that_divide_its_rollout_batches():
    """The toy run's 8-row decode calls: no rollout batch ends in a padded call."""
    args = parse_args([])
    assert args.vae_decode_batch_size == 8
    assert args.rollout_batch_size % args.vae_decode_batch_size == 0
    assert args.eval_batch_size % args.vae_decode_batch_size == 0


def test_the_no_argument_run_swaps_to_zero3_without_another_flag(monkeypatch, capsys):
    # What accelerate launch sets for accelerate_configs/zero3.yaml: the default run must start
    # as it is (its reward watch without the frozen full copy); asking for the copy is refused.
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_ZERO_STAGE", "3")
    args = train_args.parse_args([])
    assert args.watch_reference is False and args.objective == "nft"
    with pytest.raises(SystemExit):
        train_args.parse_args(["--watch_reference"])
    assert "ZeRO-3" in capsys.readouterr().err
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_ZERO_STAGE", "2")
    assert train_args.parse_args([]).watch_reference is True


def test_the_no_argument_nft_trains_every_step_of_its_sigma_range():
    # The default NFT re-noises each sample at all of the shipped model's steps with sigma in
    # the range (docs/history.md: training 6 of 6 ends steadier than 4 of 6); a change of the
    # schedule, the step count or the range that broke that would otherwise go unnoticed.
    from genrl.objectives import rollout_sigmas, steps_in_sigma_range
    from genrl.policies import load_policy

    args = parse_args([])
    sigmas = rollout_sigmas(load_policy(args.pretrained_model_name_or_path), train_args.sampling_configs(args)[0])
    inside = steps_in_sigma_range(sigmas, args.train_sigma_range)
    assert train_args.num_trained_timesteps(args) == len(inside) == 6
    assert sigmas[inside].min() >= 0.4 and sigmas[len(inside)] < 0.4  # the 6 noisiest steps


def test_the_no_argument_run_uses_every_core_and_a_user_can_say_how_many():
    """`accelerate launch` sets OMP_NUM_THREADS=1 for a CPU run: the demo would leave cores idle."""
    from genrl.distributed.launch import cpu_threads_per_process
    assert parse_args([]).cpu_threads == 0
    assert parse_args(["--cpu_threads", "1"]).cpu_threads == 1
    assert cpu_threads_per_process(0, cores=2, local_processes=1) == 2
    assert cpu_threads_per_process(0, cores=16, local_processes=2) == 8
    assert cpu_threads_per_process(0, cores=2, local_processes=4) == 1  # never 0
    assert cpu_threads_per_process(3, cores=2, local_processes=1) == 3  # asked for: given
    with pytest.raises(ValueError, match="cpu_threads must be >= 0"):
        cpu_threads_per_process(-1, cores=2, local_processes=1)
    with pytest.raises(SystemExit):
        parse_args(["--cpu_threads", "-2"])
