"""Two "nodes" on localhost, each a copy of the checkout with its own relative --output_dir (nodes
without a shared disk), under the shipped multi-node ZeRO-2 config: every node completes its own
checkpoints, every rank resumes the newest checkpoint they all have, and a resumed run ends with
the weights of an uninterrupted one. Both nodes score through one reward service (started here,
where Ray Serve is installed; in-process scoring otherwise), each rank sending its own batches."""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from conftest import ROOT, free_port, script_env, script_errors

pytestmark = pytest.mark.slow

OUTPUT = "out"  # relative: each node's own folder


def node_copy(path) -> str:
    """The files a node needs, copied as a user would check them out there."""
    os.makedirs(path)
    for name in ("train_genrl.py", "genrl", "accelerate_configs"):
        copy = shutil.copytree if os.path.isdir(os.path.join(ROOT, name)) else shutil.copy
        copy(os.path.join(ROOT, name), os.path.join(path, name))
    return str(path)


def launch_nodes(nodes: list[str], args: list[str], timeout: int = 300) -> list[subprocess.CompletedProcess]:
    """Start the same command on every node (machine ranks 0, 1), one process each; wait for all."""
    port = str(free_port())
    env = script_env()
    env.pop("PYTHONPATH")  # each node runs its own copy
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "accelerate.commands.launch", "--config_file", "accelerate_configs/multi_node_zero2.yaml",
             "--num_machines", "2", "--num_processes", "2", "--machine_rank", str(rank), "--main_process_ip", "127.0.0.1",
             "--main_process_port", port, "--mixed_precision", "no", "train_genrl.py", *args],
            cwd=node, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        for rank, node in enumerate(nodes)
    ]
    results = []
    for proc in procs:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            raise
        results.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
    return results


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    """A reward service serving jpeg_compressibility to both nodes, or None where Ray Serve is not installed."""
    try:
        import ray.serve  # noqa: F401
    except ImportError:
        yield None
        return
    from _local_server import RewardService

    with open(tmp_path_factory.mktemp("service") / "service.log", "w+") as log:
        url = RewardService("jpeg_compressibility", {}, log, env=script_env()).start()
        try:
            yield url
        finally:
            url.stop()


def scored_by_both_nodes(service, run, epochs: int):
    """Run ``run()``; through a service, assert that each rank (one a node) sent it its batch of every epoch."""
    before = service.requests() if service else 0
    result = run()
    if service:
        assert service.requests() - before == 2 * epochs, "not every node's rank scored its batches through the service"
    return result


def train_args(model: str, prompts: str, service, *extra: str) -> list[str]:
    served = ["--reward_options", json.dumps({"jpeg_compressibility": {"service": service}})] if service else []
    return [
        "--pretrained_model_name_or_path", model, "--prompt_dataset", prompts, "--reward_fn", "jpeg_compressibility", *served,
        "--output_dir", OUTPUT, "--group_size", "4", "--rollout_batch_size", "4", "--rollout_batches_per_epoch", "1",
        "--train_batch_size", "2", "--num_inference_steps", "4", "--num_epochs", "2", "--checkpointing_steps", "1",
        "--report_to", "none", "--seed", "11", "--learning_rate", "1e-2", "--adam_epsilon", "1e-4",
        "--use_ema", "--ema_decay", "0.5", "--resume_from_checkpoint", "latest", *extra,
    ]


def succeeded(results):
    for r in results:
        assert r.returncode == 0, r.stderr[-4000:]
    return results


def weights(node: str, folder: str = "transformer"):
    return load_file(os.path.join(node, OUTPUT, folder, "diffusion_pytorch_model.safetensors"))


def checkpoints(node: str) -> list[str]:
    return sorted(n for n in os.listdir(os.path.join(node, OUTPUT)) if n.startswith("checkpoint"))


@pytest.fixture(scope="module")
def uninterrupted(service, tiny_sd3, prompt_file, tmp_path_factory):
    base = tmp_path_factory.mktemp("uninterrupted")
    nodes = [node_copy(base / f"node{i}") for i in range(2)]
    scored_by_both_nodes(service, lambda: succeeded(launch_nodes(nodes, train_args(tiny_sd3, prompt_file, service))), epochs=2)
    return nodes


def test_every_node_completes_its_own_checkpoints(uninterrupted):
    from genrl.checkpoints.node_storage import missing_rank_files

    for rank, node in enumerate(uninterrupted):
        assert checkpoints(node) == ["checkpoint-2", "checkpoint-4"], f"node {rank}"
        for name in checkpoints(node):
            assert missing_rank_files(os.path.join(node, OUTPUT, name), rank, ["ema"]) == [], (rank, name)
    # The export is written on the main node only.
    assert os.path.isdir(os.path.join(uninterrupted[0], OUTPUT, "transformer"))
    assert not os.path.exists(os.path.join(uninterrupted[1], OUTPUT, "transformer"))


def test_ranks_resume_the_newest_checkpoint_they_all_have_and_end_bit_identical(uninterrupted, service, tiny_sd3, prompt_file,
                                                                                tmp_path):
    nodes = [str(tmp_path / f"node{i}") for i in range(2)]
    for source, node in zip(uninterrupted, nodes):
        shutil.copytree(source, node)
    # The second node lost its newest checkpoint (it died while saving it); the main node has it.
    shutil.rmtree(os.path.join(nodes[1], OUTPUT, "checkpoint-4"))
    for folder in ("transformer", "transformer_ema"):
        shutil.rmtree(os.path.join(nodes[0], OUTPUT, folder))
    results = scored_by_both_nodes(service, lambda: succeeded(launch_nodes(nodes, train_args(tiny_sd3, prompt_file, service))),
                                   epochs=1)
    log = results[0].stdout + results[0].stderr
    assert "Resuming checkpoint-2, the newest one every rank has complete (not every rank has checkpoint-4)" in log, log[-3000:]
    for folder in ("transformer", "transformer_ema"):
        resumed, expected = weights(nodes[0], folder), weights(uninterrupted[0], folder)
        assert all(torch.equal(resumed[k], expected[k]) for k in expected), f"{folder} differs from the uninterrupted run"
    assert checkpoints(nodes[1]) == ["checkpoint-2", "checkpoint-4"], "the second node did not complete its checkpoint"
