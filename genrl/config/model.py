"""The trained weights: the base model (``ModelArguments``), a LoRA adapter instead of every
weight (``LoraArguments``) and an EMA of them (``EMAArguments``)."""

import os
from dataclasses import dataclass
from typing import Literal

from transformers.hf_argparser import HfArg


@dataclass
class ModelArguments:
    _argument_group_name = "model"

    pretrained_model_name_or_path: str | None = HfArg(
        default=None,
        help="Diffusers pipeline folder or Hub id (Wan, SD3, FLUX). Without it (and without --config) the run is the "
        "shipped toy model's, recipes/toy_nft.yaml (see the end of this help).",
    )
    revision: str | None = HfArg(default=None, help="Hub revision (branch, tag or commit) of the model.")
    variant: str | None = HfArg(default=None, help='Weight file variant to load, e.g. "fp16".')
    wan_expert: Literal["high", "low"] | None = HfArg(
        default=None,
        help="A two-expert Wan 2.2 model (A14B): the expert to train, high (transformer, the noisy steps from "
        "boundary_ratio x 1000 up) or low (transformer_2, the steps below); the other stays frozen and samples its own "
        "steps. The trained steps must be the expert's own.",
    )

    def check(self) -> None:
        model = self.pretrained_model_name_or_path
        if model is None:
            raise ValueError("--pretrained_model_name_or_path is required with --config: set it in the file or pass it.")
        # A Hub id is 'org/name'; anything else that looks like a path must be a folder here.
        looks_local = os.path.isabs(model) or model.startswith(".") or os.path.exists(model) or model.count("/") > 1
        if looks_local and not os.path.isdir(model):
            raise FileNotFoundError(f"--pretrained_model_name_or_path {model!r} is not a folder (nor a Hub id like 'org/name').")


@dataclass
class LoraArguments:
    _argument_group_name = "LoRA"

    use_lora: bool = HfArg(default=False, help="Train a LoRA adapter instead of every transformer weight.")
    rank: int = HfArg(default=32, help="LoRA rank.")
    lora_alpha: int = HfArg(default=64, help="LoRA alpha (scale = alpha / rank).")
    lora_target_modules: str = HfArg(
        default="to_q,to_k,to_v,to_out.0",
        help="Comma-separated module names to adapt; each matches the modules whose dotted name ends with it "
        "(attn.to_q: the joint attention's, not SD3.5-M's attn2.to_q).",
    )


@dataclass
class EMAArguments:
    _argument_group_name = "EMA"

    use_ema: bool = HfArg(default=False, help="Keep an fp32 EMA of the trained weights (used by eval and export).")
    ema_decay: float = HfArg(default=0.9, help="EMA decay per update.")
    ema_update_interval: int = HfArg(
        default=8, help="Update the EMA every N optimizer steps (the global step count, not micro batches)."
    )
    ema_warmup: bool = HfArg(default=False, help="Ramp the decay up from 0 over the first updates.")
    ema_device: str | None = HfArg(default=None, help="Where the fp32 shadow lives (default: with the weights).")
