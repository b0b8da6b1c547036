"""Reward registry and the combined reward function the trainer calls.

Spec grammar (``--reward_fn``), items separated by commas, whitespace ignored::

    item   := name [":" weight]            weight: a plain number (1, 0.5, -2, 1e-3); default 1.0
    name   := registered name              e.g. hpsv3, videoalign_ta, jpeg_compressibility
            | module ":" function          your own reward, e.g. mypkg.rewards:my_fn

    "hpsv3:1.0,videoalign_ta:0.5"          two registered rewards
    "mypkg.rewards:my_fn:0.5"              your function with weight 0.5
    "mypkg.rewards:my_fn"                  your function with weight 1.0

An item with one colon is ``name:weight`` when the part after it is a number, else
``module:function``. Registered names never contain a colon.

A registered reward is a *factory*: ``factory(name=..., device=..., **options)`` returns a
callable ``fn(samples, prompts, metadata)`` giving a Tensor ``(N,)`` or a dict of named
``(N,)`` sub-scores, in which case the registry name is the key read. One factory may serve
several names; when names of one factory with the same options are requested together and
the first one's dict holds all of them, it is called once per batch for all of them (e.g.
videoalign_vq + videoalign_ta: one forward pass). Factories share models through
`genrl.rewards.lifecycle.get_reward_model`.

Factories may be registered as ``"package.module:function"`` strings, imported on first
use, so that importing the registry never imports a reward model's heavy dependencies. A
factory that takes ``**options`` checks them itself; with a ``check_options(name, options)``
attribute it does so before any model loads (`check_reward_options`, at argument parsing):
option names and the paths they give.

A reward whose options name a ``service`` URL is scored by a reward service
(``serve_rewards.py``) through `genrl.rewards.service`; its other options live there.

A user function is the reward callable itself, ``fn(samples, prompts, metadata)``; its
options, if any, are passed as keyword arguments on every call.

``samples`` reach every reward as the rollout gives them (float ``(N, C, F, H, W)`` in [0, 1],
on the CPU) or in any layout `genrl.rewards.layouts.prepare_images` accepts; rewards call
`prepare_images` themselves.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import json
import os
import re
import threading
from typing import Any, Callable, Mapping, Sequence, Union

import numpy as np
import torch

from genrl.errors import SetupError, json_type
from genrl.rewards.service import ServedReward, build_served_reward, check_service_options, is_served

Factory = Callable[..., Callable[..., Any]]

_NUMBER = re.compile(r"^[+-]?(\d+(\.\d*)?|\.\d+)([eE][+-]?\d+)?$")
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.\-]*$")
_TOTAL = "total"

_REGISTRY: dict[str, Union[Factory, str]] = {}
_RESOLVE_LOCK = threading.Lock()
# The positional arguments of every reward call; a user function's options are its other keywords.
_CALL_ARGUMENTS = 3


class RewardError(SetupError, RuntimeError):
    """A reward could not be built or failed on a batch (its own error, out of memory, a wrong
    number of scores, NaN, complex values): one sentence naming the reward; the reward's own
    traceback stays in the chain (``__cause__``), which the scripts write to the run's log."""


def register_reward(name: str, factory: Union[Factory, str], *, overwrite: bool = False) -> None:
    """Register ``factory`` (a callable, or a ``"package.module:function"`` path imported
    on first use) under ``name``.

    Registering the same target again is a no-op (a module may register the function a
    path already points to); replacing another target needs ``overwrite=True``.
    """
    if not isinstance(name, str) or not _NAME.match(name) or name == _TOTAL:
        raise ValueError(
            f"Invalid reward name {name!r}: use letters, digits, '_', '.', '-' (no ':' or ','), and not 'total'."
        )
    if isinstance(factory, str):
        _split_path(factory)
    elif not callable(factory):
        raise TypeError(f"A reward factory must be callable or a 'module:function' string, got {factory!r}.")
    old = _REGISTRY.get(name)
    if old is not None and not overwrite and _target(old) != _target(factory):
        raise ValueError(f"Reward {name!r} is already registered to {_target(old)}; pass overwrite=True to replace it.")
    _REGISTRY[name] = factory


