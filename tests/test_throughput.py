"""The trainer's FLOP count (genrl.training.throughput): FlopCounterMode's own count of the real module,
the per-epoch tally of the sequences through it, and the logged throughput figures."""

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from genrl.testing.tiny_pipelines import build_tiny_policy
from genrl.training.rollout import SamplingConfig
from genrl.training.throughput import (
    PhaseFigures,
    TransformerCost,
    TransformerTally,
    count_transformer_flops,
    throughput_logs,
)
from genrl.training.trainable import make_trainable


def counted_on_cpu(policy, transformer) -> tuple[int, int]:
    """FlopCounterMode around one real conditional forward, then one forward + backward, of one
    sequence on the CPU. Attention runs torch's math kernel: the fused CPU kernel is not in
    FlopCounterMode's table, so it would count no attention at all."""
    guidance = policy.conditional_guidance(4.5)
    embeds = policy.encode_prompts(["a red circle"], "cpu", guidance)
    latents = torch.randn((1, *policy.latent_shape(*policy.resolve_size(None, None, None))))
    timestep = torch.tensor([500.0])
    with sdpa_kernel(SDPBackend.MATH), torch.no_grad(), FlopCounterMode(display=False) as counter:
        policy.predict_velocity(transformer, latents, timestep, embeds, guidance)
    forward = counter.get_total_flops()
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        policy.predict_velocity(transformer, latents, timestep, embeds, guidance).sum().backward()
    return forward, counter.get_total_flops()


# Z-Image: captions of the prompt's own length (its token mask stays real while counting on meta),
# one input tensor per sequence, and a RoPE table the meta count must not leave behind.
@pytest.mark.parametrize("family, use_lora", [("sd3", False), ("sd3", True), ("wan", True), ("flux", False),
                                              ("zimage", True), ("flux2-klein", False), ("qwenimage", True),
                                              ("flux2", True)])
def test_the_flop_count_is_flop_counter_modes_own_count_of_the_module(family, use_lora):
    policy = build_tiny_policy(family)
    make_trainable(policy.transformer, use_lora=use_lora, rank=4, lora_alpha=4, lora_target_modules="to_q,to_k,to_v,to_out.0",
                   gradient_checkpointing=True, float32=True)
    rng = torch.get_rng_state()
    cost = count_transformer_flops(policy, policy.transformer, SamplingConfig(guidance_scale=4.5), "a red circle", "cpu")
    assert torch.equal(torch.get_rng_state(), rng), "counting must draw nothing: the run's numbers stay as they were"
    assert policy.transformer.is_gradient_checkpointing, "switched off while counting, on again after"
    policy.transformer.disable_gradient_checkpointing()  # its recomputation is not counted
    assert (cost.forward, cost.train) == counted_on_cpu(policy, policy.transformer)
    # Backward: input gradients everywhere, weight gradients of the trained weights only.
    assert 1.5 * cost.forward < cost.train < (2.5 if use_lora else 3.1) * cost.forward


class Block(torch.nn.Module):
    """Takes ``hidden_states`` as the transformers do (positional or keyword; a batch tensor, or
    one tensor per sequence as Z-Image's)."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(3, 3)

    def forward(self, hidden_states, scale=1.0):
        if isinstance(hidden_states, list):
            hidden_states = torch.stack(hidden_states)
        return self.linear(hidden_states) * scale


def test_the_tally_counts_sequences_by_grad_mode_and_prices_them():
    module, other = Block(), Block()
    tally = TransformerTally([module, other], TransformerCost(forward=10, train=25))
    with torch.no_grad():
        module(torch.zeros(4, 3))
        other(hidden_states=torch.zeros(2, 3), scale=2.0)
        module([torch.zeros(3)] * 5)
    module(hidden_states=torch.zeros(3, 3)).sum().backward()
    assert (tally.no_grad, tally.grad) == (11, 3)
    assert tally.take() == 11 * 10 + 3 * 25
    assert tally.take() == 0
    tally.close()
    module(torch.zeros(1, 3))
    assert tally.take() == 0
    assert TransformerTally([module], None).take() is None


def test_throughput_logs():
    logs = throughput_logs(samples=32, epoch_seconds=4.0, rollout=PhaseFigures(2.0, int(6e12)),
                           update=PhaseFigures(1.0, int(2e12)), peak_tflops=4.0)
    assert logs == {"time/epoch_s": 4.0, "time/samples_per_s": 8.0, "perf/transformer_flops": 8e12,
                    "perf/transformer_tflops": 2.0, "perf/rollout_tflops": 3.0, "perf/train_tflops": 2.0, "perf/mfu": 0.5}
    uncounted = throughput_logs(samples=32, epoch_seconds=4.0, rollout=PhaseFigures(2.0), update=PhaseFigures(1.0))
    assert uncounted == {"time/epoch_s": 4.0, "time/samples_per_s": 8.0}
