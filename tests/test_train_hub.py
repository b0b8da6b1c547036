"""train_genrl.py --push_to_hub against a local fake Hub on 127.0.0.1 (no network)."""

import os
import subprocess

from conftest import launch_command, script_env
from tests.fake_hub_server import FakeHubServer


def train(model, prompts, output_dir, endpoint, tmp_path, token="hf_dummy", *extra):
    args = [
        "--pretrained_model_name_or_path", model, "--prompt_dataset", prompts, "--reward_fn", "jpeg_compressibility",
        "--output_dir", output_dir, "--group_size", "4", "--rollout_batch_size", "4", "--rollout_batches_per_epoch", "1",
        "--train_batch_size", "4", "--num_inference_steps", "3", "--num_epochs", "2", "--checkpointing_steps", "1",
        "--report_to", "none", "--push_to_hub", "--hub_model_id", "tester/genrl-run", "--hub_token", token, *extra,
    ]
    env = script_env()
    env.update(HF_ENDPOINT=endpoint, HF_HUB_OFFLINE="0", HF_HOME=str(tmp_path / "hf_home"))
    return subprocess.run(launch_command("train_genrl.py", args), env=env, capture_output=True, text=True, timeout=600)


def test_push_uploads_the_export_and_card_without_checkpoints(tiny_sd3, prompt_file, tmp_path):
    output_dir = str(tmp_path / "run")
    with FakeHubServer() as server:
        proc = train(tiny_sd3, prompt_file, output_dir, server.endpoint, tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    files = server.files["tester/genrl-run"]
    assert "README.md" in files and "genrl_config.json" in files
    assert "transformer/diffusion_pytorch_model.safetensors" in files and "transformer/config.json" in files
    assert not any(path.startswith("checkpoint-") for path in files)
    assert os.path.isdir(os.path.join(output_dir, "checkpoint-2")), "checkpoints stay local"
    local = open(os.path.join(output_dir, "transformer", "diffusion_pytorch_model.safetensors"), "rb").read()
    assert files["transformer/diffusion_pytorch_model.safetensors"] == local


def test_failed_push_says_so_and_keeps_the_local_export(tiny_sd3, prompt_file, tmp_path):
    server = FakeHubServer()
    endpoint = server.endpoint
    server._httpd.server_close()  # nothing listens there any more
    output_dir = str(tmp_path / "run")
    proc = train(tiny_sd3, prompt_file, output_dir, endpoint, tmp_path)
    assert proc.returncode == 1
    assert "tester/genrl-run" in proc.stderr and output_dir in proc.stderr, proc.stderr[-3000:]
    for name in ("genrl_config.json", "README.md", "transformer/diffusion_pytorch_model.safetensors"):
        assert os.path.isfile(os.path.join(output_dir, name)), f"{name} lost after a failed push"


def test_the_hub_token_is_in_no_uploaded_file_no_local_file_and_no_log(tiny_sd3, prompt_file, tmp_path):
    """--hub_token reaches the Hub as a credential only: the recorded command line and
    arguments (genrl_config.json of the export and of each checkpoint, the model card, the
    TensorBoard hparams) hold *** instead."""
    token = "hf_SECRETabc123SECRETabc123SECRETabc1"
    output_dir = str(tmp_path / "run")
    with FakeHubServer() as server:
        proc = train(tiny_sd3, prompt_file, output_dir, server.endpoint, tmp_path, token,
                     "--push_checkpoints", "--report_to", "tensorboard")
    assert proc.returncode == 0, proc.stderr[-4000:]
    secret = token.encode()
    uploaded = server.files["tester/genrl-run"]
    assert "genrl_config.json" in uploaded and "README.md" in uploaded
    assert server.commits["tester/genrl-run"][0].startswith("Training in progress"), "checkpoints were pushed too"
    assert [path for path, data in uploaded.items() if secret in data] == []
    local = [os.path.join(d, f) for d, _, files in os.walk(output_dir) for f in files]
    assert any("events.out.tfevents" in path for path in local) and any(path.endswith("README.md") for path in local)
    assert [path for path in local if secret in open(path, "rb").read()] == []
    assert token not in proc.stdout and token not in proc.stderr
    card = uploaded["README.md"].decode()
    assert "--hub_token '***'" in card or "--hub_token ***" in card, "the card still shows how the run was launched"
