"""Which checkpoint every rank resumes, and which distributed set-up may resume it: the decisions of
genrl/checkpoints/node_storage.py and genrl/checkpoints/checkpointing.py, with the ranks' answers simulated (the real
collectives run in tests/test_multi_node.py and tests/test_train_distributed.py)."""

import json
import os
from types import SimpleNamespace

import pytest

import genrl.checkpoints.node_storage as node_storage
from genrl.checkpoints.checkpointing import check_checkpoint_layout
from genrl.checkpoints.node_storage import agree_on_resume, missing_rank_files
from genrl.errors import SetupError


def ddp_checkpoint(path, step, ranks=(0, 1), ema=True):
    """The files a 2-process DDP run with EMA writes into ``checkpoint-<step>``."""
    folder = os.path.join(path, f"checkpoint-{step}")
    os.makedirs(os.path.join(folder, "ema"), exist_ok=True)
    with open(os.path.join(folder, "genrl_state.json"), "w") as f:
        json.dump({"global_step": step, "epoch": step - 1, "num_processes": 2, "format": "torch",
                   "per_rank_dirs": ["ema"] if ema else []}, f)
    for name in ("model.safetensors", "optimizer.bin"):
        open(os.path.join(folder, name), "w").close()
    for rank in ranks:
        open(os.path.join(folder, f"random_states_{rank}.pkl"), "w").close()
        if ema:
            open(os.path.join(folder, "ema", f"rank{rank}.pt"), "w").close()
    return folder


def test_each_rank_files_are_named_when_missing(tmp_path):
    folder = ddp_checkpoint(tmp_path, 2, ranks=(0,))
    assert missing_rank_files(folder, 0, ["ema"]) == []
    assert missing_rank_files(folder, 1, ["ema"]) == ["random_states_1.pkl", "ema/rank1.pt"]
    os.remove(os.path.join(folder, "optimizer.bin"))
    assert missing_rank_files(folder, 0, ["ema"]) == ["optimizer.bin"]


def findings(*folders_per_rank):
    """Each rank's report on its own output folder, as they are gathered."""
    return [node_storage.rank_findings(sorted((os.path.join(d, n) for n in os.listdir(d)), key=node_storage._key), rank,
                                       {os.path.join(d, n): ["ema"] for n in os.listdir(d)})
            for rank, d in enumerate(folders_per_rank)]


def test_ranks_resume_the_newest_step_they_all_have_complete(tmp_path):
    node0, node1 = tmp_path / "node0", tmp_path / "node1"
    for step in (2, 4):
        ddp_checkpoint(node0, step, ranks=(0,))
    ddp_checkpoint(node1, 2, ranks=(1,))
    ddp_checkpoint(node1, 4, ranks=())  # died while saving: the state file is there, its rank's files are not
    assert node_storage.choose_resume(findings(node0, node1), latest=True, named=None, output_dir="out") == (
        (2, "checkpoint-2"), "Resuming checkpoint-2, the newest one every rank has complete (not every rank has checkpoint-4)."
    )
    ddp_checkpoint(node1, 4, ranks=(1,))
    assert node_storage.choose_resume(findings(node0, node1), latest=True, named=None, output_dir="out") == (
        (4, "checkpoint-4"), None)


def test_ranks_with_no_checkpoint_in_common_are_one_sentence_naming_what_each_found(tmp_path):
    node0, node1 = tmp_path / "node0", tmp_path / "node1"
    ddp_checkpoint(node0, 2, ranks=(0,))
    ddp_checkpoint(node0, 4, ranks=(0,))
    ddp_checkpoint(node1, 4, ranks=())
    with pytest.raises(SetupError) as refusal:
        node_storage.choose_resume(findings(node0, node1), latest=True, named=None, output_dir="out")
    assert str(refusal.value) == (
        "The ranks have no checkpoint in common to resume from in --output_dir out (rank 0 found checkpoint-2, "
        "checkpoint-4; rank 1 found none (incomplete for it: checkpoint-4)): give every node the same checkpoints "
        "(copy the folders), or start afresh with --overwrite_output_dir or a new --output_dir."
    )


def test_no_checkpoint_anywhere_is_a_new_run_and_a_named_folder_that_is_none_is_refused(tmp_path):
    acc = SimpleNamespace(process_index=0, is_main_process=True)  # one process: gather_object returns its own report
    assert agree_on_resume(acc, [], {}, latest=True, output_dir=str(tmp_path)) is None
    with pytest.raises(SetupError, match=r"^--resume_from_checkpoint '.*nowhere' is not a genrl checkpoint folder"):
        agree_on_resume(acc, [str(tmp_path / "nowhere")], {}, latest=False, output_dir=str(tmp_path))
    folder = ddp_checkpoint(tmp_path, 3)
    assert agree_on_resume(acc, [folder], {folder: ["ema"]}, latest=False, output_dir=str(tmp_path)) == folder


def accelerator(zero_stage=None, processes=2):
    plugin = None if zero_stage is None else SimpleNamespace(zero_stage=zero_stage)
    return SimpleNamespace(num_processes=processes, state=SimpleNamespace(deepspeed_plugin=plugin))


@pytest.mark.parametrize("written, stage, was, now, config", [
    ("torch", 2, "one process or DDP, without DeepSpeed", "DeepSpeed ZeRO-2",
     "accelerate_configs/multi_gpu.yaml, or no config for one process"),
    ("deepspeed_zero2", 3, "DeepSpeed ZeRO-2", "DeepSpeed ZeRO-3", "accelerate_configs/zero2.yaml"),
    ("deepspeed_zero3", None, "DeepSpeed ZeRO-3", "one process or DDP, without DeepSpeed",
     "accelerate_configs/zero3.yaml or zero3_offload.yaml"),
])
def test_another_distributed_format_is_refused_naming_the_config_that_wrote_it(tmp_path, written, stage, was, now, config):
    (tmp_path / "genrl_state.json").write_text(json.dumps({"global_step": 1, "epoch": 0, "num_processes": 2,
                                                            "format": written}))
    with pytest.raises(ValueError) as refusal:
        check_checkpoint_layout(str(tmp_path), accelerator(stage))
    assert str(refusal.value) == (
        f"Cannot resume from {tmp_path}: it was written under {was} and this run uses {now}, whose optimizer states are "
        f"laid out otherwise: resume it with the config it was written with (--config_file {config}), or start afresh "
        "with --overwrite_output_dir or a new --output_dir."
    )
    check_checkpoint_layout(str(tmp_path), accelerator(int(written[-1]) if written != "torch" else None))
    with pytest.raises(ValueError, match="was written by 2 processes but this run has 1"):
        check_checkpoint_layout(str(tmp_path), accelerator(stage, processes=1))
