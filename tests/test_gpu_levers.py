"""The speed levers together on a GPU (skipped without one): bf16 weights, cuDNN attention
through diffusers' dispatcher and regional compile keep a Wan transformer's velocity and
give finite gradients. Each lever alone is pinned on the CPU in test_acceleration.py and
test_train_script.py (DeepSpeed's bf16 mode); this is the combination bench_h200_wan.py times."""

import copy

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from genrl.training.acceleration import compile_repeated_blocks, set_attention_backend

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")

# Wan's layout at a small width; head_dim 64, which cuDNN's attention kernels take.
SMALL_WAN = dict(
    patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=64, in_channels=16, out_channels=16, text_dim=64,
    freq_dim=32, ffn_dim=256, num_layers=2, cross_attn_norm=True, qk_norm="rms_norm_across_heads", eps=1e-6,
    rope_max_seq_len=64,
)


def test_bf16_weights_cudnn_attention_and_compiled_blocks_keep_the_wan_velocity():
    from diffusers import WanTransformer3DModel

    torch.manual_seed(0)
    reference = WanTransformer3DModel(**SMALL_WAN).cuda()
    fast = copy.deepcopy(reference).to(torch.bfloat16)
    set_attention_backend([fast], "_native_cudnn", device="cuda", dtype=torch.bfloat16)
    assert compile_repeated_blocks(fast, fullgraph=True)
    generator = torch.Generator("cuda").manual_seed(1)
    latents = torch.randn(2, 16, 3, 16, 16, device="cuda", generator=generator)  # (B, C, F, H, W): 3 x 8 x 8 tokens
    timestep = torch.tensor([700.0, 300.0], device="cuda")
    text = torch.randn(2, 8, 64, device="cuda", generator=generator)

    with torch.no_grad():
        expected = reference(hidden_states=latents, timestep=timestep, encoder_hidden_states=text, return_dict=False)[0]
    # As the trainer runs it: bf16 autocast (Accelerate's mixed precision) over the bf16 weights.
    # The outer sdpa_kernel context restores torch's attention switches even if the compiled
    # region raises inside cuDNN's own context (a failure must not disable SDPA for later tests).
    everything = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
    with sdpa_kernel(everything), torch.autocast("cuda", dtype=torch.bfloat16):
        got = fast(hidden_states=latents.bfloat16(), timestep=timestep, encoder_hidden_states=text.bfloat16(),
                   return_dict=False)[0]
    relative = ((got.float() - expected).norm() / expected.norm()).item()
    assert relative < 2e-2, f"bf16 + cuDNN + compile moved the velocity by {relative:.3%} of its norm"
    with sdpa_kernel(everything):
        got.float().square().mean().backward()
    grads = [p.grad for p in fast.parameters() if p.requires_grad]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)
    assert any(g.abs().max() > 0 for g in grads)


def test_the_sde_step_draws_its_noise_on_the_cpu_and_never_waits_for_the_gpu():
    """The seeding contract (noise from per-sample CPU generators, the same on every machine)
    without a stall: the noise reaches the GPU by a non-blocking copy from pinned memory, so
    the denoising loop queues its next step while the transformer still runs."""
    from genrl.data.seeding import noise_generator
    from genrl.math.sde import sde_step_with_logprob

    generator = torch.Generator().manual_seed(0)
    x, v = (torch.randn(2, 16, 3, 8, 8, generator=generator) for _ in range(2))
    draw = lambda: [noise_generator("a red circle", 0, 0, k) for k in range(2)]  # noqa: E731
    on_cpu = sde_step_with_logprob(v, 0.8, 0.6, x, noise_level=0.7, generator=draw())
    v_gpu, x_gpu, sigma, sigma_next = v.cuda(), x.cuda(), torch.tensor(0.8).cuda(), torch.tensor(0.6).cuda()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any wait for the GPU raises
    try:
        on_gpu = sde_step_with_logprob(v_gpu, sigma, sigma_next, x_gpu, noise_level=0.7, generator=draw())
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.testing.assert_close(on_gpu.next_sample.cpu(), on_cpu.next_sample, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(on_gpu.log_prob.cpu(), on_cpu.log_prob, rtol=1e-5, atol=1e-5)
