"""The trainer's parser: ``transformers.HfArgumentParser`` over the configuration's dataclasses
(``genrl.config.SECTIONS``, one ``--help`` group each), with errors of one line."""

import argparse

from transformers.hf_argparser import HfArgumentParser

from genrl.config.sections import SECTIONS
from genrl.errors import said_once


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Shows each flag's default, except where there is none to show (None, an off switch),
    and keeps the epilog's line breaks."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default is None or action.default is False:
            return action.help
        return super()._get_help_string(action)


class ConfigParser(HfArgumentParser):
    """An HfArgumentParser whose errors are one line: the usage block would bury the sentence
    that says what to change; ``--help`` still shows it. Under a launcher every process parses
    the same command line: the first of each machine says it (``said_once``). ``context``
    starts each error (the config file whose values are being read).

    Flags are spelled as their fields (``--group_size``, not also ``--group-size``: one name in
    ``--help`` and in errors); a switch that is on by default is turned off by ``--no_<name>``
    or argparse's ``--no-<name>``. A field's metadata may give ``nargs`` (a fixed count, e.g. 2
    for a range), and a dataclass's ``_argument_group_description`` describes its group."""

    def __init__(self, dataclass_types, *, context: str = "", **kwargs):
        self.context = context
        super().__init__(dataclass_types, **kwargs)
        descriptions = {getattr(d, "_argument_group_name", None): getattr(d, "_argument_group_description", None)
                        for d in self.dataclass_types}
        for group in self._action_groups:
            group.description = group.description or descriptions.get(group.title)

    def error(self, message: str):
        self.exit(2, said_once(f"{self.prog}: error: {self.context}{message}\n"))

    @staticmethod
    def _parse_dataclass_field(parser, field) -> None:
        HfArgumentParser._parse_dataclass_field(parser, field)
        for name in (f"--{field.name}", f"--no_{field.name}"):
            action = parser._option_string_actions.get(name)
            hyphenated = name[:2] + name[2:].replace("_", "-")
            if action is not None and hyphenated != name:
                action.option_strings.remove(hyphenated)
                del parser._option_string_actions[hyphenated]
        if "nargs" in field.metadata:  # HfArgumentParser reads a list as nargs="+"
            parser._option_string_actions[f"--{field.name}"].nargs = field.metadata["nargs"]
        negative = parser._option_string_actions.get(f"--no_{field.name}")
        if field.default is True and negative is not None:
            spelling = f"--no-{field.name}"  # argparse.BooleanOptionalAction's
            negative.option_strings.append(spelling)
            parser._option_string_actions[spelling] = negative
            negative.help = f"Turns --{field.name} off."


EPILOG = """\
--config PATH.yaml (or .json) reads flag values from a file, keyed by flag name; a flag given on
the command line wins over the file's value. Relative paths in a file that name something in
the repository (the shipped model and prompts) are read from the repository, wherever the
script runs.

Without --config and --pretrained_model_name_or_path the run is the shipped toy model's,
recipes/toy_nft.yaml; with --objective grpo or awm, recipes/toy_grpo.yaml or toy_awm.yaml.
A file's value that a flag of yours makes inapplicable (another objective's setting, more
trained samples per group than your --group_size) is dropped, with one line saying so.
With --pretrained_model_name_or_path and no --config the defaults above apply, and
--prompt_dataset and --reward_fn are required. The real-model recipes: recipes/*.yaml."""


def build_parser(context: str = "") -> ConfigParser:
    """Every flag of the trainer, one group per section, each with a line of help and its
    default; and ``--config``."""
    parser = ConfigParser(
        SECTIONS,
        context=context,
        prog="train_genrl.py",
        usage="%(prog)s [--config PATH.yaml] [--flag VALUE ...]   (flags below, by group)",
        description="RL fine-tuning (GRPO, DiffusionNFT, AWM) of flow-matching image and video generators "
        "(Wan, SD3, FLUX).",
        epilog=EPILOG,
        formatter_class=HelpFormatter,
    )
    parser.add_argument("--config", type=str, default=None, metavar="PATH",
                        help="A YAML or JSON file of flag values (e.g. recipes/flux1_dev_grpo.yaml); flags win over it.")
    return parser
