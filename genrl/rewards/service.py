"""A reward scored by a reward service (``serve_rewards.py``) instead of in this process.

A reward of ``--reward_fn`` is served when its ``--reward_options`` name a service::

    --reward_fn "hpsv3:1.0,jpeg_compressibility:0.1"
    --reward_options '{"hpsv3": {"service": "http://reward-host:8000", "timeout": 120, "retries": 3, "wait_s": 600}}'

Only the client's options go here (``service``, ``timeout``, ``retries``, ``wait_s``); the
reward's own options (checkpoints, batch size) are given to ``serve_rewards.py``, which loads
the model.

Every process of a run talks to the service itself, from the reward thread that scores a batch
while the next one denoises (``--reward_mode async``), so rank 0 relays nothing.

Wire format (``POST <service>/score``): a safetensors blob holding one uint8 tensor ``frames``,
the batch in the layout the rollout gave it (e.g. ``(N, C, F, H, W)``) quantised to 0-255 as
every reward quantises it itself (`genrl.rewards.layouts.to_uint8`: round(255 x)), so the
scores equal in-process ones; its header's ``__metadata__["request"]`` is JSON
``{"rewards": [names], "prompts": [N strings], "metadata": [N objects] | null}``. The answer is
JSON ``{"rewards": {name: [N floats]}}``; an error is ``{"error": sentence}`` with HTTP 400
(the request) or 500 (the reward failed). ``GET <service>/health`` answers
``{"rewards": [names served], "properties": {name: {"may_abstain": bool}}, "reward_models":
{model: description}, "requests": scoring requests answered, ...}``: when the client is built
it reads what the trainer reads of an in-process reward (whether it may abstain with NaN, what
a run records of its reward models), so a served reward behaves as the in-process one.

Faults: a service that does not answer at start is one sentence at argument parsing
(`check_service_options`); a request that fails to connect, times out, or meets an HTTP error
of the service's machinery rather than a replica's answer (a busy or restarting Ray Serve, a
gateway) is retried ``retries`` times with doubling pauses (1 s, 2 s, 4 s, ... at most 30 s),
then, while less than ``wait_s`` seconds have passed since its first failure, every 5 s (a
service restarting: a Ray Serve redeploy, a rebooted node); then the run stops with one
sentence (`RewardError`). A reward that failed on the service stops it at once. Scores are
checked as any reward's are (count, NaN, range) by `genrl.rewards.RewardFn`, and scores of a
reward other than the one asked for are refused here.
"""

from __future__ import annotations

import http.client
import json
import logging
import struct
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Any, Mapping, Sequence

import numpy as np
import torch
from safetensors.torch import save as save_safetensors

from genrl.errors import json_type
from genrl.rewards import lifecycle
from genrl.rewards.layouts import to_uint8

logger = logging.getLogger(__name__)

SERVICE_OPTION = "service"
CLIENT_OPTIONS = ("service", "timeout", "retries", "wait_s")
DEFAULT_TIMEOUT_S = 120.0
DEFAULT_RETRIES = 3
DEFAULT_WAIT_S = 0.0
# How long the start-up check waits for the service to answer.
PROBE_TIMEOUT_S = 10.0
MAX_BACKOFF_S = 30.0
# How often a request asks again while it waits for a service to come back (after its retries).
WAIT_POLL_S = 5.0


def is_served(options: Any) -> bool:
    """Whether a reward's ``--reward_options`` entry names a reward service."""
    return isinstance(options, Mapping) and SERVICE_OPTION in options


# --- wire format -------------------------------------------------------------------------------

def encode_request(samples: Any, prompts: Sequence[str], metadata: Sequence[Mapping] | None, rewards: Sequence[str]) -> bytes:
    """A batch as the body of ``POST /score``: ``samples`` (any layout, float in [0, 1] or uint8,
    tensor or array) as a uint8 tensor of the same shape, with the prompts, metadata and the
    names of the rewards asked for in the safetensors header."""
    frames = torch.from_numpy(np.ascontiguousarray(samples)) if isinstance(samples, np.ndarray) else samples
    if not isinstance(frames, torch.Tensor):
        raise TypeError(f"Samples must be a torch.Tensor or numpy.ndarray, got {type(samples).__name__}.")
    frames = to_uint8(frames.detach().cpu()).contiguous()
    try:
        request = json.dumps({"rewards": list(rewards), "prompts": list(prompts),
                              "metadata": None if metadata is None else list(metadata)})
    except TypeError as e:
        raise ValueError(f"The prompts' metadata must be JSON to travel to a reward service ({e}).") from None
    return save_safetensors({"frames": frames}, metadata={"request": request})


