"""The checks across sections, on the flat arguments: the batch layout against the processes
that run, each objective's checks of the flags (then the SDE window's), what ZeRO-3 rules out,
and the Hub repo name."""

import argparse
import os

from genrl.config.sampling import check_sde_window
from genrl.data.sampler import check_batch_sizes
from genrl.distributed.launch import check_launched_processes
from genrl.distributed.zero3 import under_zero3
from genrl.objectives import OBJECTIVES, get_objective


def check_run(args: argparse.Namespace) -> None:
    """A ``ValueError`` of one sentence for the first check that fails; fills in
    ``hub_model_id`` when pushing."""
    check_launched_processes()  # before the sizes: they are checked for the processes that run
    check_batch_sizes(
        group_size=args.group_size,
        train_batch_size=args.rollout_batch_size,
        num_processes=int(os.environ.get("WORLD_SIZE", "1")),
        batches_per_epoch=args.rollout_batches_per_epoch,
        train_micro_batch_size=args.train_batch_size * args.gradient_accumulation_steps,
        train_samples_per_group=args.train_samples_per_group,
    )
    # Each objective checks its own flags: the chosen one that they fit, the others that theirs are not given.
    objective = get_objective(args.objective)
    for other in OBJECTIVES.values():
        if other is not objective:
            other.check_unused_args(args)
    objective.check_args(args)
    check_sde_window(args)
    # accelerate launch exports the config's ZeRO stage, so this is known before any model loads.
    if args.beta > 0 and not args.use_lora and under_zero3():
        raise ValueError(
            "--beta > 0 with full fine-tuning under ZeRO-3 would keep a full reference copy on every rank; "
            "use --use_lora (the reference is the adapter switched off) or --beta 0."
        )
    if args.watch_reference and not args.use_lora and under_zero3():
        raise ValueError(
            "--watch_reference with full fine-tuning under ZeRO-3 would keep a full reference copy on every rank; "
            "use --use_lora (the reference is the adapter switched off) or leave --watch_reference out."
        )
    if args.push_to_hub and not args.hub_model_id:
        args.hub_model_id = os.path.basename(args.output_dir)
