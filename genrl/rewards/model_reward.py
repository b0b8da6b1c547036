"""What every reward backed by a model shares (HPSv3, VideoAlign, PickScore): where its weights
come from, its dtype, and the registry factory around it.

- `resolve_folder` / `fetch_hub_file`: a local folder or file as is, else the Hub (its cache when
  offline); a failed download is a ``SetupError`` naming the repo; `source_problem`: a local
  path that is not there, found before anything loads;
- `reward_sources_error`: one sentence naming the sources a reward needs and the
  ``--reward_options`` that points it at local copies;
- `resolve_dtype`: the scorer's dtype (bfloat16 on CUDA, float32 elsewhere, unless given);
- `ScorerFamily` + `build_scorer_reward`: the registry factory's common part (option checks, one
  model shared per load through `lifecycle`, samples turned into uint8 clips); the factory's
  ``check_options`` (``ScorerFamily.check_options``) checks option names and paths at argument
  parsing, before any model loads.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional, Sequence, Union

import torch

from genrl.errors import SetupError, hub_failure_reason, json_type
from genrl.rewards import lifecycle
from genrl.rewards.layouts import prepare_images_tensor
from genrl.rewards.registry import unknown_option

# What a path option names (ScorerFamily.paths): a local folder or a Hub repo id, the same or a
# local file (a weights file), a local file (a prompt template).
FOLDER, FILE_OR_FOLDER, FILE = "folder", "file or folder", "file"


def looks_like_hub_id(value: str) -> bool:
    """Whether ``value`` has the form of a Hub repo id, ``org/name``, and not of a path."""
    return value.count("/") == 1 and not os.path.isabs(value) and not value.startswith(".")


def source_problem(value: Any, kind: str) -> Optional[str]:
    """Why ``value`` cannot be what a path option of ``kind`` names (FOLDER, FILE_OR_FOLDER,
    FILE), found without loading or fetching anything, or None when it may be: a Hub repo id is
    only fetched (or read from the Hub cache) when the model loads."""
    hub = kind != FILE
    if not isinstance(value, str) or not value:
        return f"must be a path{' or a Hub repo id' if hub else ''}, not a {json_type(value)}"
    if os.path.isdir(value):
        return "is a folder, not a file" if kind == FILE else None
    if os.path.isfile(value):
        return "is a file, not a folder" if kind == FOLDER else None
    if hub and looks_like_hub_id(value):
        return None
    return "does not exist" + (" (nor is it a Hub repo id like 'org/name')" if hub else "")


def resolve_folder(path_or_repo: str, allow_patterns: Optional[Sequence[str]] = None) -> str:
    """A local folder as is, else a Hub repo id fetched with ``huggingface_hub.snapshot_download``
    (from the local cache when offline); a failed download is a ``SetupError`` naming the repo."""
    if os.path.isdir(path_or_repo):
        return path_or_repo
    if os.path.exists(path_or_repo) or not looks_like_hub_id(path_or_repo):
        raise FileNotFoundError(f"{path_or_repo!r} is neither a folder nor a Hub repo id ('org/name').")
    from huggingface_hub import snapshot_download

    try:
        return snapshot_download(path_or_repo, allow_patterns=list(allow_patterns) if allow_patterns else None)
    except Exception as error:
        raise SetupError(f"Hub repo {path_or_repo!r} could not be fetched: {hub_failure_reason(error)}") from error


def fetch_hub_file(repo: str, filename: str) -> str:
    """``filename`` of Hub repo ``repo`` (from the local cache when offline); a failed download is
    a ``SetupError`` naming the repo."""
    from huggingface_hub import hf_hub_download

    try:
        return hf_hub_download(repo, filename)
    except Exception as error:
        raise SetupError(f"Hub repo {repo!r} ({filename}) could not be fetched: {hub_failure_reason(error)}") from error


def reward_sources_error(name: str, sources: Mapping[str, str], error: SetupError) -> SetupError:
    """One sentence for a reward model that could not be loaded from the Hub: the sources it
    needs (``{option: repo or path}``), what failed, and the ``--reward_options`` that points
    the reward ``name`` at local copies."""
    needs = " and ".join(f"{option} {source!r}" for option, source in sources.items())
    local = json.dumps({name: {option: f"/path/to/{os.path.basename(source.rstrip('/'))}" for option, source in sources.items()}})
    return SetupError(f"Reward {name!r} needs {needs}; {error}; give local copies with --reward_options '{local}'.")


def resolve_dtype(dtype, device: Union[str, torch.device]) -> torch.dtype:
    """``None`` -> bfloat16 on CUDA, float32 elsewhere; ``"bfloat16"``/``"float16"``/``"float32"`` or a dtype."""
    if dtype is None:
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    resolved = getattr(torch, str(dtype).replace("torch.", ""), None)
    if not isinstance(resolved, torch.dtype) or not resolved.is_floating_point:
        raise ValueError(f"Unknown dtype {dtype!r}; expected 'bfloat16', 'float16' or 'float32'.")
    return resolved


@dataclass(frozen=True)
class ScorerFamily:
    """What a registry factory needs to know of one reward model.

    ``cache_name`` names it in the `lifecycle` cache; ``rewards`` are its registry names;
    ``options`` the factory accepts; ``cache_fields``: the options that make two loads
    different models; ``sources``: option -> default repo, named when a download fails;
    ``paths``: option -> what it names (FOLDER, FILE_OR_FOLDER, FILE), checked by `check_options`.
    """

    family: str
    cache_name: str
    rewards: tuple[str, ...]
    options: frozenset[str]
    cache_fields: tuple[str, ...]
    sources: Mapping[str, str]
    paths: Mapping[str, str] = field(default_factory=dict)

    def check_options(self, name: str, options: Mapping[str, Any]) -> None:
        """Options of reward ``name`` that this family does not take, or a path option naming
        something that is not there: a ValueError of one sentence (the registry's
        ``check_options`` hook, so found at argument parsing, before any model loads)."""
        unknown = sorted(set(options) - self.options)
        if unknown:
            raise ValueError(unknown_option(name, unknown[0], self.options))
        for option, kind in self.paths.items():
            if option in options and (problem := source_problem(options[option], kind)) is not None:
                raise ValueError(f"Reward {name!r} option {option!r}: {options[option]!r} {problem}.")


ScoreFn = Callable[[Any, torch.Tensor, list[str], Optional[Sequence[Mapping]]], dict[str, torch.Tensor]]


def build_scorer_reward(
    family: ScorerFamily,
    name: str,
    device: Union[str, torch.device],
    options: Mapping[str, Any],
    load: Callable[..., Any],
    score: ScoreFn,
) -> Callable[..., dict[str, torch.Tensor]]:
    """A registry reward ``fn(samples, prompts, metadata=None)`` -> ``{registry name: (N,)}``.

    Loads (or shares through `lifecycle`) the scorer ``load(device=..., **options)`` now, so
    errors surface at start-up; each call turns ``samples`` into uint8 ``(N, F, H, W, 3)``
    clips and returns ``score(scorer, clips, prompts, metadata)``.
    """
    if name not in family.rewards:
        raise ValueError(f"Unknown {family.family} reward {name!r}; expected one of {sorted(family.rewards)}.")
    family.check_options(name, options)

    def build(dev: torch.device) -> Any:
        try:
            return load(device=dev, **options)
        except SetupError as error:  # a Hub download failed: say which sources and how to give local ones
            sources = {option: options.get(option) or default for option, default in family.sources.items()}
            raise reward_sources_error(name, sources, error) from error

    get_scorer = lifecycle.reward_model_handle(family.cache_name, cache_key(options, device, family.cache_fields), device, build)

    def reward(samples: Any, prompts: Sequence[str], metadata: Optional[Sequence[Mapping]] = None) -> dict[str, torch.Tensor]:
        scorer = get_scorer()  # at call time: a model freed by clear_reward_models is rebuilt here
        if prompts is None:
            raise ValueError("This reward scores images against their prompts; got prompts=None.")
        return score(scorer, prepare_images_tensor(samples), list(prompts), metadata)

    return reward

def cache_key(options: Mapping[str, Any], device: Union[str, torch.device], fields: Sequence[str]) -> str:
    """What makes two loads the same model: the option ``fields`` and the resolved dtype."""
    dtype = resolve_dtype(options.get("dtype"), device)
    return "|".join(f"{f}={options.get(f)}" for f in fields) + f"|dtype={dtype}"
