"""The reward service's replica: the Ray Serve deployment that ``serve_rewards.py`` runs.

Each replica builds the rewards of one spec once (on its own GPU when it has one) and answers
``GET /health`` (the rewards, what the trainer reads of each, the reward models' records, the
scoring requests this replica answered) and ``POST /score`` (wire format: `genrl.rewards.service`). Requests that
arrive together, from any process of any run, are scored as one batch (``@serve.batch``):
batches of the same frame shape are joined along N, scored in one call, and split again. A
joined batch that fails is scored again request by request, so one bad request fails alone.

Scores leave the replica as the rewards gave them, NaN included: the client's
`genrl.rewards.RewardFn` refuses NaN, wrong counts and overflow exactly as it does for an
in-process reward. This module imports Ray; only the service imports it.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any, Mapping

import torch
from ray import serve
from starlette.requests import Request
from starlette.responses import Response

from genrl.rewards.lifecycle import describe_reward_models
from genrl.rewards.registry import build_reward_fn, failure_sentence, parse_reward_spec
from genrl.rewards.service import decode_request, encode_scores

ENGINE = "ray-serve"


@dataclass
class ScoreRequest:
    """One decoded ``POST /score``: frames uint8 ``(N, ...)`` in the client's layout."""

    frames: torch.Tensor
    prompts: list[str]
    metadata: list | None
    rewards: list[str]


def _json(payload: Any, status_code: int = 200) -> Response:
    """JSON that may hold NaN scores (starlette's JSONResponse refuses them; Python's json reads them)."""
    return Response(json.dumps(payload), status_code=status_code, media_type="application/json")


class RewardReplica:
    """Scores requests with ``build_reward_fn(spec, device=device, options=options)``.

    ``max_batch_requests``: requests joined into one scoring call at most; ``batch_wait_s``:
    how long the first request of a batch waits for others to join it.
    """

    def __init__(self, spec: str, options: Mapping[str, Any], device: str, num_threads: int,
                 max_batch_requests: int, batch_wait_s: float):
        torch.set_num_threads(max(1, num_threads))
        if device == "cuda" and not torch.cuda.is_available():
            raise RuntimeError("This replica was given a GPU but torch sees none (is the service's torch a CUDA build?).")
        # One RewardFn per reward, so that a request is scored by the rewards it names alone (the
        # model cache still holds one copy of a model that several of them share). NaN allowed here:
        # the client applies its own policy (training refuses NaN, evaluation keeps it).
        self.names = [name for name, _ in parse_reward_spec(spec)]
        self.reward_fns = {(name,): build_reward_fn(name, device=device, options={k: v for k, v in options.items() if k == name},
                                                    allow_nan=True) for name in self.names}
        # A request for all of them (a trainer whose spec names them all) takes one call, where
        # rewards of one model share a forward pass (videoalign_vq and videoalign_ta).
        self.reward_fns[tuple(self.names)] = build_reward_fn(spec, device=device, options=options, allow_nan=True)
        self.options, self.device = dict(options), device
        # What the trainer reads of an in-process reward, reported to its client.
        self.properties = {name: {"may_abstain": self.reward_fns[(name,)].may_abstain(name)} for name in self.names}
        self.requests = 0  # scoring requests answered
        self.score_batch.set_max_batch_size(max_batch_requests)
        self.score_batch.set_batch_wait_timeout_s(batch_wait_s)

    def health(self) -> dict[str, Any]:
        return {"rewards": self.names, "properties": self.properties, "reward_models": describe_reward_models(),
                "requests": self.requests, "options": self.options, "device": self.device, "engine": ENGINE}

    async def __call__(self, request: Request) -> Response:
        path = request.url.path.rstrip("/").rsplit("/", 1)[-1]
        if request.method == "GET" and path == "health":
            return _json(self.health())
        if request.method != "POST" or path != "score":
            return _json({"error": "Use GET /health or POST /score."}, status_code=404)
        try:
            frames, prompts, metadata, rewards = decode_request(await request.body())
        except ValueError as e:
            return _json({"error": str(e)}, status_code=400)
        unknown = [name for name in rewards if name not in self.names]
        if unknown:
            return _json({"error": f"This service serves {self.names}, not {unknown[0]!r}."}, status_code=400)
        scores = await self.score_batch(ScoreRequest(frames, prompts, metadata, rewards))
        self.requests += 1
        if isinstance(scores, str):
            return _json({"error": scores}, status_code=500)
        return _json(encode_scores({name: scores[name] for name in rewards}))

    def _score(self, rewards: list[str], frames: torch.Tensor, prompts: list[str], metadata: list | None
               ) -> dict[str, torch.Tensor] | str:
        """``{name: (N,)}`` of the rewards named on one batch, or the sentence of a failure."""
        calls = [tuple(rewards)] if tuple(rewards) in self.reward_fns else [(name,) for name in rewards]
        scores = {}
        for names in calls:
            try:
                scored = self.reward_fns[names](frames, prompts, metadata)
            except Exception as e:  # RewardError already says which reward failed and why
                return str(e) if isinstance(e, ValueError) else failure_sentence(f"Reward {names[0]!r} failed", names[0], e,
                                                                                 len(frames))
            scores.update({name: scored[name] for name in names})
        return scores

    def _score_joined(self, batch: list[ScoreRequest]) -> list[dict[str, torch.Tensor] | str]:
        """Requests of one frame shape scored in one call, then split; one by one if that fails."""
        if len(batch) > 1:
            metadata = None if batch[0].metadata is None else [m for r in batch for m in r.metadata]
            scores = self._score(batch[0].rewards, torch.cat([r.frames for r in batch]),
                                 [p for r in batch for p in r.prompts], metadata)
            if not isinstance(scores, str):
                sizes = [len(r.frames) for r in batch]
                split = {name: value.split(sizes) for name, value in scores.items()}
                return [{name: parts[i] for name, parts in split.items()} for i in range(len(batch))]
        return [self._score(r.rewards, r.frames, r.prompts, r.metadata) for r in batch]

    @serve.batch(max_batch_size=8, batch_wait_timeout_s=0.01)
    async def score_batch(self, requests: list[ScoreRequest]) -> list[dict[str, torch.Tensor] | str]:
        # Requests join when they name the same rewards and their frames (past N) and metadata's presence match.
        groups: dict[tuple, list[int]] = {}
        for i, r in enumerate(requests):
            groups.setdefault((tuple(r.rewards), tuple(r.frames.shape[1:]), r.metadata is None), []).append(i)
        results: list[Any] = [None] * len(requests)
        loop = asyncio.get_running_loop()
        for indices in groups.values():
            # In a thread, so that requests keep arriving (and form the next batch) while this one is scored.
            scored = await loop.run_in_executor(None, self._score_joined, [requests[i] for i in indices])
            for i, result in zip(indices, scored):
                results[i] = result
        return results