def decode_request(body: bytes) -> tuple[torch.Tensor, list[str], list | None, list[str]]:
    """``POST /score`` body -> ``(frames uint8 tensor, prompts, metadata or None, reward names)``;
    a ValueError of one sentence for a body that is not one."""
    from safetensors.torch import load as load_safetensors

    try:
        (header_size,) = struct.unpack("<Q", body[:8])
        header = json.loads(body[8 : 8 + header_size])
        request = json.loads(header["__metadata__"]["request"])
        frames = load_safetensors(body)["frames"]
    except Exception as e:
        raise ValueError(f"The request is not a genrl reward batch ({type(e).__name__}: {e}).") from None
    if frames.dtype != torch.uint8 or frames.ndim < 1:
        raise ValueError(f"The request's frames must be a uint8 batch, got {frames.dtype} {tuple(frames.shape)}.")
    prompts, metadata, rewards = request.get("prompts"), request.get("metadata"), request.get("rewards")
    if not isinstance(prompts, list) or len(prompts) != len(frames):
        count = len(prompts) if isinstance(prompts, list) else f"a {json_type(prompts)} of"
        raise ValueError(f"The request holds {len(frames)} samples but {count} prompts, not one per sample.")
    if metadata is not None and (not isinstance(metadata, list) or len(metadata) != len(frames)):
        raise ValueError(f"The request holds {len(frames)} samples but metadata that is not one entry per sample.")
    if not isinstance(rewards, list) or not rewards or not all(isinstance(r, str) for r in rewards):
        raise ValueError("The request names no rewards.")
    return frames, prompts, metadata, rewards


