"""Which weights train (genrl/training/trainable.py): the LoRA adapter's random init is a function of
--seed alone, so LoRA runs reproduce and every rank starts from the same adapter."""

import torch
from diffusers import SD3Transformer2DModel

from genrl.training.trainable import make_trainable


def tiny_transformer() -> SD3Transformer2DModel:
    torch.manual_seed(0)
    return SD3Transformer2DModel(
        sample_size=8, patch_size=2, in_channels=4, num_layers=1, attention_head_dim=8, num_attention_heads=2,
        joint_attention_dim=16, caption_projection_dim=16, pooled_projection_dim=16, out_channels=4,
    )


def lora_weights(seed: int, rng_state: int) -> dict[str, torch.Tensor]:
    transformer = tiny_transformer()
    torch.manual_seed(rng_state)  # whatever the global generator holds when the adapter is built
    trainable = make_trainable(transformer, use_lora=True, rank=4, lora_alpha=4, lora_target_modules="to_q,to_k",
                               gradient_checkpointing=False, float32=True, seed=seed)
    assert trainable and all(p.requires_grad for p in trainable)
    return {n: p.detach().clone() for n, p in transformer.named_parameters() if "lora_" in n}


def test_the_adapter_init_depends_on_the_seed_not_on_the_global_generator():
    a, b = lora_weights(seed=3, rng_state=1), lora_weights(seed=3, rng_state=2)
    assert a.keys() == b.keys() and any("lora_A" in n for n in a)
    assert all(torch.equal(a[n], b[n]) for n in a)
    c = lora_weights(seed=4, rng_state=1)
    assert any(not torch.equal(a[n], c[n]) for n in a if "lora_A" in n)


def test_building_the_adapter_leaves_the_global_generator_where_it_was():
    transformer = tiny_transformer()
    torch.manual_seed(11)
    expected = torch.rand(3)
    torch.manual_seed(11)
    make_trainable(transformer, use_lora=True, rank=2, lora_alpha=2, lora_target_modules="to_q",
                   gradient_checkpointing=False, float32=False, seed=5)
    assert torch.equal(torch.rand(3), expected)
