"""Config files: reading one (YAML or JSON, a mapping of flag names to values), where the
shipped ones are, and the repository paths in them."""

import json
import os
from typing import Any

import yaml

# The repository root: the shipped model, prompts and recipes live under it.
GENRL_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RECIPES = os.path.join(GENRL_ROOT, "recipes")
# The keys whose relative values in a config file may name something shipped with the repository.
PATH_KEYS = ("pretrained_model_name_or_path", "prompt_dataset", "eval_prompt_dataset", "reward_options")
# The no-argument run: the shipped toy model, its prompts and reward, as each objective trains it.
TOY_RUN_OBJECTIVE = "nft"


def toy_config(objective: str | None = None) -> str:
    """The toy run's config file for ``objective`` (default: the no-argument run's); an
    objective without one of its own runs the no-argument run's file."""
    path = os.path.join(RECIPES, f"toy_{objective or TOY_RUN_OBJECTIVE}.yaml")
    return path if os.path.isfile(path) else os.path.join(RECIPES, f"toy_{TOY_RUN_OBJECTIVE}.yaml")


def find_config(path: str) -> str:
    """``path`` as given, or relative to the repository root (``--config recipes/x.yaml`` from
    any folder)."""
    for candidate in (path, os.path.join(GENRL_ROOT, path)):
        if os.path.isfile(candidate):
            return candidate
    raise FileNotFoundError(f"--config {path!r} is not a file (relative paths are tried here and in {GENRL_ROOT}).")


def read_config(path: str) -> dict[str, Any]:
    """The flag values in the YAML or JSON file ``path``, with relative paths that exist in the
    repository made absolute there (``resolve_shipped_paths``)."""
    with open(path) as f:
        try:
            values = json.load(f) if path.endswith(".json") else yaml.safe_load(f)
        except (json.JSONDecodeError, yaml.YAMLError) as e:
            raise ValueError(f"{path} is not valid {'JSON' if path.endswith('.json') else 'YAML'}: "
                             f"{' '.join(str(e).split())}") from None
    if values is None:
        return {}
    if not isinstance(values, dict):
        raise ValueError(f"{path} must hold a mapping of flag names to values, not a {type(values).__name__}.")
    return resolve_shipped_paths(values)


def resolve_shipped_paths(values: dict[str, Any]) -> dict[str, Any]:
    """``values`` with each relative path of ``PATH_KEYS`` that exists under the repository root
    made absolute there, so that a config file's ``genrl/assets/...`` works from any folder;
    other values (Hub ids, paths relative to the working folder) stay as they are."""
    resolved = dict(values)
    for key in PATH_KEYS:
        value = resolved.get(key)
        if isinstance(value, str) and value and not os.path.isabs(value) and os.path.exists(os.path.join(GENRL_ROOT, value)):
            resolved[key] = os.path.join(GENRL_ROOT, value)
    return resolved
