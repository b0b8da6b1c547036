"""What an epoch trains on and how: the prompt groups and their advantages
(``RolloutArguments``), the objective (``ObjectiveArguments``), and the flags that only GRPO
(``GRPOArguments``) or only the likelihood-free objectives nft and awm (``ForwardArguments``)
read. Each objective checks its own flags (``genrl.objectives``); ``genrl.config.checks``
calls them."""

from dataclasses import dataclass
from typing import Literal

from transformers.hf_argparser import HfArg

from genrl.objectives import OBJECTIVES


@dataclass
class RolloutArguments:
    _argument_group_name = "rollouts and advantages"

    group_size: int = HfArg(default=8, help="Samples per prompt (K).")
    rollout_batch_size: int = HfArg(default=8, help="Samples per rollout batch per process.")
    rollout_batches_per_epoch: int = HfArg(default=2, help="Rollout batches per process per epoch.")
    train_samples_per_group: int | None = HfArg(
        default=None,
        help="Train on M of each group's --group_size samples: the M whose advantages vary most (PODS's max-variance "
        "down-sampling: the j worst and M - j best), their advantages normalised among themselves. A larger group "
        "then costs rollouts, not training. Default: all of them.",
    )
    std_mode: Literal["group", "global", "max_group"] = HfArg(
        default="group",
        help="Whose standard deviation normalises the advantages: the prompt group's, the epoch's, or the largest "
        "group's.",
    )
    adv_clip_max: float = HfArg(default=5.0, help="Advantages are clipped to [-this, this].")
    filter_zero_advantage: bool = HfArg(
        default=False, help="Drop zero-advantage samples (every rank keeps the same count)."
    )


@dataclass
class ObjectiveArguments:
    _argument_group_name = "objective"

    # The live view of the registry: an objective registered before the flags are parsed is a choice.
    objective: str = HfArg(
        default="grpo", metadata={"choices": OBJECTIVES.keys()},
        help="grpo: clipped ratio loss on the recorded SDE transitions (needs --noise_level > 0). nft: DiffusionNFT, "
        "awm: advantage-weighted flow matching; both train on the clean samples noised again (any sampler, no "
        "log-probs). The toy run without a model: nft (recipes/toy_nft.yaml).",
    )
    timestep_fraction: float = HfArg(
        default=1.0,
        help="Fraction of the timesteps trained on per sample: of the stochastic steps (grpo), of the sampling steps "
        "(nft, awm).",
    )
    beta: float = HfArg(default=0.0, help="KL weight against the reference policy.")

    def check(self) -> None:
        if not 0 < self.timestep_fraction <= 1:
            raise ValueError(f"--timestep_fraction must be in (0, 1], got {self.timestep_fraction}.")


@dataclass
class GRPOArguments:
    _argument_group_name = "GRPO"

    clip_range: float = HfArg(default=0.001, help="PPO clip range of the probability ratio.")
    kl_form: Literal["transition", "sde_variance"] = HfArg(
        default="transition",
        help="GRPO's KL: transition = KL of the two Gaussian steps, / 2 (std_t sqrt|dt|)^2 (Flow-GRPO's Wan script, "
        "Flash-GRPO); sde_variance = / 2 std_t^2 (Flow-GRPO's SD3 script), i.e. x |dt|.",
    )
    no_timestep_shuffle: bool = HfArg(default=False, help="GRPO: train on the first steps, in order.")
    grpo_guard: bool = HfArg(
        default=False,
        help="GRPO-Guard's normalised ratio: s (logp - logp_old) + mean((mu - mu_old)^2) / (2s), the SDE ratio's "
        "negative bias removed and the timesteps evened out (flow_sde only).",
    )
    grpo_guard_reweight: bool = HfArg(
        default=False,
        help="GRPO-Guard's per-timestep gradient reweighting: each trained step's loss times 1 / (T dt), so the short "
        "steps of a shifted schedule train as much as the long ones (flow_sde only; the paper uses it with "
        "--grpo_guard).",
    )


@dataclass
class ForwardArguments:
    _argument_group_name = "NFT and AWM"

    nft_beta: float = HfArg(
        default=1.0,
        help="NFT's step size beta: how far the implicit positive/negative policies sit from the sampling one (1.0, "
        "DiffusionNFT's; the toy run: 0.5).",
    )
    train_sigma_range: list[float] | None = HfArg(
        default=None, metadata={"nargs": 2, "metavar": ("LO", "HI")},
        help="Draw the trained timesteps among the sampling steps whose noise level sigma lies in [LO, HI] (1: pure "
        "noise, where a sample's layout is decided; 0: clean); default: every step. GRPO's counterpart is "
        "--sde_window_range.",
    )
    sampling_policy_decay_rate: float = HfArg(
        default=0.0,
        help="Sample from a soft-updated copy of the trained weights, theta_old <- eta theta_old + (1 - eta) theta "
        "after optimizer step i, eta = min(rate i, --sampling_policy_decay_max) (DiffusionNFT: 0.001). 0: sample "
        "from the trained weights (on-policy).",
    )
    sampling_policy_decay_max: float = HfArg(default=0.5, help="The cap of the soft update's eta (DiffusionNFT: 0.5).")
