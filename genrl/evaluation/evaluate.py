"""Bounded, deterministic evaluation of a policy on a prompt set (what it writes:
``genrl/evaluation/outputs.py``).

Determinism: sampling is the plain ODE (noise level 0, whatever the training config says),
with its own step count and guidance. The prompts are cut into global batches of
``batch_size`` consecutive prompts, at most ``max_batches`` of them. ONE CPU generator is
built per evaluation and re-seeded with ``draw_seed(seed, k, batch_idx)`` before each batch
and noise draw k; sample j of batch b gets the j-th draw after that re-seed. So a sample's
initial noise is a function of (seed, its draw, its global batch, its position) alone, and the
global batches are the same whatever the number of processes: process r runs batches r, r + P,
r + 2P, ... and the results are gathered back in prompt order. 1 and 8 processes give the same
numbers.

Several samples per prompt (``samples_per_prompt`` = K, GenEval's protocol draws 4): draw k
re-samples every prompt from the noise of the evaluation at seed ``seed + 1000 k``, so draw 0
is the one-sample evaluation, bit for bit, and K draws score what K separate evaluations at
seeds seed, seed + 1000, ... would. One evaluation of a toy run's 122 prompts moves by about 0.02 with
the noise alone; the mean over K draws moves about sqrt(K) times less.

Every process runs the same number of batches (one with none left re-runs its last one and
drops the result), so that collective forwards (DeepSpeed ZeRO-3 gathers parameters inside
every forward) stay in lockstep.

EMA: swap the EMA weights in before calling ``evaluate`` (the trainer's EMA context);
``evaluate`` samples with whatever weights ``transformer`` holds.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import torch
from tqdm.auto import tqdm

from genrl.data.prompt_images import condition_preview
from genrl.data.prompts import PromptSet
from genrl.policies.base import FlowPolicy
from genrl.rewards.layouts import prepare_images_tensor
from genrl.training.rollout import SampleBatch, SamplingConfig, sample_rollout

NOISE_DRAW_STRIDE = 1000


def draw_seed(seed: int, draw: int, batch_idx: int) -> int:
    """The seed of global batch ``batch_idx`` in noise draw ``draw``:
    seed + NOISE_DRAW_STRIDE * draw + batch_idx (draw 0: seed + batch_idx, the one-sample
    evaluation's)."""
    return seed + NOISE_DRAW_STRIDE * draw + batch_idx


def make_eval_generator() -> torch.Generator:
    """The one generator of an evaluation, on the CPU (identical noise on every machine).

    A module-level function so that a test can count how often it is called: once per
    ``evaluate``, never once per batch.
    """
    return torch.Generator(device="cpu")


@dataclass
class EvalResult:
    """What an evaluation measured.

    metrics: ``{reward: {"mean": m, "std": s, "count": n}}`` over the evaluated samples the reward
        applies to (see ``score_stats``), "total" included; with several samples per prompt also
        ``"draw_means"``, the mean of each noise draw.
    per_prompt: ``[{"index": i, "prompt": p, "scores": {reward: score or None}}]`` in prompt
        order; None where the reward does not apply (it returned NaN). With several samples per
        prompt a score is the mean over the prompt's samples it applies to, and ``"draws"`` holds
        each draw's scores.
    samples: uint8 ``(N, F, H, W, C)`` on the CPU, ``keep_samples`` samples spread evenly over
        the evaluated prompts (for grids and videos; from draw 0), or None when none were kept.
    settings: how it was sampled (seed, batch size, batches, steps, guidance, size, ...).
    sample_indices: the prompt index of each kept sample (empty: the first ``len(samples)``).
    conditions: uint8 ``(N, H, W, C)``, the conditioning image of each kept sample as the model
        got it (image-to-video; resized to the samples' size), or None.
    """

    metrics: dict[str, dict[str, float]]
    per_prompt: list[dict[str, Any]]
    samples: torch.Tensor | None
    settings: dict[str, Any] = field(default_factory=dict)
    sample_indices: list[int] = field(default_factory=list)
    conditions: torch.Tensor | None = None

    def sample_rows(self) -> list[dict[str, Any]]:
        """The ``per_prompt`` rows of the kept samples, in the order of ``samples``."""
        if self.samples is None:
            return []
        rows = {r["index"]: r for r in self.per_prompt}
        return [rows[i] for i in self.sample_indices or [r["index"] for r in self.per_prompt[: len(self.samples)]]]

    def to_json(self) -> dict[str, Any]:
        """The JSON-able part: metrics, per-prompt scores, settings (no samples)."""
        return {"metrics": self.metrics, "per_prompt": self.per_prompt, "settings": self.settings}

    def log_dict(self, prefix: str = "eval") -> dict[str, float]:
        """``{"eval/<reward>_mean": m, "eval/<reward>_std": s, ...}`` for ``accelerator.log``."""
        out = {}
        for name, stats in self.metrics.items():
            if stats["mean"] is not None:
                out[f"{prefix}/{name}_mean"] = stats["mean"]
                out[f"{prefix}/{name}_std"] = stats["std"]
        return out


def eval_batches(num_prompts: int, batch_size: int, max_batches: int | None) -> list[range]:
    """Global batches: consecutive ranges of ``batch_size`` prompt indices (the last may be
    shorter), the first ``max_batches`` of them (all when None)."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be at least 1; got {batch_size}.")
    if max_batches is not None and max_batches < 1:
        raise ValueError(f"max_batches must be at least 1, or None for every prompt; got {max_batches}.")
    batches = [range(i, min(i + batch_size, num_prompts)) for i in range(0, num_prompts, batch_size)]
    return batches if max_batches is None else batches[:max_batches]


def spread_indices(num_prompts: int, keep: int | None) -> list[int]:
    """``keep`` prompt indices evenly spaced over ``range(num_prompts)`` (all when None or more).

    Prompt files are often ordered by kind (the toy prompts: counts first, then positions), so
    the first few would all be of one kind; evenly spaced ones cover the whole set.
    """
    if keep is None or keep >= num_prompts:
        return list(range(num_prompts))
    return [i * num_prompts // keep for i in range(keep)]


def batches_of_process(num_batches: int, process_index: int, num_processes: int) -> list[int | None]:
    """The global batch indices process r runs: r, r + P, r + 2P, ...; padded with None to
    ``ceil(num_batches / P)`` entries so every process runs as many batches."""
    rounds = math.ceil(num_batches / num_processes)
    own = [b for b in range(process_index, num_batches, num_processes)]
    return own + [None] * (rounds - len(own))


@torch.no_grad()
def sample_deterministic(
    policy: FlowPolicy,
    transformer: torch.nn.Module,
    prompts: list[str],
    generator: torch.Generator,
    *,
    config: SamplingConfig,
    device: torch.device | str,
    images: Sequence | None = None,
) -> torch.Tensor:
    """ODE-sample ``prompts`` (from ``images``, one each, for image-to-video) with the trainer's
    denoising loop at noise level 0; sample j starts from the j-th draw of ``generator`` (CPU).

    Returns decoded float ``(B, C, F, H, W)`` in [0, 1] on the CPU, decoded one sample at a
    time (bounded VAE memory; no device tensor outlives the call).
    """
    batch = len(prompts)
    height, width, num_frames = policy.resolve_size(config.height, config.width, config.num_frames)
    latents = policy.prepare_latents([generator] * batch, height, width, num_frames, device)
    ode = dataclasses.replace(config, noise_level=0.0, sde_window_size=0, sde_window_range=(0, None))
    rollout = sample_rollout(policy, transformer, SampleBatch(prompts, [0] * batch, seed=0, epoch=0, images=images),
                             config=ode, device=device, initial_latents=latents)
    return rollout.samples


def score_stats(values: Sequence[float]) -> dict[str, float | int | None]:
    """Mean and population std (correction 0: one sample gives 0) over the applicable scores,
    i.e. those that are not NaN (``allow_nan`` rewards mark "not applicable" with NaN), and
    their count; mean and std are None when no sample applies."""
    applicable = torch.tensor([v for v in values if not math.isnan(v)], dtype=torch.float64)
    if applicable.numel() == 0:
        return {"mean": None, "std": None, "count": 0}
    return {"mean": float(applicable.mean()), "std": float(applicable.std(correction=0)), "count": applicable.numel()}


@dataclass(frozen=True)
class SampleRecord:
    """One evaluated sample: prompt ``index`` (of the evaluated prompts), its noise ``draw``, the
    ``prompt``, its ``scores`` by reward name, and ``image``, uint8 ``(F, H, W, C)`` when the
    sample is kept for the logged grid (else None)."""

    index: int
    draw: int
    prompt: str
    scores: dict[str, float]
    image: torch.Tensor | None


def _by_prompt(records: list[SampleRecord]) -> list[list[SampleRecord]]:
    """Records sorted by (index, draw) -> one list per prompt index."""
    groups: dict[int, list[SampleRecord]] = {}
    for record in records:
        groups.setdefault(record.index, []).append(record)
    return list(groups.values())


def _prompt_row(rows: list[SampleRecord]) -> dict[str, Any]:
    """One prompt's ``per_prompt`` row from its records, one per draw: each score the mean over
    the draws it applies to. NaN ("not applicable") is written as null: JSON has no NaN."""

    def clean(scores: Mapping[str, float]) -> dict[str, float | None]:
        return {k: (None if math.isnan(v) else v) for k, v in scores.items()}

    scores = {name: score_stats([r.scores[name] for r in rows])["mean"] for name in rows[0].scores}
    row = {"index": rows[0].index, "prompt": rows[0].prompt, "scores": scores}
    if len(rows) > 1:
        row["draws"] = [clean(r.scores) for r in rows]
    return row


def _gather(records: list[SampleRecord], accelerator) -> list[SampleRecord]:
    """Every process's records, concatenated, on every process.

    torch.distributed directly rather than ``accelerate.utils.gather_object``, which decides
    from the distributed type Accelerate reports: a DDP config on a CPU-only machine reports
    ``DistributedType.NO`` (unless the Accelerator is built with ``cpu=True``) while its gloo
    group is up, and ``gather_object`` then silently returns the local records only.
    """
    if accelerator is None or accelerator.num_processes == 1:
        return records
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        raise RuntimeError(f"evaluate runs on {accelerator.num_processes} processes but no process group is initialized.")
    gathered: list = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, records)
    return [record for part in gathered for record in part]


@dataclass(frozen=True)
class EvalSettings:
    """How an evaluation samples and what it keeps.

    config: the steps, guidance, size and negative prompt (its noise level and SDE settings are
        ignored: sampling is the ODE).
    seed: the noise of draw 0 (``draw_seed``).
    batch_size: prompts per global batch (all processes together).
    max_batches: the first this many global batches (None: every prompt).
    keep_samples: how many samples to keep as uint8 in the result, spread evenly over the
        evaluated prompts (``spread_indices``; None = all). Only kept samples cross processes;
        keep it small for large videos.
    samples_per_prompt: noise draws per prompt (``draw_seed``); the metrics are over all samples.
    """

    config: SamplingConfig
    seed: int
    batch_size: int
    max_batches: int | None
    keep_samples: int | None = None
    samples_per_prompt: int = 1


def evaluate(
    policy: FlowPolicy,
    transformer: torch.nn.Module,
    prompts: PromptSet,
    reward_fn: Callable[..., Mapping[str, torch.Tensor]],
    settings: EvalSettings,
    *,
    device: torch.device | str | None = None,
    accelerator=None,
    show_progress: bool = True,
) -> EvalResult:
    """Evaluate ``transformer`` (in ``policy``'s pipeline) on the first ``settings.max_batches``
    global batches of ``prompts`` (their metadata goes to the rewards) and score the samples
    with ``reward_fn``, as ``settings`` says.

    Call it on every process with the same arguments (it shards the batches itself); every
    process gets the same ``EvalResult``. ``device``: where to sample (default: the
    accelerator's). ``show_progress``: a progress bar on the main process. The conditioning image
    of each prompt (``prompts.images``, image-to-video) goes with it; kept samples keep theirs in
    ``EvalResult.conditions``.
    """
    metadata, images = prompts.metadata or None, prompts.images
    seed, batch_size, max_batches = settings.seed, settings.batch_size, settings.max_batches
    keep_samples, samples_per_prompt = settings.keep_samples, settings.samples_per_prompt
    device = accelerator.device if device is None else device
    prompts = prompts.prompts
    if not prompts:
        raise ValueError("evaluate got an empty prompt list; give at least one prompt.")
    if metadata is not None and len(metadata) != len(prompts):
        raise ValueError(f"evaluate got {len(metadata)} metadata entries for {len(prompts)} prompts; give one per prompt.")
    if images is not None and len(images) != len(prompts):
        raise ValueError(f"evaluate got {len(images)} images for {len(prompts)} prompts; give one per prompt.")
    if keep_samples is not None and keep_samples < 0:
        raise ValueError(f"keep_samples must be >= 0 or None (all); got {keep_samples}.")
    if samples_per_prompt < 1:
        raise ValueError(f"samples_per_prompt must be at least 1; got {samples_per_prompt}.")
    config = dataclasses.replace(settings.config, noise_level=0.0, sde_window_size=0)
    batches = eval_batches(len(prompts), batch_size, max_batches)
    shown = set(spread_indices(sum(len(b) for b in batches), keep_samples))
    rank = accelerator.process_index if accelerator is not None else 0
    world = accelerator.num_processes if accelerator is not None else 1
    is_main = accelerator is None or accelerator.is_main_process

    was_training = transformer.training
    transformer.eval()
    generator = make_eval_generator()
    try:
        records: list[SampleRecord] = []
        plan = batches_of_process(len(batches), rank, world)
        for slot in tqdm(plan, desc="eval", disable=not (is_main and show_progress)):
            # A process with no batch left re-runs its last one (or the first) and drops it.
            batch_idx = slot if slot is not None else next((b for b in reversed(plan) if b is not None), 0)
            indices = list(batches[batch_idx])
            batch_prompts = [prompts[i] for i in indices]
            batch_metadata = [metadata[i] for i in indices] if metadata is not None else None
            batch_images = [images[i] for i in indices] if images is not None else None
            for draw in range(samples_per_prompt):
                generator.manual_seed(draw_seed(seed, draw, batch_idx))
                samples = sample_deterministic(policy, transformer, batch_prompts, generator, config=config, device=device,
                                               images=batch_images)
                if slot is None:
                    continue
                scores = reward_fn(samples, batch_prompts, batch_metadata)
                scores = {name: torch.as_tensor(value).detach().float().cpu() for name, value in scores.items()}
                kept = [draw == 0 and i in shown for i in indices]
                frames = prepare_images_tensor(samples) if any(kept) else None
                for j, i in enumerate(indices):
                    sample_scores = {name: float(value[j]) for name, value in scores.items()}
                    records.append(SampleRecord(i, draw, prompts[i], sample_scores, frames[j].clone() if kept[j] else None))
                del samples, frames
    finally:
        transformer.train(was_training)

    records = sorted(_gather(records, accelerator), key=lambda r: (r.index, r.draw))
    names = list(records[0].scores)
    metrics = {name: score_stats([r.scores[name] for r in records]) for name in names}
    if samples_per_prompt > 1:
        for name in names:
            metrics[name]["draw_means"] = [score_stats([r.scores[name] for r in records if r.draw == k])["mean"]
                                           for k in range(samples_per_prompt)]
    per_prompt = [_prompt_row(rows) for rows in _by_prompt(records)]
    kept_samples = [r.image for r in records if r.image is not None]
    height, width, num_frames = policy.resolve_size(config.height, config.width, config.num_frames)
    kept_indices = [r.index for r in records if r.image is not None]
    conditions = None
    if images is not None and kept_samples:  # read on every process, which all hold the images: nothing to gather
        conditions = torch.stack([condition_preview(images[i], height, width) for i in kept_indices])
    settings = {
        "seed": seed,
        "batch_size": batch_size,
        "max_batches": max_batches,
        "num_batches": len(batches),
        "num_samples": len(records),
        "samples_per_prompt": samples_per_prompt,
        "num_inference_steps": config.num_inference_steps,
        "guidance_scale": config.guidance_scale,
        "noise_level": 0.0,
        "negative_prompt": config.negative_prompt,
        "height": height,
        "width": width,
        "num_frames": num_frames,
    }
    return EvalResult(
        metrics=metrics,
        per_prompt=per_prompt,
        samples=torch.stack(kept_samples) if kept_samples else None,
        settings=settings,
        sample_indices=kept_indices,
        conditions=conditions,
    )
