"""The prompts: what trains (``--prompt_dataset``) and what evaluates."""

from dataclasses import dataclass

from transformers.hf_argparser import HfArg


@dataclass
class DataArguments:
    _argument_group_name = "data"

    prompt_dataset: str | None = HfArg(
        default=None,
        help="Training prompts: .txt (one per line), .jsonl/.csv with --prompt_column, a saved dataset or a Hub "
        "dataset.",
    )
    eval_prompt_dataset: str | None = HfArg(
        default=None,
        help="Held-out prompts for evaluation (default: the --eval_split of --prompt_dataset if it has one).",
    )
    prompt_column: str = HfArg(
        default="prompt",
        help="Column holding the prompt in .jsonl/.csv/datasets; other columns reach rewards as metadata.",
    )
    image_column: str = HfArg(
        default="image",
        help="Column holding each prompt's conditioning image for image-to-video models (a path relative to the prompt "
        "file, a URL, or a datasets Image); a prompt set without it is text-only.",
    )
    train_split: str = HfArg(default="train", help="Split of a dataset used for training.")
    eval_split: str = HfArg(default="test", help="Split of a dataset used for evaluation.")

    def check(self) -> None:
        if self.prompt_dataset is None:
            raise ValueError("--prompt_dataset is required with your own model (a .txt file with one prompt per line works).")
