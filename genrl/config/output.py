"""Where a run's results go: the output folder and its logs (``OutputArguments``), its
checkpoints (``CheckpointArguments``) and the Hub (``HubArguments``)."""

import os
import tempfile
from dataclasses import dataclass

from transformers.hf_argparser import HfArg


@dataclass
class CheckpointArguments:
    _argument_group_name = "checkpoints"

    checkpointing_steps: int | None = HfArg(
        default=None,
        help="Checkpoint at the end of each epoch in which the optimizer step count passed a multiple of this.",
    )
    checkpoints_total_limit: int | None = HfArg(
        default=None, help="Keep at most this many checkpoints (the oldest is removed after a new one is complete)."
    )
    resume_from_checkpoint: str | None = HfArg(default=None, help='"latest" or a checkpoint folder.')
    overwrite_output_dir: bool = HfArg(
        default=False, help="Start afresh: remove the checkpoints and metrics already in --output_dir."
    )

    def check(self) -> None:
        if self.overwrite_output_dir and self.resume_from_checkpoint:
            raise ValueError("--overwrite_output_dir starts afresh and --resume_from_checkpoint continues: give one of them.")


@dataclass
class HubArguments:
    _argument_group_name = "Hub"

    push_to_hub: bool = HfArg(default=False, help="Upload the export and its model card at the end.")
    hub_model_id: str | None = HfArg(default=None, help="Hub repo to push to (default: the --output_dir name).")
    hub_token: str | None = HfArg(
        default=None,
        help="Hub token for the upload (never recorded; `hf auth login` or HF_TOKEN keep it off the command line).",
    )
    hub_private: bool = HfArg(default=False, help="Create the Hub repo private.")
    push_checkpoints: bool = HfArg(default=False, help="Also push each checkpoint (in the background).")


@dataclass
class OutputArguments:
    _argument_group_name = "output and logging"

    output_dir: str = HfArg(default="genrl-output", help="Where the export, samples, logs and checkpoints go.")
    logging_dir: str = HfArg(default="logs", help="Folder of metrics.jsonl and tracker logs, inside --output_dir.")
    report_to: str = HfArg(default="tensorboard", help='"tensorboard", "wandb", "all" or "none".')
    tracker_project_name: str = HfArg(default="genrl", help="Project name for the trackers.")

    def check(self) -> None:
        """Makes ``output_dir`` absolute: samples, plots, checkpoints and the card are paths inside
        it, and a relative one would be resolved against it a second time (genrl-output/genrl-output/...)."""
        self.output_dir = os.path.abspath(self.output_dir)
        check_writable(self.output_dir)


def check_writable(folder: str) -> None:
    """A file can be written in ``folder``, or in its deepest existing parent when it does not
    exist yet (nothing is created here); else one sentence saying why not: found now rather
    than at the first checkpoint, after the models loaded."""
    existing = folder
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    try:
        if not os.path.isdir(existing):
            raise NotADirectoryError(f"{existing} is a file")
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as e:
        raise ValueError(f"--output_dir {folder!r} cannot be written to ({e.strerror or e}); choose another folder.") from None
