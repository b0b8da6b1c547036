from argparse import Namespace

from genrl.training.schedule import RunSchedule, backward_passes_per_step
from genrl.training.train_args import parse_args


def grpo_args(**overrides) -> Namespace:
    """GRPO flags with 8 sampling steps: 7 recorded steps, all trained at --timestep_fraction 1."""
    flags = dict(
        objective="grpo", num_inference_steps=8, sde_window_size=0, timestep_fraction=1.0, rollout_batch_size=8,
        rollout_batches_per_epoch=4, group_size=8, train_samples_per_group=None, train_batch_size=4,
        gradient_accumulation_steps=1, num_inner_epochs=1, num_epochs=10, max_train_steps=None,
    )
    flags.update(overrides)
    return Namespace(**flags)


def test_every_sample_trained_gives_one_step_per_accumulated_micro_batches():
    schedule = RunSchedule.from_args(grpo_args(gradient_accumulation_steps=2), num_processes=3, num_prompts=5)
    assert schedule.samples_per_epoch == schedule.trained_samples_per_epoch == 32  # 8 × 4
    assert schedule.samples_per_epoch_all_processes == 96
    assert schedule.timesteps_per_sample == 7  # every recorded step but the last
    assert schedule.backward_passes_per_step == 14  # 2 micro batches × 7 timesteps
    assert schedule.steps_per_epoch == 4  # 32 / 4 = 8 micro batches, 2 per step
    assert schedule.planned_steps == 40


def test_backward_passes_multiply_accumulation_by_trained_timesteps():
    args = grpo_args(gradient_accumulation_steps=3, timestep_fraction=0.5, sde_window_size=4)
    assert backward_passes_per_step(args) == 6  # 3 × (half of the 4-step window)
    assert RunSchedule.from_args(args, num_processes=1, num_prompts=1).backward_passes_per_step == 6


def test_train_samples_per_group_trains_fewer_samples_and_so_takes_fewer_steps():
    schedule = RunSchedule.from_args(grpo_args(train_samples_per_group=2), num_processes=1, num_prompts=5)
    assert schedule.samples_per_epoch == 32
    assert schedule.trained_samples_per_epoch == 8  # 4 groups × 2
    assert schedule.steps_per_epoch == 2 and schedule.planned_steps == 20


def test_inner_epochs_multiply_the_steps_and_max_train_steps_caps_them():
    schedule = RunSchedule.from_args(grpo_args(num_inner_epochs=2, max_train_steps=13), num_processes=1, num_prompts=5)
    assert schedule.steps_per_epoch == 16
    assert schedule.planned_steps == 13  # of 160
    assert RunSchedule.from_args(grpo_args(max_train_steps=500), num_processes=1, num_prompts=5).planned_steps == 80


def test_an_epoch_smaller_than_an_optimizer_step_still_counts_one_step():
    schedule = RunSchedule.from_args(grpo_args(gradient_accumulation_steps=16), num_processes=1, num_prompts=5)
    assert schedule.steps_per_epoch == 1 and schedule.planned_steps == 10


def test_the_no_argument_run():
    schedule = RunSchedule.from_args(parse_args([]), num_processes=1, num_prompts=442)
    assert (schedule.samples_per_epoch, schedule.trained_samples_per_epoch, schedule.timesteps_per_sample) == (256, 128, 6)
    assert schedule.backward_passes_per_step == 12  # --gradient_accumulation_steps 2 × 6
    assert schedule.steps_per_epoch == 2  # 128 / 32 = 4 micro batches, 2 per step
    assert schedule.planned_steps == 200


def test_the_summary_names_each_figure_once_and_keeps_the_lower_case_marker():
    summary = RunSchedule.from_args(grpo_args(train_samples_per_group=2, gradient_accumulation_steps=2), num_processes=2,
                                    num_prompts=5).summary()
    lines = summary.splitlines()
    assert lines[0] == "***** Running training *****"
    assert "  Num prompts = 5" in lines and "  Num processes = 2" in lines
    assert "  Samples per process per epoch = 32 (8 trained: the 2 of each group whose rewards vary most)" in lines
    assert "  Backward passes per optimizer step = 14 (gradient accumulation 2 × 7 trained timesteps per sample)" in lines
    assert "  Optimizer steps per epoch = 1" in lines and "  Total optimization steps = 10" in lines
    # The launch tests take this phrase as the sign that the models have loaded.
    assert "trained timesteps per sample" in summary
