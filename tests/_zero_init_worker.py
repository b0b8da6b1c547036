"""One rank of test_zero_init's 2-process check (accelerate launch with accelerate_configs/zero3.yaml):
every pipeline folder given is loaded as the trainer loads it under zero3_init_flag, each rank
holding its shard; the gathered weights and buffers are compared with a plain from_pretrained.
Rank 0 writes {folder: {"max_diff", "held_fraction"} or {"error"}} as JSON to the first argument."""

import json
import os
import sys

import deepspeed

from genrl.distributed.launch import build_accelerator, configure_deepspeed
from genrl.distributed.zero3 import zero_init_disabled
from genrl.errors import SetupError
from genrl.policies import load_policy


def main(out_path: str, folders: list[str]) -> None:
    accelerator = build_accelerator(output_dir=os.path.dirname(out_path))
    configure_deepspeed(accelerator, micro_batch_size=1, max_grad_norm=1.0)
    config = accelerator.state.deepspeed_plugin.deepspeed_config
    results = {}
    for folder in folders:
        try:
            with zero_init_disabled():
                policy = load_policy(folder, zero3_init_config=config)
        except SetupError as error:  # must be raised on every rank, or the other one would hang
            results[folder] = {"error": str(error)}
            continue
        model = policy.transformer
        held = sum(p.ds_tensor.numel() for p in model.parameters()) / sum(p.ds_numel for p in model.parameters())
        reference = type(model).from_pretrained(os.path.join(folder, "transformer")).state_dict()
        with deepspeed.zero.GatheredParameters(list(model.parameters())):
            diff = max((t.float() - reference[name].float()).abs().max().item()
                       for name, t in model.state_dict().items())
        results[folder] = {"max_diff": diff, "held_fraction": held}
    if accelerator.is_main_process:
        with open(out_path, "w") as f:
            json.dump(results, f)
    accelerator.wait_for_everyone()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