def known_rewards() -> list[str]:
    """Sorted names of every registered reward."""
    return sorted(_REGISTRY)


def _target(factory: Union[Factory, str]) -> str:
    if isinstance(factory, str):
        return factory
    return f"{getattr(factory, '__module__', '?')}:{getattr(factory, '__qualname__', repr(factory))}"


def _split_path(path: str) -> tuple[str, str]:
    module, sep, attr = path.partition(":")
    if not sep or not module or not attr.isidentifier() or not all(p.isidentifier() for p in module.split(".")):
        raise ValueError(f"Invalid dotted path {path!r}; expected 'package.module:function'.")
    return module, attr


def _import_path(path: str, what: str) -> Callable[..., Any]:
    module_name, attr = _split_path(path)
    try:
        module = importlib.import_module(module_name)
    except (ImportError, SyntaxError) as e:  # a module that is not there, or does not parse: one sentence
        raise ImportError(f"Could not import module {module_name!r} for {what} ({e}); it must be importable "
                          f"from where the script runs (PYTHONPATH).") from e
    obj = getattr(module, attr, None)
    if not callable(obj):
        raise ValueError(f"{module_name}.{attr} for {what} does not exist or is not callable.")
    return obj


def _factory(name: str) -> Factory:
    """The registered factory, importing a dotted path on first use."""
    with _RESOLVE_LOCK:
        factory = _REGISTRY[name]
        if isinstance(factory, str):
            factory = _import_path(factory, f"reward {name!r}")
            # The import may itself have registered the name; keep a resolved callable.
            _REGISTRY[name] = factory
        return factory


def parse_reward_spec(spec: str) -> list[tuple[str, float]]:
    """``"name:weight,name:weight"`` -> ``[(name, weight), ...]`` (grammar in the module doc).

    Registered names are checked here; user ``module:function`` names when the reward is built.
    """
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"Empty reward spec {spec!r}; expected 'name:weight,...' with names from {known_rewards()}.")
    parsed: list[tuple[str, float]] = []
    for raw in spec.split(","):
        item = raw.strip()
        parts = [p.strip() for p in item.split(":")]
        if len(parts) == 1:
            name, weight = parts[0], "1"
        elif len(parts) == 2:
            # "name:weight" unless the right side is a function name after a non-registered module.
            is_weight = _NUMBER.match(parts[1]) or parts[0] in _REGISTRY or not parts[1].isidentifier()
            name, weight = parts if is_weight else (f"{parts[0]}:{parts[1]}", "1")
        elif len(parts) == 3:
            name, weight = f"{parts[0]}:{parts[1]}", parts[2]
        else:
            raise ValueError(
                f"Cannot parse reward item {item!r}; expected 'name', 'name:weight' or 'module:function:weight'."
            )
        if ":" in name:
            _split_path(name)
        elif name not in _REGISTRY:
            raise ValueError(
                f"Unknown reward {name!r}; known rewards: {known_rewards()} (or 'package.module:function')."
            )
        if not _NUMBER.match(weight):
            raise ValueError(f"Bad weight {weight!r} for reward {name!r} in {spec!r}; expected a number such as 0.5.")
        if any(name == n for n, _ in parsed):
            raise ValueError(f"Reward {name!r} appears twice in {spec!r}.")
        parsed.append((name, float(weight)))
    return parsed


def failure_sentence(what: str, name: str, error: BaseException, batch: int | None = None) -> str:
    """One sentence for reward ``name`` that raised ``error`` (``what``: "Reward 'x' failed",
    "Could not build reward 'x'"): out of memory with what to change, else the error's type and
    the first line of its message (the rest is in its traceback)."""
    if isinstance(error, (torch.OutOfMemoryError, MemoryError)):
        samples = f" on a batch of {batch}" if batch is not None else ""
        return (f"Reward {name!r} ran out of memory{samples} ({type(error).__name__}): give it a smaller batch_size "
                f"in --reward_options if it takes one, a smaller --rollout_batch_size, or another --reward_device.")
    lines = str(error).strip().splitlines()
    return f"{what}: {type(error).__name__}" + (f": {lines[0].rstrip('.')}." if lines else ".")


