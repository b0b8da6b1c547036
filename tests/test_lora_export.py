"""A LoRA export loads into a fresh pipeline with ``load_lora_weights`` and gives the trained
adapter's outputs."""

import torch

from genrl.checkpoints import checkpointing


def test_a_lora_export_loads_at_its_trained_scale_when_alpha_differs_from_rank(tmp_path):
    # load_lora_weights reads the adapter's lora_alpha from the export; without it the adapter
    # would load at alpha = rank (here a quarter of its trained strength).
    from accelerate import Accelerator

    from genrl.policies import policy_for_pipeline
    from genrl.testing.tiny_pipelines import build_tiny_pipeline
    from genrl.training.trainable import make_trainable

    pipeline = build_tiny_pipeline("sd3")
    transformer = pipeline.transformer
    make_trainable(transformer, use_lora=True, rank=2, lora_alpha=8, lora_target_modules="to_q,to_k,to_v",
                   gradient_checkpointing=False, float32=True)
    with torch.no_grad():
        for name, param in transformer.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.5, generator=torch.Generator().manual_seed(len(name)))
    inputs = {"hidden_states": torch.randn(1, transformer.config.in_channels, 8, 8),
              "encoder_hidden_states": torch.randn(1, 6, transformer.config.joint_attention_dim),
              "pooled_projections": torch.randn(1, transformer.config.pooled_projection_dim), "timestep": torch.tensor([500.0])}
    with torch.no_grad():
        trained = transformer(**inputs, return_dict=False)[0]
    checkpointing.export_model(Accelerator(cpu=True), transformer, policy_for_pipeline(pipeline), str(tmp_path / "export"),
                               config={}, use_lora=True)
    fresh = build_tiny_pipeline("sd3")
    with torch.no_grad():
        base = fresh.transformer(**inputs, return_dict=False)[0]
    fresh.load_lora_weights(str(tmp_path / "export"))
    with torch.no_grad():
        loaded = fresh.transformer(**inputs, return_dict=False)[0]
    assert (trained - base).abs().max() > 1e-3, "the adapter must change the output for the test to mean anything"
    torch.testing.assert_close(loaded, trained, rtol=1e-5, atol=1e-5)
