"""A sample's trajectory depends only on (seed, epoch, prompt, conditioning image, index in group):
across processes with different hash salts, across batch layouts, and shared/distinct within a
group as designed; a text-only record's seeds are those of its prompt alone, as they always were."""

import hashlib
import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import PIL.Image
import pytest
import torch

from genrl.data.prompt_images import image_digest
from genrl.data.seeding import forward_generator, latent_generator, noise_generator, prompt_seed, window_generator
from genrl.objectives.forward import draw_forward_batch
from genrl.testing.tiny_pipelines import build_tiny_policy
from genrl.training.rollout import SampleBatch, SamplingConfig, concat_rollouts, sample_rollout, stochastic_steps

torch.set_num_threads(2)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPTS = ["a red circle", "three green triangles", "a blue square left of a yellow circle"]

# Prints prompt seeds and a digest of initial noise drawn from the latent generators (only
# genrl.data.seeding is imported, to keep the child processes light).
_CHILD = textwrap.dedent(
    """
    import hashlib, json, sys
    from genrl.data.prompt_images import image_digest
    from genrl.data.seeding import latent_generator, prompt_seed, randn_per_sample

    prompts, shape, image = json.loads(sys.argv[1]), json.loads(sys.argv[2]), sys.argv[3]
    generators = [latent_generator(p, 5, 3, k, False) for p in prompts for k in range(2)]
    latents = randn_per_sample(shape, generators, "cpu")
    print(json.dumps({
        "seeds": [prompt_seed(p, 5, 3) for p in prompts] + [prompt_seed(prompts[0], 5, 3, image_digest(image))],
        "hash": [hash(p) for p in prompts],
        "latents": hashlib.sha256(latents.numpy().tobytes()).hexdigest(),
    }))
    """
)


def test_seeds_and_initial_latents_agree_across_processes(wan, tmp_path):
    shape = wan.latent_shape(32, 32, 5)
    image = _write_image(tmp_path / "image.png", seed=0)
    procs = []
    for hash_seed in ("1", "2"):
        env = dict(os.environ, PYTHONHASHSEED=hash_seed, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
        procs.append(
            subprocess.Popen(
                [sys.executable, "-c", _CHILD, json.dumps(PROMPTS), json.dumps(list(shape)), image],
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
    assert a["seeds"] == b["seeds"] == [prompt_seed(p, 5, 3) for p in PROMPTS] + [
        prompt_seed(PROMPTS[0], 5, 3, image_digest(image))]
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
    return sample_rollout(policy, policy.transformer, SampleBatch(prompts, indices, seed=11, epoch=epoch),
                          config=config, device="cpu")


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


# The seeds text-only records have always had (computed before images took part in seeding): a
# text-only run's noise, windows and forward draws, hence its numbers, must not move.
TEXT_ONLY = ["a red circle", "three green triangles", "", "ünïcode prompt"]
TEXT_ONLY_SEEDS = {
    "prompt": [6293127508864829687, 2586132948001425272, 7023640451583260583, 3479108959418992047,
               6115196835357355050, 6205430444358759470, 4783822264319826509, 6882670397552699327],
    "latent": [8005715327341434890, 7066772985275749651, 8005715327341434890, 1858062558366599070,
               5792086831293972184, 1786335112758551200, 5792086831293972184, 2773687575588426142,
               1891307920947132593, 11209530279936653, 1891307920947132593, 3429706932717783356,
               334538522833867168, 8798410246632146211, 334538522833867168, 2843246326096339465],
    "noise": [5882838234928986636, 7949617863732924556, 7736243050740583499, 7328027671778933196,
              2423351736705254515, 8032613621618029747, 1067243240940655095, 1598303475284142354],
    "window": [5789467443735284392, 3513192165992831756, 6727725532594439619, 6338689112108164237],
    "forward": [5550831960016644421, 8857539463539162028, 7019137822980018226, 1221751774098330300,
                3615074684200609141, 5899614875253168782, 882220340885871603, 5411064254884773929],
}


def test_text_only_records_keep_the_seeds_of_their_prompt_alone():
    assert [prompt_seed(p, s, e) for p in TEXT_ONLY for s, e in ((0, 0), (42, 7))] == TEXT_ONLY_SEEDS["prompt"]
    assert [latent_generator(p, 42, 3, k, same).initial_seed() for p in TEXT_ONLY for k in (0, 1)
            for same in (True, False)] == TEXT_ONLY_SEEDS["latent"]
    assert [noise_generator(p, 42, 3, k).initial_seed() for p in TEXT_ONLY for k in (0, 1)] == TEXT_ONLY_SEEDS["noise"]
    assert [window_generator(p, 42, 3).initial_seed() for p in TEXT_ONLY] == TEXT_ONLY_SEEDS["window"]
    assert [forward_generator(p, 42, 3, k).initial_seed() for p in TEXT_ONLY for k in (0, 1)] == TEXT_ONLY_SEEDS["forward"]


def _write_image(path, seed: int) -> str:
    PIL.Image.fromarray((np.random.RandomState(seed).rand(24, 40, 3) * 255).astype(np.uint8)).save(path)
    return str(path)


def test_records_of_one_text_draw_their_own_noise_for_each_image(tmp_path):
    """Two records of the same text with different images are different records: their initial
    noise, SDE noise, SDE windows and forward draws differ. The same image is the same record
    wherever it lies (its path, its bytes): the seed is of the image's content."""
    policy = build_tiny_policy("wan2.2-i2v-a14b").to("cpu")  # the cheapest image-to-video layout
    first, second = _write_image(tmp_path / "a.png", seed=0), _write_image(tmp_path / "b.png", seed=1)
    copy = open(first, "rb").read()
    prompts, indices, images = ["a cat"] * 3, [0] * 3, [first, second, copy]
    config = SamplingConfig(num_inference_steps=3, guidance_scale=1.0, noise_level=0.7)
    rollout = sample_rollout(policy, policy.transformer, SampleBatch(prompts, indices, seed=11, epoch=0, images=images),
                             config=config, device="cpu")
    initial = rollout.latents[:, 0]  # no window: step 0 is stochastic, its state is the initial noise
    assert not torch.allclose(initial[0], initial[1]) and torch.equal(initial[0], initial[2])
    expected = policy.prepare_latents([latent_generator("a cat", 11, 0, 0, True, image_digest(second))], 32, 32, 5, "cpu")
    assert torch.equal(initial[1:2], expected)
    sde_noise = rollout.next_latents[:, 0] - initial
    assert not torch.allclose(sde_noise[0], sde_noise[1]) and torch.equal(sde_noise[0], sde_noise[2])

    schedule = policy.timesteps_and_sigmas(3, rollout.final_latents, "cpu")
    forward = draw_forward_batch(rollout, *schedule, 1, seed=11, epoch=0).noise
    assert not torch.allclose(forward[0], forward[1]) and torch.equal(forward[0], forward[2])

    windowed = SamplingConfig(num_inference_steps=6, sde_window_size=1, sde_window_range=(0, 5))
    starts = stochastic_steps(["a cat"] * 8, torch.linspace(1, 0, 7), seed=11, epoch=0,
                              config=windowed, image_ids=list(range(8))).float().argmax(dim=1)
    assert len(set(starts.tolist())) > 1  # one text, eight images: each group draws its own window