def _as_scores(value: Any, name: str, n: int, allow_nan: bool) -> torch.Tensor:
    """One reward's output -> float32 CPU ``(N,)``, or an error naming the reward."""
    try:
        scores = torch.as_tensor(np.asarray(value) if isinstance(value, (list, tuple)) else value)
    except Exception as e:
        raise RewardError(f"Reward {name!r} returned {type(value).__name__}, expected N floats.") from e
    if tuple(scores.shape) != (n,):
        raise RewardError(
            f"Reward {name!r} returned shape {tuple(scores.shape)}, expected ({n},): one score per sample."
        )
    if scores.is_complex():  # a cast to float would keep the real part and drop the rest silently
        raise RewardError(f"Reward {name!r} returned complex scores ({scores[0].item()}, ...); a reward must be real numbers.")
    if scores.is_floating_point() and scores.dtype != torch.float32:  # float64 values beyond float32's range
        wide = scores.detach().to("cpu", torch.float64)
        overflow = wide.isfinite() & (wide.abs() > torch.finfo(torch.float32).max)
        if overflow.any():
            raise RewardError(
                f"Reward {name!r} returned {wide[overflow][0].item():g}, which overflows float32 (largest "
                f"{torch.finfo(torch.float32).max:.3g}); scale the reward down."
            )
    scores = scores.detach().to("cpu", torch.float32)
    bad = scores.isinf() | (scores.isnan() & (not allow_nan))
    if bad.any():
        raise RewardError(
            f"Reward {name!r} returned non-finite scores {scores.tolist()}"
            + ("." if allow_nan else " (NaN means 'not applicable' only with allow_nan=True, for evaluation).")
        )
    return scores


class RewardFn:
    """Weighted sum of named rewards.

    ``reward_fn(samples, prompts, metadata=None)`` -> ``{name: (N,) float32 CPU, ..., "total": (N,)}``
    with ``total = sum_i weight_i * score_i`` over the nonzero weights (weight 0: reported only). Attributes: ``names``, ``weights``, ``device``,
    ``allow_nan``. A NaN score ("not applicable to this sample", e.g. a position check on a
    counting prompt) is an error unless ``allow_nan`` or the reward ``may_abstain`` (a judge that
    gave no score: training counts it as its group's average, ``genrl.math.advantages.fill_abstentions``);
    then it makes that sample's total NaN.
    """

    def __init__(
        self, names: list[str], weights: list[float], fns: list[Callable], groups: list[list[int]], device, allow_nan
    ):
        self.names, self.weights, self.device, self.allow_nan = names, weights, device, allow_nan
        self._fns = fns  # one callable per name
        self._groups = groups  # indices of names one call may serve together (same factory and options)

    def __repr__(self) -> str:
        spec = ",".join(f"{n}:{w:g}" for n, w in zip(self.names, self.weights))
        return f"RewardFn({spec!r}, device={str(self.device)!r})"

    def may_abstain(self, name: str) -> bool:
        """Whether reward ``name`` may abstain on a sample with NaN (its callable's
        ``may_abstain``, e.g. a VLM judge's; a served reward's as its service reports it)."""
        return bool(getattr(self._fns[self.names.index(name)], "may_abstain", False))

    def _call(self, i: int, samples, prompts, metadata) -> Any:
        try:
            return self._fns[i](samples, prompts, metadata)
        except SetupError:
            raise  # already one sentence (a reward model rebuilt after clear_reward_models, its weights gone)
        except Exception as e:
            raise RewardError(failure_sentence(f"Reward {self.names[i]!r} failed", self.names[i], e, len(samples))) from e

    def __call__(
        self, samples: Any, prompts: Sequence[str], metadata: Sequence[Mapping] | None = None
    ) -> dict[str, torch.Tensor]:
        n = len(samples)
        if prompts is not None and len(prompts) != n:
            raise ValueError(f"Got {len(prompts)} prompts for {n} samples.")
        if metadata is not None and len(metadata) != n:
            raise ValueError(f"Got {len(metadata)} metadata entries for {n} samples.")
        out: dict[str, torch.Tensor] = {}
        for group in self._groups:
            first = self._call(group[0], samples, prompts, metadata)
            shared = isinstance(first, Mapping) and all(self.names[i] in first for i in group)
            for i in group:
                name = self.names[i]
                value = first if i == group[0] or shared else self._call(i, samples, prompts, metadata)
                if isinstance(value, Mapping):
                    if name not in value:
                        raise RewardError(f"Reward {name!r} returned sub-scores {sorted(value)}, none named {name!r}.")
                    value = value[name]
                # A reward that may abstain (a judge that gave no score) returns NaN for that sample.
                out[name] = _as_scores(value, name, n, self.allow_nan or self.may_abstain(name))
        out = {name: out[name] for name in self.names}  # spec order, whatever the grouping
        total = torch.zeros(n, dtype=torch.float32)
        for name, weight in zip(self.names, self.weights):
            if weight != 0:  # weight 0 = reported, not optimised (and a NaN there stays out of the total)
                total += weight * out[name]
        out[_TOTAL] = total
        return out