def encode_scores(scores: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    """``{name: (N,) float32}`` -> the JSON answer; float32 values round-trip exactly through
    JSON's decimal text (NaN as the ``NaN`` token Python's json reads)."""
    return {"rewards": {name: [float(v) for v in value.tolist()] for name, value in scores.items()}}


# --- client --------------------------------------------------------------------------------------

def service_url(name: str, options: Mapping[str, Any]) -> str:
    """The service's base URL from a reward's options, checked: ``http(s)://host:port[/path]``."""
    url = options[SERVICE_OPTION]
    parsed = urllib.parse.urlparse(url) if isinstance(url, str) else None
    if parsed is None or parsed.scheme not in ("http", "https") or not parsed.netloc:
        raise ValueError(f"--reward_options for {name!r}: 'service' must be an http(s)://host:port URL, got {url!r}.")
    return url.rstrip("/")


def public_url(url: str) -> str:
    """``url`` without user name, password, query or fragment (which may carry a key)."""
    parts = urllib.parse.urlsplit(url)
    port = f":{parts.port}" if parts.port else ""
    return f"{parts.scheme}://{parts.hostname}{port}{parts.path}"


def client_settings(name: str, options: Mapping[str, Any]) -> dict[str, Any]:
    """``{"url", "timeout", "retries", "wait_s"}`` of served reward ``name`` from its
    ``--reward_options``, checked; a ValueError of one sentence."""
    unknown = sorted(set(options) - set(CLIENT_OPTIONS))
    if unknown:
        raise ValueError(
            f"Reward {name!r} is served, so it takes only the options {list(CLIENT_OPTIONS)} here, not {unknown[0]!r}; "
            f"give the reward's own options to serve_rewards.py --reward_options."
        )
    timeout, retries = options.get("timeout", DEFAULT_TIMEOUT_S), options.get("retries", DEFAULT_RETRIES)
    wait_s = options.get("wait_s", DEFAULT_WAIT_S)
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise ValueError(f"--reward_options for {name!r}: 'timeout' must be a number of seconds > 0, got {timeout!r}.")
    if isinstance(retries, bool) or not isinstance(retries, int) or retries < 0:
        raise ValueError(f"--reward_options for {name!r}: 'retries' must be an integer >= 0, got {retries!r}.")
    if isinstance(wait_s, bool) or not isinstance(wait_s, (int, float)) or not 0 <= wait_s < float("inf"):
        raise ValueError(f"--reward_options for {name!r}: 'wait_s' must be a number of seconds >= 0, got {wait_s!r}.")
    return {"url": service_url(name, options), "timeout": float(timeout), "retries": retries, "wait_s": float(wait_s)}


def replica_error(error: urllib.error.HTTPError) -> str | None:
    """The one-sentence ``{"error": ...}`` a replica answers when the request or the reward
    failed, or None: an HTTP error of the service's machinery instead (Ray Serve's proxy with
    no route yet or a replica that died mid-request, a gateway), which a later try may not meet."""
    try:
        answer = json.loads(error.read())
    except Exception:
        return None
    return str(answer["error"]) if isinstance(answer, dict) and "error" in answer else None


def _reason(error: BaseException | None) -> str:
    """``Type: message`` of why a request failed (a URLError's reason, not its wrapper), or the
    HTTP status it met."""
    if isinstance(error, urllib.error.HTTPError):
        return f"HTTP {error.code} {error.reason}"
    reason = getattr(error, "reason", None) or error
    return f"{type(reason).__name__}: {str(reason).rstrip('.') or 'no answer'}"


def service_health(url: str, timeout: float = PROBE_TIMEOUT_S) -> dict[str, Any]:
    """``GET <url>/health`` as a dict; raises OSError (URLError, timeouts) when nothing answers."""
    with urllib.request.urlopen(f"{url}/health", timeout=timeout) as response:
        return json.loads(response.read())


def not_served(url: str, health: Any, name: str) -> str | None:
    """The sentence for a service (its ``/health`` answer) that does not serve ``name``, or None."""
    served = health.get("rewards") if isinstance(health, dict) else None
    if isinstance(served, list) and name in served:
        return None
    return (f"The reward service at {url} serves {served}, not {name!r}; start one that serves it or "
            f"point 'service' in --reward_options for {name!r} at one that does.")


def check_service_options(name: str, options: Mapping[str, Any]) -> None:
    """At argument parsing, before any model loads: the client options of served reward ``name``,
    and a service at their URL that answers and serves ``name``. A ValueError of one sentence."""
    url = client_settings(name, options)["url"]
    try:
        health = service_health(url)
    except (OSError, http.client.HTTPException, ValueError) as e:
        raise ValueError(
            f"The reward service for {name!r} at {url} does not answer ({_reason(e)}); start it "
            f"with `python serve_rewards.py --reward_fn {name}` (see docs/reward_service.md) or fix "
            f"'service' in --reward_options."
        ) from None
    problem = not_served(url, health, name)
    if problem:
        raise ValueError(problem)


def pause_before_try(attempt: int, retries: int, backoff_s: float = 1.0) -> float:
    """Seconds before try ``attempt + 1`` of a request whose ``attempt`` tries failed: while
    retries are left, backoff_s * 2^(attempt - 1), at most MAX_BACKOFF_S (1 s, 2 s, 4 s, ...);
    after them, while the request waits for the service to come back, WAIT_POLL_S."""
    return min(backoff_s * 2 ** (attempt - 1), MAX_BACKOFF_S) if attempt <= retries else WAIT_POLL_S


class ServedReward:
    """Reward ``name`` scored by the service at ``url``: ``fn(samples, prompts, metadata)`` ->
    float32 ``(N,)``, as an in-process reward's callable (samples ``(N, C, F, H, W)`` float in
    [0, 1], or any layout `genrl.rewards.layouts` reads). Each request waits at most ``timeout``
    seconds; one the service does not answer is tried ``retries`` times more, then again until
    ``wait_s`` seconds have passed since its first failure (`pause_before_try`).
    ``may_abstain``: what the service reports of the reward (NaN is a judge's abstention)."""

    def __init__(self, name: str, url: str, *, timeout: float = DEFAULT_TIMEOUT_S, retries: int = DEFAULT_RETRIES,
                 wait_s: float = DEFAULT_WAIT_S, backoff_s: float = 1.0, names: Sequence[str] | None = None,
                 may_abstain: bool = False):
        self.name, self.url, self.timeout, self.retries, self.wait_s = name, url, timeout, retries, wait_s
        self.backoff_s, self.may_abstain = backoff_s, may_abstain
        self.names = list(names or [name])

    def __repr__(self) -> str:
        return f"ServedReward({self.names}, {self.url!r})"

    def asking_for(self, names: Sequence[str]) -> "ServedReward":
        """This client, asking the service for every reward of ``names`` in one request (those of a
        spec served by one service) and answering ``{name: (N,)}``."""
        return ServedReward(self.name, self.url, timeout=self.timeout, retries=self.retries, wait_s=self.wait_s,
                            backoff_s=self.backoff_s, names=names, may_abstain=self.may_abstain)

    def __call__(self, samples: Any, prompts: Sequence[str], metadata: Sequence[Mapping] | None = None
                 ) -> torch.Tensor | dict[str, torch.Tensor]:
        from genrl.rewards.registry import RewardError

        answer = self.send("score", encode_request(samples, prompts, metadata, self.names))
        rewards = answer.get("rewards") if isinstance(answer, dict) else None
        missing = [name for name in self.names if not isinstance(rewards, dict) or name not in rewards]
        if missing:
            got = sorted(rewards) if isinstance(rewards, dict) else json_type(answer)
            raise RewardError(f"The reward service at {self.url} answered with scores of {got}, not of {missing[0]!r}; "
                              f"is 'service' in --reward_options pointing at the right service?")
        scores = {name: torch.tensor(np.asarray(rewards[name], dtype=np.float64), dtype=torch.float32) for name in self.names}
        return scores[self.name] if len(self.names) == 1 else scores

    def send(self, path: str, body: bytes | None = None) -> Any:
        """The JSON answer of ``POST <url>/<path>`` (``GET`` without a body), tried again as the
        class says while the service does not answer; then a RewardError of one sentence."""
        from genrl.rewards.registry import RewardError

        started, first_failure, attempt = time.monotonic(), None, 0
        while True:
            attempt += 1
            request = urllib.request.Request(f"{self.url}/{path}", data=body, method="GET" if body is None else "POST",
                                             headers={"Content-Type": "application/octet-stream"})
            try:
                with urllib.request.urlopen(request, timeout=self.timeout) as response:
                    text = response.read()
            except urllib.error.HTTPError as e:
                sentence = replica_error(e)
                if sentence is not None:  # the reward or the request failed: the same again would too
                    raise RewardError(f"Reward {', '.join(map(repr, self.names))} failed on the reward service at {self.url}: "
                                      f"{sentence.rstrip('.')}.") from e
                last: BaseException = e
            except (OSError, http.client.HTTPException) as e:  # refused, reset, timed out
                last = e
            else:
                if attempt > self.retries + 1:
                    logger.warning(f"The reward service at {self.url} answers again after "
                                   f"{time.monotonic() - first_failure:.0f} s.")
                try:
                    return json.loads(text)
                except ValueError:
                    raise RewardError(f"The reward service at {self.url} answered /{path} with something other than "
                                      f"JSON ({text[:80]!r}); is 'service' in --reward_options a genrl reward service?") from None
            now = time.monotonic()
            first_failure = now if first_failure is None else first_failure
            waited = now - first_failure
            if attempt > self.retries and waited >= self.wait_s:
                hint = "" if self.wait_s else " ('wait_s' in --reward_options waits for a service to come back)"
                raise RewardError(
                    f"The reward service for {', '.join(map(repr, self.names))} at {self.url} did not answer {attempt} "
                    f"tries in {now - started:.0f} s ({_reason(last)}); the run stops here, its last checkpoint "
                    f"intact{hint}."
                ) from last
            if attempt == self.retries + 1:
                logger.warning(f"The reward service at {self.url} does not answer ({_reason(last)}); waiting up to "
                               f"{self.wait_s - waited:.0f} s more for it to come back.")
            pause = pause_before_try(attempt, self.retries, self.backoff_s)
            time.sleep(min(pause, self.wait_s - waited) if attempt > self.retries else pause)  # not past the wait


def build_served_reward(name: str, options: Mapping[str, Any]) -> ServedReward:
    """The client of served reward ``name`` from its ``--reward_options`` (``service``,
    ``timeout``, ``retries``, ``wait_s``), with what the service reports of it (``GET /health``,
    tried as a score request is): whether it may abstain, and its reward models, recorded with
    the run's own (`genrl.rewards.lifecycle.describe_reward_models`)."""
    from genrl.rewards.registry import RewardError

    client = ServedReward(name, **client_settings(name, options))
    health = client.send("health")
    problem = not_served(client.url, health, name)
    if problem:
        raise RewardError(problem)
    properties = health.get("properties") or {}
    client.may_abstain = bool((properties.get(name) or {}).get("may_abstain", False))
    lifecycle.record_served_models(public_url(client.url), health.get("reward_models") or {})
    return client
