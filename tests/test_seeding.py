"""A sample's trajectory depends only on (seed, epoch, prompt, index in group): across processes
with different hash salts, across batch layouts, and shared/distinct within a group as designed."""

import hashlib
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from genrl.data.seeding import latent_generator, prompt_seed
from genrl.testing.tiny_pipelines import build_tiny_policy
from genrl.training.rollout import SamplingConfig, concat_rollouts, sample_rollout

torch.set_num_threads(2)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPTS = ["a red circle", "three green triangles", "a blue square left of a yellow circle"]

# Prints prompt seeds and a digest of initial noise drawn from the latent generators (only
# genrl.data.seeding is imported, to keep the child processes light).
_CHILD = textwrap.dedent(
    """
    import hashlib, json, sys
    from genrl.data.seeding import latent_generator, prompt_seed, randn_per_sample

    prompts, shape = json.loads(sys.argv[1]), json.loads(sys.argv[2])
    generators = [latent_generator(p, 5, 3, k, False) for p in prompts for k in range(2)]
    latents = randn_per_sample(shape, generators, "cpu")
    print(json.dumps({
        "seeds": [prompt_seed(p, 5, 3) for p in prompts],
        "hash": [hash(p) for p in prompts],
        "latents": hashlib.sha256(latents.numpy().tobytes()).hexdigest(),
    }))
    """
)


def test_seeds_and_initial_latents_agree_across_processes(wan):
    shape = wan.latent_shape(32, 32, 5)
    procs = []
    for hash_seed in ("1", "2"):
        env = dict(os.environ, PYTHONHASHSEED=hash_seed, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
        procs.append(
            subprocess.Popen(
                [sys.executable, "-c", _CHILD, json.dumps(PROMPTS), json.dumps(list(shape))],
                env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            )
        )
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err[-2000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    a, b = results
    assert a["hash"] != b["hash"]  # the salts really differ, so hash() would have broken this
    assert a["seeds"] == b["seeds"] == [prompt_seed(p, 5, 3) for p in PROMPTS]
    # ... and the policy in this process draws the very same initial latents.
    generators = [latent_generator(p, 5, 3, k, False) for p in PROMPTS for k in range(2)]
    here = wan.prepare_latents(generators, 32, 32, 5, "cpu")
    assert a["latents"] == b["latents"] == hashlib.sha256(here.numpy().tobytes()).hexdigest()


@pytest.fixture(scope="module")
def wan():
    return build_tiny_policy("wan").to("cpu")


@pytest.fixture(scope="module")
def flux():  # the cheapest to decode: for checks that do not depend on the family
    return build_tiny_policy("flux").to("cpu")


def _rollout(policy, prompts, indices, config, epoch=0):
    return sample_rollout(policy, policy.transformer, prompts, indices, seed=11, epoch=epoch, config=config, device="cpu")


def test_batch_layout_does_not_change_trajectories(wan):
    config = SamplingConfig(num_inference_steps=4, guidance_scale=2.0, sde_window_size=2)
    prompts = [PROMPTS[0], PROMPTS[0], PROMPTS[1], PROMPTS[1]]
    indices = [0, 1, 0, 1]
    whole = _rollout(wan, prompts, indices, config)
    halves = concat_rollouts([_rollout(wan, prompts[:2], indices[:2], config), _rollout(wan, prompts[2:], indices[2:], config)])
    for name in ("latents", "next_latents", "log_probs", "step_indices", "samples"):
        assert torch.equal(getattr(whole, name), getattr(halves, name)), name


def test_same_latent_shares_initial_noise_within_a_group_only(flux):
    prompts = [PROMPTS[0], PROMPTS[0], PROMPTS[1]]
    indices = [0, 1, 0]
    config = SamplingConfig(num_inference_steps=3, guidance_scale=1.0, same_latent=True)
    rollout = _rollout(flux, prompts, indices, config)
    initial = rollout.latents[:, 0]  # no window: step 0 is stochastic, its state is the initial noise
    assert torch.equal(initial[0], initial[1])
    assert not torch.allclose(initial[0], initial[2])
    # The SDE noise still differs within the group, so the K samples differ.
    assert not torch.allclose(rollout.next_latents[0, 0], rollout.next_latents[1, 0])

    distinct = _rollout(flux, prompts, indices, SamplingConfig(num_inference_steps=3, guidance_scale=1.0, same_latent=False))
    assert not torch.allclose(distinct.latents[0, 0], distinct.latents[1, 0])
    # The initial noise is the one the seeding module defines for the sample.
    expected = flux.prepare_latents([latent_generator(PROMPTS[1], 11, 0, 0, True)], 32, 32, 1, "cpu")
    assert torch.equal(initial[2:], expected)

    other_epoch = _rollout(flux, prompts, indices, config, epoch=1)
    assert not torch.allclose(other_epoch.latents[0, 0], initial[0])


def test_window_start_is_shared_within_a_group(flux):
    prompts = [p for p in PROMPTS for _ in range(2)] + ["a cat", "a cat", "a dog", "a dog"]
    indices = [0, 1] * 5
    config = SamplingConfig(num_inference_steps=6, guidance_scale=1.0, sde_window_size=1, sde_window_range=(0, 5))
    starts = _rollout(flux, prompts, indices, config).step_indices[:, 0].tolist()
    assert starts[0::2] == starts[1::2]
    assert len(set(starts)) > 1  # different prompts draw their own start (5 groups over 5 choices)