def load_reward_options(value: str | None) -> Any:
    """``--reward_options``: JSON text, or a ``.json`` file holding it; parsed, not yet checked
    (``check_reward_options`` does that). Invalid JSON is a ValueError of one sentence saying where."""
    if not value:
        return {}
    source = f"--reward_options file {value!r}" if os.path.isfile(value) else "--reward_options"
    if os.path.isfile(value):
        with open(value) as f:
            value = f.read()
    try:
        return json.loads(value)
    except json.JSONDecodeError as e:
        hint = "" if value.lstrip()[:1] in "{[" else " (nor a file that exists)"
        raise ValueError(f"{source} is not valid JSON{hint}: {e.msg} at line {e.lineno} column {e.colno}.") from None


def check_reward_options(options: Any, specs: Sequence[str]) -> None:
    """Check the rewards of ``specs`` and ``--reward_options`` before any model loads: every
    ``module:function`` reward imports; ``options`` maps reward names (each in one of ``specs``)
    to mappings of options, each of which the reward takes (a registered factory's parameters or
    its ``check_options``, which also checks the paths given; a user function's keywords).
    Raises ValueError or ImportError with one sentence."""
    if not isinstance(options, Mapping):
        raise ValueError(
            f"--reward_options must be a JSON object mapping reward names to their options, got a {json_type(options)}."
        )
    names = list(dict.fromkeys(name for spec in specs for name, _ in parse_reward_spec(spec)))
    for name in names:
        if ":" in name and not is_served(options.get(name)):  # a served function imports on the service
            _import_path(name, f"reward {name!r}")
    for name, opts in options.items():
        if name not in names:
            raise ValueError(f"--reward_options names {name!r}, which is not in --reward_fn or --eval_reward_fn {sorted(names)}.")
        if not isinstance(opts, Mapping):
            raise ValueError(f"--reward_options for {name!r} must be a JSON object of options, got a {json_type(opts)}.")
        if is_served(opts):
            check_service_options(name, opts)  # the service answers and serves it
            continue
        target = _import_path(name, f"reward {name!r}") if ":" in name else _factory(name)
        check = getattr(target, "check_options", None)
        if check is not None:
            check(name, dict(opts))
            continue
        params = list(inspect.signature(target).parameters.values())
        if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
            continue  # it checks its own options when it is built or called
        # A factory is called with name= and device=; a user function with the three arguments of a reward call.
        reserved = [p.name for p in params[:_CALL_ARGUMENTS]] if ":" in name else ["name", "device"]
        takes = [p.name for p in params if p.name not in reserved]
        unknown = sorted(option for option in opts if option not in takes)
        if unknown:
            raise ValueError(unknown_option(name, unknown[0], takes))


def unknown_option(name: str, option: str, takes: Sequence[str]) -> str:
    """The sentence for reward ``name`` given an ``option`` it does not take (``takes``: those it does)."""
    return f"Reward {name!r} takes no option {option!r} (its options: {sorted(takes) or 'none'})."


