"""The trainer's configuration: one dataclass per concern (``SECTIONS``), parsed from flags
and config files by ``transformers.HfArgumentParser`` (``build_parser``); ``genrl.training.train_args``
puts the parts together.

    model.py        the base model, LoRA, EMA
    data.py         the prompts
    rewards.py      the rewards and how they are scored
    sampling.py     how rollouts are sampled
    objective.py    prompt groups and advantages, the objective, GRPO's and NFT/AWM's own flags
    optimizer.py    the update and when training stops
    performance.py  memory, speed and processes
    evaluation.py   evaluation and the reward watch
    output.py       the output folder, checkpoints, the Hub
    sections.py     the sections in --help order, and each one's checks run in turn
    evaluator.py    eval_genrl.py's sections: the model, prompts and rewards, sampling, output
    parser.py       the parser (one-line errors, grouped help)
    files.py        config files and the shipped ones
    sources.py      defaults, file and command line: which wins, and what a flag makes inapplicable
    checks.py       the checks across sections
"""

from genrl.config.files import GENRL_ROOT, find_config, read_config, toy_config
from genrl.config.parser import ConfigParser, build_parser
from genrl.config.sections import SECTIONS

__all__ = ["GENRL_ROOT", "SECTIONS", "ConfigParser", "build_parser", "find_config", "read_config", "toy_config"]
