"""Every flag a recipe passes must exist: recipes are parsed by the trainer's own parser."""

import glob
import os
import shlex

import pytest

from conftest import ROOT

from genrl import train_args
from genrl.rewards import load_reward_options

RECIPES = sorted(glob.glob(os.path.join(ROOT, "recipes", "*.sh")))


def expand_defaults(text: str) -> str:
    import re

    return re.sub(r"\$\{[A-Z_0-9]+:-([^}]*)\}", r"\1", text)


@pytest.mark.parametrize("path", RECIPES, ids=os.path.basename)
def test_recipe_flags_parse(path, monkeypatch):
    text = expand_defaults(open(path).read()).replace("\\\n", " ")
    line = next(l for l in text.splitlines() if "train_genrl.py" in l)
    words = shlex.split(line.replace('"$@"', ""))
    args = train_args.parse_args(words[words.index("train_genrl.py") + 1 :])
    assert os.path.isfile(os.path.join(ROOT, args.prompt_dataset)), "the recipe's default prompt file must ship"
    assert args.reward_options is None or load_reward_options(args.reward_options)


def test_there_are_recipes_for_wan_sd35_and_flux():
    names = " ".join(os.path.basename(p) for p in RECIPES)
    assert "wan21" in names and "sd35" in names and "flux" in names
