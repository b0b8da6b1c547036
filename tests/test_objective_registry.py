"""An objective is one module: registered in ``genrl.objectives.OBJECTIVES``, it is a
``--objective`` choice, its checks (and the other objectives' checks of their own flags) run when
the flags are parsed, it sizes the trained timesteps, and ``update_policy`` trains it, with no
other file touched. The objective here is defined in the test."""

from types import SimpleNamespace

import pytest
import torch
from accelerate import Accelerator

from genrl.objectives import OBJECTIVES, Objective, UpdateConfig
from genrl.testing.tiny_pipelines import build_tiny_policy
from genrl.training import train_args
from genrl.training.experience import EpochAdvantages, EpochExperience
from genrl.training.nan_guard import NonFiniteGuard
from genrl.training.rollout import SampleBatch, SamplingConfig, sample_rollout
from genrl.training.update import update_policy

from test_bad_input import args_with, parse_error

torch.set_num_threads(2)


class PushVelocity(Objective):
    """A toy objective: the conditional velocity at each sample's clean latents, at column j of
    its prepared timesteps, pushed up or down with the sample's advantage."""

    def __init__(self):
        self.prepared_with, self.trained_at = [], []

    def check_args(self, args):
        if args.beta > 0:
            raise ValueError(f"--objective push has no KL term, got --beta {args.beta}; drop it.")

    def timestep_pool(self, args):
        return args.num_inference_steps

    def prepare(self, policy, model, rollout, record, *, config, seed, epoch, device):
        self.prepared_with.append(record)
        return torch.linspace(900, 100, config.num_timesteps)  # (num_timesteps,), scheduler units

    def loss(self, update, idx, timestep, *, old_is_current):
        self.trained_at.append((idx.tolist(), timestep))
        policy, rollout = update.policy, update.rollout
        embeds = {k: v[idx] for k, v in rollout.embeds.items()}
        t = update.prepared[timestep].expand(len(idx))
        velocity = policy.predict_velocity(update.model, rollout.final_latents[idx], t, embeds,
                                           policy.conditional_guidance(update.config.guidance_scale))
        loss = -(update.advantages[idx] * velocity.float().mean(dim=tuple(range(1, velocity.ndim)))).mean()
        return loss, {"policy_loss": loss.detach()}


@pytest.fixture
def push(monkeypatch):
    objective = PushVelocity()
    monkeypatch.setitem(OBJECTIVES, "push", objective)
    return objective


def test_an_unregistered_objective_is_not_a_choice(tiny_sd3, prompt_file, tmp_path, capsys):
    with pytest.raises(SystemExit):
        train_args.parse_args(args_with(tiny_sd3, prompt_file, str(tmp_path / "out"), "--objective", "push"))
    assert "argument --objective: invalid choice: 'push'" in capsys.readouterr().err


def test_a_registered_objective_is_parsed_checked_and_sizes_the_timesteps(push, tiny_sd3, prompt_file, tmp_path, capsys):
    out = str(tmp_path / "out")
    args = train_args.parse_args(args_with(tiny_sd3, prompt_file, out, "--objective", "push", "--timestep_fraction", "0.5"))
    assert args.objective == "push" and train_args.num_trained_timesteps(args) == 2  # half of the 4 sampling steps
    # Its own check, and GRPO's of its flags given to another objective.
    assert parse_error(capsys, args_with(tiny_sd3, prompt_file, out, "--objective", "push", "--beta", "0.1")) == (
        "--objective push has no KL term, got --beta 0.1; drop it.")
    assert parse_error(capsys, args_with(tiny_sd3, prompt_file, out, "--objective", "push", "--grpo_guard")) == (
        "--grpo_guard normalises GRPO's ratio of flow_sde steps; it does not apply to --objective push with --sde_type "
        "flow_sde (use --objective grpo --sde_type flow_sde, or drop --grpo_guard).")
    # The no-argument run has no preset for it: the shared defaults.
    assert train_args.parse_args(["--objective", "push", "--output_dir", out]).objective == "push"


def test_update_policy_trains_a_registered_objective(push):
    policy = build_tiny_policy("sd3").to("cpu")
    sampling = SamplingConfig(num_inference_steps=4, guidance_scale=1.0, noise_level=0.0, same_latent=False)
    prompts, group_indices = ["a red circle"] * 2 + ["a blue square"] * 2, [0, 1, 0, 1]
    rollout = sample_rollout(policy, policy.transformer, SampleBatch(prompts, group_indices, seed=3, epoch=0),
                             config=sampling, device="cpu")
    config = UpdateConfig(objective="push", micro_batch_size=2, num_timesteps=2, num_inference_steps=4, guidance_scale=1.0,
                          max_grad_norm=1.0, clip_range=1e-3, adv_clip_max=5.0)
    model = policy.transformer
    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    lr_scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    # What update_policy reads of a run: no EMA, sampling policy, reference or progress bar.
    run = SimpleNamespace(policy=policy, model=model, optimizer=optimizer, lr_scheduler=lr_scheduler,
                          accelerator=Accelerator(cpu=True), guard=NonFiniteGuard(1e-2), update_config=config,
                          sampling=sampling, args=SimpleNamespace(seed=0), global_step=5, ema=None, sampling_policy=None,
                          frozen_reference=None, progress=None)
    advantages = EpochAdvantages(torch.tensor([1.0, -1.0, 0.5, -0.5]), torch.arange(4), {})
    result = update_policy(run, EpochExperience(0, 5, rollout, advantages, {}, None))
    # Prepared once, before the first pass; each micro batch of 2 at both of its timesteps, one
    # optimizer step each (no accumulation here).
    assert push.prepared_with == [[]]
    assert sorted(i for idx, _ in push.trained_at for i in idx) == [0, 0, 1, 1, 2, 2, 3, 3]
    assert [timestep for _, timestep in push.trained_at] == [0, 1, 0, 1]
    assert result.global_step == 9 and len(result.step_stats) == 4 and "train/policy_loss" in result.logs()
    assert any(not torch.equal(before[k], v) for k, v in model.named_parameters()), "no weight moved"
