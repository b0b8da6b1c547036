"""Rewards: registry, image/video layouts, video IO, frame selection, rule-based rewards,
reward-model device lifecycle and sync/async scoring.

Importing this package imports no reward model: HPSv3 and VideoAlign are registered by
dotted path and imported when a spec asks for them. Rewards never import policies or
training code.
"""

from genrl.rewards.layouts import infer_layout, prepare_images, prepare_images_tensor, prepare_video
from genrl.rewards.lifecycle import (
    cached_reward_models,
    clear_reward_models,
    get_reward_model,
    move,
    on_device,
)
from genrl.rewards.registry import (
    RewardFn,
    build_eval_reward_fn,
    build_reward_fn,
    check_reward_options,
    known_rewards,
    load_reward_options,
    parse_reward_spec,
    register_reward,
)
from genrl.rewards.scoring import RewardScorer

__all__ = [
    "RewardFn",
    "RewardScorer",
    "build_eval_reward_fn",
    "build_reward_fn",
    "check_reward_options",
    "cached_reward_models",
    "clear_reward_models",
    "get_reward_model",
    "infer_layout",
    "known_rewards",
    "load_reward_options",
    "move",
    "on_device",
    "parse_reward_spec",
    "prepare_images",
    "prepare_images_tensor",
    "prepare_video",
    "register_reward",
]
