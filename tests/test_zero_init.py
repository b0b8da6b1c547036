"""Building the transformer partitioned (genrl.distributed.zero_init): which files hold which weights, what
refuses a checkpoint before any rank gathers, and (2 processes, zero3.yaml) that every family's
partitioned build holds half the weights per rank and gathers to exactly the pretrained ones.
The 2-process ZeRO-3 training runs of test_train_distributed.py go through the same build
(the shipped zero3.yaml sets zero3_init_flag: true) and must give DDP's weights."""

import json
import os

import pytest
import torch
from safetensors.torch import save_file

from genrl.distributed.zero_init import add_variant, file_shapes, full_numel, full_shape, weight_files, weights_mismatch
from genrl.errors import SetupError


def test_add_variant_goes_before_the_last_suffix():
    assert add_variant("diffusion_pytorch_model.safetensors", None) == "diffusion_pytorch_model.safetensors"
    assert add_variant("diffusion_pytorch_model.safetensors", "fp16") == "diffusion_pytorch_model.fp16.safetensors"
    assert (add_variant("diffusion_pytorch_model.safetensors.index.json", "bf16")
            == "diffusion_pytorch_model.safetensors.index.bf16.json")


def test_weight_files_reads_a_single_file_and_a_sharded_index(tmp_path):
    single = tmp_path / "single"
    single.mkdir()
    save_file({"a.weight": torch.zeros(2, 3), "b": torch.zeros(4)}, str(single / "diffusion_pytorch_model.safetensors"))
    path = str(single / "diffusion_pytorch_model.safetensors")
    assert weight_files(str(single)) == {"a.weight": path, "b": path}
    assert file_shapes(weight_files(str(single))) == {"a.weight": (2, 3), "b": (4,)}

    sharded = tmp_path / "sharded"
    sharded.mkdir()
    save_file({"a.weight": torch.zeros(2, 3)}, str(sharded / "part-1.safetensors"))
    save_file({"b": torch.zeros(5)}, str(sharded / "part-2.safetensors"))
    (sharded / "diffusion_pytorch_model.safetensors.index.fp16.json").write_text(
        json.dumps({"metadata": {}, "weight_map": {"a.weight": "part-1.safetensors", "b": "part-2.safetensors"}})
    )
    files = weight_files(str(sharded), variant="fp16")
    assert files == {"a.weight": str(sharded / "part-1.safetensors"), "b": str(sharded / "part-2.safetensors")}
    assert file_shapes(files) == {"a.weight": (2, 3), "b": (5,)}


def test_a_pickled_checkpoint_is_refused_with_one_sentence(tmp_path):
    torch.save({"a": torch.zeros(1)}, str(tmp_path / "diffusion_pytorch_model.bin"))
    with pytest.raises(SetupError) as error:
        weight_files(str(tmp_path))
    message = str(error.value)
    assert "safetensors" in message and "zero3_init_flag: false" in message
    save_file({"a": torch.zeros(1)}, str(tmp_path / "diffusion_pytorch_model.safetensors"))
    with pytest.raises(SetupError):  # the plain file exists, the asked-for variant does not
        weight_files(str(tmp_path), variant="fp16")


def test_weights_mismatch_names_a_missing_or_misshapen_tensor_and_ignores_extras():
    expected = {"proj.weight": (8, 4), "proj.bias": (8,)}
    assert weights_mismatch(expected, {"proj.weight": (8, 4), "proj.bias": (8,), "unused": (1,)}) is None
    missing = weights_mismatch(expected, {"proj.weight": (8, 4)})
    assert "1 of the model's 2 tensors" in missing and "'proj.bias'" in missing
    wrong = weights_mismatch(expected, {"proj.weight": (4, 8), "proj.bias": (8,)})
    assert "'proj.weight'" in wrong and "(4, 8)" in wrong and "(8, 4)" in wrong


def test_full_shape_of_an_unpartitioned_tensor_is_its_shape():
    weight = torch.nn.Parameter(torch.zeros(3, 5))
    assert full_shape(weight) == (3, 5) and full_numel(weight) == 15
    weight.ds_shape, weight.ds_numel = torch.Size([6, 5]), 30  # what zero.Init sets on a partitioned one
    assert full_shape(weight) == (6, 5) and full_numel(weight) == 30



def test_transformer_folder_of_a_local_pipeline_and_an_unreachable_hub_id(tmp_path):
    from genrl.distributed.zero_init import transformer_folder

    assert transformer_folder(str(tmp_path)) == str(tmp_path / "transformer")
    with pytest.raises(SetupError) as error:  # tests run with HF_HUB_OFFLINE=1
        transformer_folder("genrl-test/not-a-model")
    assert "'genrl-test/not-a-model'" in str(error.value) and "could not be fetched" in str(error.value)


@pytest.mark.slow
def test_every_family_loads_partitioned_to_the_pretrained_weights_and_a_misfit_fails_on_every_rank(tmp_path):
    import shutil

    from genrl.testing.tiny_pipelines import FAMILIES, save_tiny_pipeline

    from conftest import run_script

    folders = [save_tiny_pipeline(family, str(tmp_path / family)) for family in FAMILIES]
    misfit = str(tmp_path / "misfit")  # one block more in the config than in the weights
    shutil.copytree(folders[0], misfit)
    config_path = os.path.join(misfit, "transformer", "config.json")
    with open(config_path) as f:
        config = json.load(f)
    config["num_layers"] += 1
    with open(config_path, "w") as f:
        json.dump(config, f)
    out = str(tmp_path / "results.json")
    run_script("tests/_zero_init_worker.py", [out, *folders, misfit], config="zero3", num_processes=2, timeout=300)
    with open(out) as f:
        results = json.load(f)
    for folder in folders:
        assert results[folder]["max_diff"] == 0.0, folder
        assert 0.45 <= results[folder]["held_fraction"] <= 0.55, folder  # this rank's half, not the whole model
    assert "do not fit" in results[misfit]["error"] and "lack" in results[misfit]["error"]
