"""Every model family trains with every objective, LoRA and full fine-tuning: one epoch's update
(``update_policy``, the trainer's phase 6, in this process) on a tiny rollout of the family's
real layout moves the trained weights and nothing else, with finite losses and a non-zero
gradient. The scripts' multi-process runs of each family (tests/test_image_families.py,
test_wan_i2v.py, test_wan_experts.py) run one objective each; this covers the rest, and
HunyuanVideo 1.5's image-to-video layout, sampled from images."""

import copy
from types import SimpleNamespace

import numpy as np
import PIL.Image
import pytest
import torch
from accelerate import Accelerator

from genrl.objectives import OBJECTIVES, UpdateConfig
from genrl.testing.tiny_pipelines import FAMILIES, TINY_SAMPLING_DEFAULTS, build_tiny_policy
from genrl.training.experience import EpochAdvantages, EpochExperience
from genrl.training.nan_guard import NonFiniteGuard
from genrl.training.rollout import SampleBatch, SamplingConfig, sample_rollout
from genrl.training.trainable import make_trainable
from genrl.training.update import update_policy

# The extended lane: it repeats, on every family, the update path the default lane runs on SD3 (tests/test_update.py).
pytestmark = pytest.mark.extended

PROMPTS = ["a red circle", "a red circle", "a blue square", "a blue square"]
GROUP_INDICES = [0, 1, 0, 1]
ADVANTAGES = torch.tensor([1.0, -1.0, 0.5, -0.5])
# An image-to-video family's: each prompt's own.
IMAGES = [PIL.Image.fromarray((np.random.RandomState(s).rand(24, 40, 3) * 255).astype(np.uint8)) for s in range(4)]


def sampling_for(objective: str, family: str) -> SamplingConfig:
    """GRPO: two recorded SDE steps; the likelihood-free objectives: the plain ODE, CFG-free."""
    sizes = TINY_SAMPLING_DEFAULTS[family]
    if objective == "grpo":
        return SamplingConfig(num_inference_steps=4, guidance_scale=2.0, noise_level=0.7, sde_window_size=2, **sizes)
    return SamplingConfig(num_inference_steps=4, guidance_scale=1.0, noise_level=0.0, same_latent=False, **sizes)


def frozen_parts(policy) -> dict[str, torch.nn.Module]:
    """The pipeline's models other than the trained transformer: text encoders, VAE, image encoder."""
    return {name: part for name, part in policy.pipeline.components.items()
            if isinstance(part, torch.nn.Module) and name != "transformer"}


def one_update(policy, objective: str, use_lora: bool, sampling: SamplingConfig):
    """``update_policy`` on a fresh copy of the policy's transformer made trainable: (the copy,
    its weights before, the update's result)."""
    model = copy.deepcopy(policy.transformer)
    trainable = make_trainable(model, use_lora=use_lora, rank=4, lora_alpha=8, lora_target_modules="to_q,to_k,to_v,to_out.0",
                               gradient_checkpointing=False, float32=True)
    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    images = IMAGES if policy.image_conditioned else None
    rollout = sample_rollout(policy, model, SampleBatch(PROMPTS, GROUP_INDICES, seed=0, epoch=0, images=images),
                             config=sampling, device="cpu")
    config = UpdateConfig(objective=objective, micro_batch_size=2, num_timesteps=2, num_inference_steps=4,
                          guidance_scale=sampling.guidance_scale, max_grad_norm=1.0, clip_range=0.2, adv_clip_max=5.0)
    optimizer = torch.optim.SGD(trainable, lr=1e-1)
    # What update_policy reads of a run: no EMA, sampling policy, reference or progress bar.
    run = SimpleNamespace(policy=policy, model=model, optimizer=optimizer,
                          lr_scheduler=torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0),
                          accelerator=Accelerator(cpu=True), guard=NonFiniteGuard(1e-2), update_config=config,
                          sampling=sampling, args=SimpleNamespace(seed=0), global_step=0, ema=None, sampling_policy=None,
                          frozen_reference=None, progress=None)
    advantages = EpochAdvantages(ADVANTAGES.clone(), torch.arange(4), {})
    result = update_policy(run, EpochExperience(0, 0, rollout, advantages, {}, None))
    return model, before, result


@pytest.mark.parametrize("family", [*FAMILIES, "hunyuanvideo15-i2v"])
def test_every_objective_trains_lora_and_full_weights(family):
    torch.manual_seed(0)
    policy = build_tiny_policy(family).to("cpu")
    frozen = {name: copy.deepcopy(part.state_dict()) for name, part in frozen_parts(policy).items()}
    for objective in sorted(OBJECTIVES):
        sampling = sampling_for(objective, family)
        for use_lora in (True, False):
            case = f"{family} {objective} {'LoRA' if use_lora else 'full'}"
            model, before, result = one_update(policy, objective, use_lora, sampling)
            assert result.global_step == 4, case  # 2 micro batches x 2 timesteps, one optimizer step each
            assert result.grad_norms and all(0 < n < float("inf") for n in result.grad_norms), case
            logs = result.logs()
            assert logs and all(torch.isfinite(torch.tensor(v)) for v in logs.values()), (case, logs)
            moved = {k for k, v in model.named_parameters() if not torch.equal(before[k], v)}
            if use_lora:
                assert moved and all("lora_" in k for k in moved), (case, sorted(moved)[:5])
            else:
                assert len(moved) > len(before) // 2, (case, len(moved), len(before))
    for name, part in frozen_parts(policy).items():  # text encoders, VAE: untouched by every update
        for key, value in part.state_dict().items():
            assert torch.equal(value, frozen[name][key]), (family, name, key)
