"""ZeRO-3's width-based buffer sizes: the formula, the width of each family's transformer, and
that a user's own values are kept (the DeepSpeed plugin is the real one accelerate builds)."""

import pytest
import torch
from accelerate.utils import DeepSpeedPlugin

from genrl.distributed.zero3 import size_zero3_buckets, transformer_width, zero3_bucket_sizes


def test_bucket_sizes_follow_the_width():
    assert zero3_bucket_sizes(1536) == {  # Wan2.1-1.3B: 2.4 M elements, not DeepSpeed's 5e8
        "reduce_bucket_size": 2359296, "stage3_prefetch_bucket_size": 2123366, "stage3_param_persistence_threshold": 15360,
    }
    with pytest.raises(ValueError, match="width must be >= 1"):
        zero3_bucket_sizes(0)


@pytest.mark.parametrize("family", ["wan", "sd3", "flux"])
def test_a_diffusers_transformers_width_is_heads_times_head_dim(family):
    from genrl.testing.tiny_pipelines import build_tiny_pipeline

    transformer = build_tiny_pipeline(family).transformer
    config = transformer.config
    width = config.num_attention_heads * config.attention_head_dim
    assert transformer_width(transformer) == width
    assert any(p.shape[-1] == width for p in transformer.parameters())  # it is the width the weights have


def test_width_without_a_config_is_the_largest_square_weight():
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Linear(64, 8))
    assert transformer_width(model) == 32  # sqrt(64 * 16)
    for p in model.parameters():  # as zero.Init leaves them: an empty 1-D shard, the full shape aside
        p.ds_shape, p.ds_numel = p.shape, p.numel()
        p.data = torch.empty(0)
    assert transformer_width(model) == 32


def test_zero3_gets_the_sizes_it_lacks_and_keeps_the_users():
    model = torch.nn.Linear(16, 64)
    plugin = DeepSpeedPlugin(zero_stage=3)
    plugin.deepspeed_config["zero_optimization"]["reduce_bucket_size"] = 12345  # from a user's JSON
    plugin.deepspeed_config["zero_optimization"]["stage3_prefetch_bucket_size"] = "auto"
    sizes = size_zero3_buckets(plugin, model)
    assert sizes == {"reduce_bucket_size": 12345, "stage3_prefetch_bucket_size": 921, "stage3_param_persistence_threshold": 320}
    assert {k: plugin.deepspeed_config["zero_optimization"][k] for k in sizes} == sizes
    zero2 = DeepSpeedPlugin(zero_stage=2)
    assert size_zero3_buckets(zero2, model) == {} and "reduce_bucket_size" not in zero2.deepspeed_config["zero_optimization"]
    assert size_zero3_buckets(None, model) == {}
