"""Evaluation on held-out prompts (``EvaluationArguments``) and the signs of reward hacking
watched at each one (``RewardWatchArguments``)."""

from dataclasses import dataclass

from transformers.hf_argparser import HfArg


@dataclass
class EvaluationArguments:
    _argument_group_name = "evaluation"

    eval_steps: int | None = HfArg(
        default=None,
        help="Evaluate before training, then at the end of each epoch that passed a multiple of this many steps.",
    )
    eval_max_batches: int = HfArg(default=4, help="Evaluate on at most this many batches of prompts.")
    eval_batch_size: int = HfArg(default=8, help="Prompts per evaluation batch (all processes together).")
    eval_num_inference_steps: int | None = HfArg(default=None, help="Evaluation steps (default: --num_inference_steps).")
    eval_guidance_scale: float | None = HfArg(default=None, help="Evaluation guidance (default: --guidance_scale).")
    eval_seed: int = HfArg(default=0, help="Seed of the evaluation noise (the same at every evaluation).")
    eval_samples_per_prompt: int = HfArg(
        default=1,
        help="Noise draws of each evaluation prompt; the score is their mean (draw k: the noise of --eval_seed + 1000 "
        "k). One evaluation moves with its noise; K draws move about sqrt(K) times less.",
    )
    eval_log_samples: int = HfArg(
        default=8, help="Evaluation samples shown in the logged grid, evenly spaced over the evaluated prompts."
    )
    eval_video_fps: float = HfArg(default=16.0, help="Frame rate of the evaluation MP4s (video models).")
    eval_pipeline_defaults: bool = HfArg(
        default=False,
        help="Also score the base (the first evaluation) and the final weights (the last) sampled as pipe(prompt) samples: "
        "the pipeline's own default steps and guidance (SD3: 28 steps, CFG 7), same prompts and noise; the model card "
        "states both. Each costs its steps (x 2 under CFG) over the evaluation's: 5.6 evaluations on the toy run "
        "(28 steps at CFG 7 against 10 unguided).",
    )

    def check(self) -> None:
        if self.eval_samples_per_prompt < 1:
            raise ValueError(f"--eval_samples_per_prompt must be at least 1, got {self.eval_samples_per_prompt}.")


@dataclass
class RewardWatchArguments:
    _argument_group_name = "reward watch"
    _argument_group_description = (
        "Signs of reward hacking, at each evaluation: held-out rewards (--eval_reward_fn names with weight 0) falling "
        "while the trained one rises, the samples of a prompt collapsing, the drift from the reference policy."
    )

    eval_diversity_prompts: int = HfArg(
        default=2,
        help="Prompts (spread over the evaluation set) whose samples measure diversity at each evaluation; 0: off.",
    )
    eval_diversity_samples: int = HfArg(default=4, help="Samples per diversity prompt, each from its own noise.")
    watch_patience: int = HfArg(
        default=3,
        help="Warn when a trained reward rose while a held-out one fell at each of this many evaluations in a row.",
    )
    watch_diversity_fraction: float = HfArg(
        default=0.75,
        help="Warn when the diversity falls below this fraction of its first value (a quarter of the base's variety "
        "gone is worth a look at the samples, even where the reward rose honestly).",
    )
    watch_reference: bool = HfArg(
        default=False,
        help="Full fine-tuning: keep a frozen copy of the initial weights so that evaluation also logs the drift from "
        "them (eval/velocity_kl; a second copy of the transformer in memory). LoRA and --beta > 0 log it without "
        "this.",
    )
    stop_on_reward_hacking: bool = HfArg(
        default=False,
        help="Stop at the first alarm, keeping the checkpoints written before it (none after it, no export).",
    )

    def check(self) -> None:
        if self.eval_diversity_prompts < 0 or (self.eval_diversity_prompts and self.eval_diversity_samples < 2):
            raise ValueError(
                f"--eval_diversity_prompts must be >= 0 and --eval_diversity_samples >= 2 (diversity compares samples), "
                f"got {self.eval_diversity_prompts} and {self.eval_diversity_samples}."
            )
        if self.watch_patience < 1 or not 0 <= self.watch_diversity_fraction < 1:
            raise ValueError(
                f"--watch_patience must be >= 1 and --watch_diversity_fraction in [0, 1), got {self.watch_patience} and "
                f"{self.watch_diversity_fraction}."
            )