def build_reward_fn(
    spec: str,
    *,
    device: str | torch.device = "cpu",
    options: Mapping[str, Mapping[str, Any]] | None = None,
    allow_nan: bool = False,
) -> RewardFn:
    """Build every reward of ``spec`` now (errors surface at start-up, not mid-epoch).

    ``options[name]`` are passed to that reward's factory (user functions: to every call).
    ``allow_nan`` lets rewards report NaN for "not applicable" (evaluation); training keeps
    the default, where a NaN score is an error naming the reward.
    """
    parsed = parse_reward_spec(spec)
    options = dict(options or {})
    unused = sorted(set(options) - {n for n, _ in parsed})
    if unused:
        raise ValueError(f"Options given for rewards {unused} that are not in the spec {spec!r}.")
    device = torch.device(device)
    fns, groups, group_keys = [], [], []
    for index, (name, _) in enumerate(parsed):
        opts = dict(options.get(name, {}))
        key = None  # user functions are never grouped
        if is_served(opts):
            fn = build_served_reward(name, opts)
            key = (build_served_reward, opts)  # the rewards of one service: one request for all of them
        elif ":" in name:
            fn = _import_path(name, f"reward {name!r}")
            fn = _with_kwargs(fn, opts) if opts else fn
        else:
            factory = _factory(name)
            try:
                fn = factory(name=name, device=device, **opts)
            except SetupError:
                raise  # already one sentence (weights that could not be fetched)
            except Exception as e:
                raise RewardError(failure_sentence(f"Could not build reward {name!r}", name, e)) from e
            key = (factory, opts)
        fns.append(fn)
        for group, group_key in zip(groups, group_keys):
            if key is not None and group_key is not None and group_key[0] is key[0] and group_key[1] == key[1]:
                group.append(index)
                break
        else:
            groups.append([index])
            group_keys.append(key)
    for group, group_key in zip(groups, group_keys):
        if isinstance(fns[group[0]], ServedReward) and len(group) > 1:
            fns[group[0]] = fns[group[0]].asking_for([parsed[i][0] for i in group])
    return RewardFn([n for n, _ in parsed], [w for _, w in parsed], fns, groups, device, allow_nan)


def _with_kwargs(fn: Callable[..., Any], kwargs: dict) -> Callable[..., Any]:
    @functools.wraps(fn)  # keeps what the function says of itself (may_abstain)
    def call(samples, prompts, metadata):
        return fn(samples, prompts, metadata, **kwargs)

    return call


# Built-in rewards, resolved on first use.
for _name in ("jpeg_compressibility", "jpeg_incompressibility"):
    register_reward(_name, "genrl.rewards.rule_based:build_jpeg_reward")
register_reward("temporal_smoothness", "genrl.rewards.rule_based:build_temporal_smoothness_reward")
for _name in ("toy_geneval", "toy_geneval_strict", "toy_geneval_color", "toy_geneval_shape", "toy_geneval_count",
              "toy_geneval_position"):
    register_reward(_name, "genrl.rewards.toy_geneval:build_toy_geneval_reward")
for _name in ("hpsv3", "hpsv3_top30"):
    register_reward(_name, "genrl.rewards.hpsv3:build_hpsv3_reward")
for _name in ("videoalign_vq", "videoalign_mq", "videoalign_ta", "videoalign_overall"):
    register_reward(_name, "genrl.rewards.videoalign:build_videoalign_reward")
register_reward("pickscore", "genrl.rewards.pickscore:build_pickscore_reward")
register_reward("vlm_judge", "genrl.rewards.vlm_judge:build_vlm_judge_reward")


def build_eval_reward_fn(
    spec: str, train_spec: str, train_fn: RewardFn, *, device: Union[str, torch.device] = "cpu", options: Mapping | None = None
) -> RewardFn:
    """The rewards an evaluation reports: ``train_fn`` itself when ``spec`` is the training spec
    ``train_spec``; else ``spec`` built with the ``options`` of its own names, a NaN score allowed
    (a sub-score may not apply to every prompt)."""
    if spec == train_spec:
        return train_fn
    names = dict(parse_reward_spec(spec))
    return build_reward_fn(spec, device=device, options={k: v for k, v in (options or {}).items() if k in names}, allow_nan=True)
