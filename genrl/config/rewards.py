"""The rewards: what trains (``--reward_fn``), what evaluation reports, and how they are scored."""

from dataclasses import dataclass
from typing import Literal

from transformers.hf_argparser import HfArg

from genrl.rewards import check_reward_options, load_reward_options, parse_reward_spec


@dataclass
class RewardArguments:
    _argument_group_name = "rewards"

    reward_fn: str | None = HfArg(
        default=None,
        help='Rewards and weights, "name:weight,name:weight" (registered names or package.module:function).',
    )
    eval_reward_fn: str | None = HfArg(
        default=None,
        help="Rewards reported at evaluation (default: --reward_fn); weight 0 reports without adding to the total.",
    )
    reward_options: str | None = HfArg(
        default=None,
        help='JSON (or a .json file) of per-reward options, e.g. {"hpsv3": {"checkpoint": "...", "base_model": "..."}}; '
        "in a config file also a mapping.",
    )
    reward_mode: Literal["async", "sync"] = HfArg(
        default="async",
        help="async: score batch i in a thread while batch i+1 denoises (reward models on --reward_device). sync: "
        "reward models on the training device, scored after all rollouts of the epoch.",
    )
    reward_device: str = HfArg(default="cpu", help="Device of reward models in async mode.")
    reward_workers: int = HfArg(default=1, help="Threads scoring rollout batches in async mode.")
    reward_clear_before_train: bool = HfArg(
        default=False, help="Free reward models before the policy update and rebuild them next epoch (tight memory)."
    )
    reward_combine: Literal["sum", "normalize_each"] = HfArg(
        default="sum",
        help="sum: normalise the weighted sum of rewards; normalize_each: normalise each reward, then sum with weights.",
    )

    def check(self) -> None:
        """Unknown reward names fail here, listing the known ones; so do module:function rewards
        that do not import and option paths that do not exist. Fills in ``eval_reward_fn``."""
        if self.reward_fn is None:
            raise ValueError('--reward_fn is required with your own model, e.g. --reward_fn "hpsv3:1.0".')
        parse_reward_spec(self.reward_fn)
        self.eval_reward_fn = self.eval_reward_fn or self.reward_fn
        parse_reward_spec(self.eval_reward_fn)
        check_reward_options(load_reward_options(self.reward_options), [self.reward_fn, self.eval_reward_fn])
