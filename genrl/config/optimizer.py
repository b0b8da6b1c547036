"""The update: micro batches, AdamW, the learning-rate schedule and when training stops."""

import math
from dataclasses import dataclass

from transformers.hf_argparser import HfArg

from genrl.training.lr_schedule import parse_step_rules


@dataclass
class OptimizerArguments:
    _argument_group_name = "optimisation"

    train_batch_size: int = HfArg(default=8, help="Samples per micro batch per process in the update.")
    gradient_accumulation_steps: int = HfArg(
        default=1, help="Micro batches per optimizer step (each also accumulates over its trained timesteps)."
    )
    num_inner_epochs: int = HfArg(default=1, help="Passes over an epoch's samples.")
    learning_rate: float = HfArg(default=1e-4, help="AdamW learning rate (the toy NFT run: 2e-4).")
    adam_beta1: float = HfArg(default=0.9, help="AdamW beta1.")
    adam_beta2: float = HfArg(default=0.999, help="AdamW beta2.")
    adam_weight_decay: float = HfArg(default=1e-4, help="AdamW weight decay.")
    adam_epsilon: float = HfArg(default=1e-8, help="AdamW epsilon.")
    max_grad_norm: float = HfArg(default=1.0, help="Gradient norm clipping threshold.")
    lr_scheduler: str = HfArg(
        default="constant",
        help='diffusers scheduler name: "constant", "constant_with_warmup", "linear", "cosine", ...',
    )
    lr_warmup_steps: int = HfArg(default=0, help="Warm-up optimizer steps of the scheduler.")
    lr_step_rules: str | None = HfArg(
        default=None,
        help='With --lr_scheduler piecewise_constant: "m1:s1,...,m_last", the rate times m1 below optimizer step s1, '
        '..., then times m_last (e.g. "1:200,0.5").',
    )
    num_epochs: int = HfArg(default=100, help="Stop after this many epochs (or --max_train_steps).")
    max_train_steps: int | None = HfArg(default=None, help="Stop after this many optimizer steps.")

    def check(self) -> None:
        # What torch's AdamW would refuse only after the models loaded, with its traceback.
        if not (math.isfinite(self.learning_rate) and self.learning_rate >= 0):
            raise ValueError(f"--learning_rate must be a finite number >= 0, got {self.learning_rate}.")
        for name in ("adam_beta1", "adam_beta2"):
            if not 0 <= getattr(self, name) < 1:
                raise ValueError(f"--{name} must be in [0, 1), got {getattr(self, name)}.")
        if not (self.adam_epsilon >= 0 and self.adam_weight_decay >= 0 and self.max_grad_norm > 0):
            raise ValueError(
                f"--adam_epsilon and --adam_weight_decay must be >= 0 and --max_grad_norm > 0, got {self.adam_epsilon}, "
                f"{self.adam_weight_decay} and {self.max_grad_norm}."
            )
        for name in ("gradient_accumulation_steps", "num_inner_epochs", "num_epochs"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name} must be at least 1, got {getattr(self, name)}.")
        if (self.max_train_steps is not None and self.max_train_steps < 1) or self.lr_warmup_steps < 0:
            raise ValueError(f"--max_train_steps must be at least 1 and --lr_warmup_steps >= 0, got {self.max_train_steps} "
                             f"and {self.lr_warmup_steps}.")
        if (self.lr_scheduler == "piecewise_constant") != (self.lr_step_rules is not None):
            raise ValueError("--lr_step_rules goes with --lr_scheduler piecewise_constant, and that scheduler needs the "
                             "rules: give both or neither.")
        if self.lr_step_rules is not None:
            parse_step_rules(self.lr_step_rules)
