"""Where a run's values come from: the fields' defaults, a config file, the command line
(each wins over the one before), and what happens when they disagree: a value of the file
that a command-line flag (or the launch) makes inapplicable is dropped, never refused."""

import argparse
import difflib
import json
from typing import Any

from genrl.config.parser import ConfigParser
from genrl.distributed.zero3 import under_zero3
from genrl.objectives import OBJECTIVES

# Stands for "not given" where None is a value a flag can have.
_UNSET = object()


def given_on_command_line(parser: ConfigParser, argv: list[str]) -> dict[str, Any]:
    """The values of the flags ``argv`` gives, by name (none of the defaults)."""
    unset = argparse.Namespace(**{a.dest: _UNSET for a in parser._actions if a.dest != argparse.SUPPRESS})
    given = parser.parse_args(argv, namespace=unset)
    return {name: value for name, value in vars(given).items() if value is not _UNSET}


def config_file_values(parser: ConfigParser, values: dict[str, Any]) -> dict[str, Any]:
    """A config file's ``values`` as the parser reads them from flags (types, choices, counts:
    ``learning_rate: 2e-4`` as ``--learning_rate 2e-4``); a mapping is a JSON flag value
    (``reward_options``). ``parser`` names the file in its errors, each one sentence."""
    actions = {a.dest: a for a in parser._actions if a.dest not in ("help", "config")}
    words, nulls = [], {}
    for key, value in values.items():
        if key not in actions:
            close = difflib.get_close_matches(str(key), actions, n=1)
            parser.error(f"unknown key {key!r}, not a flag of train_genrl.py"
                         + (f" (did you mean {close[0]!r}?)" if close else " (see --help)") + ".")
        action = actions[key]
        if value is None:
            if action.default is not None:
                parser.error(f"{key} needs a value (its default is {action.default!r}), not null.")
            nulls[key] = None
        elif isinstance(value, list):
            if not isinstance(action.nargs, int):
                parser.error(f"{key} takes one value, not a list.")
            words += [f"--{key}", *map(str, value)]
        else:
            words.append(f"--{key}={json.dumps(value) if isinstance(value, dict) else value}")
    return {**given_on_command_line(parser, words), **nulls}


def drop_inapplicable(args: argparse.Namespace, file_values: dict[str, Any], given: dict[str, Any],
                      defaults: dict[str, Any], source: str) -> list[str]:
    """Drops, in ``args``, the config file's values (``file_values``, read from ``source``) that
    a flag the user gave (``given``) or the launch makes inapplicable, back to their
    ``defaults``; one line each saying so. Such a value is one the user did not set, so it
    never causes a refusal; the same value given as a flag is checked as usual."""
    notes = []

    def from_file(name: str) -> bool:
        return name in file_values and name not in given

    if "objective" in given:
        readers = {}  # flag -> the objectives that read it
        for name, objective in OBJECTIVES.items():
            for key in objective.own_args:
                readers.setdefault(key, []).append(name)
        for key, names in readers.items():
            if args.objective not in names and from_file(key) and getattr(args, key) != defaults[key]:
                notes.append(f"{source} sets --{key} {getattr(args, key)}, which only --objective {' or '.join(names)} "
                             f"reads: --objective {args.objective} leaves it at {defaults[key]}.")
                setattr(args, key, defaults[key])
    kept = args.train_samples_per_group
    if from_file("train_samples_per_group") and "group_size" in given and kept is not None and kept > args.group_size:
        notes.append(f"{source} sets --train_samples_per_group {kept}, more than --group_size {args.group_size}: "
                     f"every sample of a group trains.")
        args.train_samples_per_group = None
    if from_file("watch_reference") and args.watch_reference and not args.use_lora and under_zero3():
        # A full frozen copy on every rank is what ZeRO-3 exists to avoid.
        notes.append(f"{source} sets --watch_reference, which under ZeRO-3 would keep a full reference copy on every "
                     f"rank: the reward watch runs without the drift from the reference.")
        args.watch_reference = False
    return notes
