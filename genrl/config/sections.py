"""The configuration's sections in ``--help`` order: one dataclass per concern, each with the
checks of its own fields (``check``); the checks across sections are in ``genrl.config.checks``."""

import argparse
import dataclasses

from genrl.config.data import DataArguments
from genrl.config.evaluation import EvaluationArguments, RewardWatchArguments
from genrl.config.model import EMAArguments, LoraArguments, ModelArguments
from genrl.config.objective import ForwardArguments, GRPOArguments, ObjectiveArguments, RolloutArguments
from genrl.config.optimizer import OptimizerArguments
from genrl.config.output import CheckpointArguments, HubArguments, OutputArguments
from genrl.config.performance import PerformanceArguments
from genrl.config.rewards import RewardArguments
from genrl.config.sampling import SamplingArguments

SECTIONS = (
    ModelArguments, DataArguments, RewardArguments, SamplingArguments, RolloutArguments, ObjectiveArguments,
    GRPOArguments, ForwardArguments, OptimizerArguments, LoraArguments, EMAArguments, PerformanceArguments,
    EvaluationArguments, RewardWatchArguments, CheckpointArguments, HubArguments, OutputArguments,
)


def check_sections(args: argparse.Namespace, sections: tuple[type, ...] = SECTIONS) -> None:
    """Each section's checks of its own fields, in ``--help`` order; what a check fills in
    (``eval_reward_fn``, ``height``, an absolute ``output_dir``) goes back into ``args``."""
    for section_type in sections:
        section = section_type(**{f.name: getattr(args, f.name) for f in dataclasses.fields(section_type)})
        if hasattr(section, "check"):
            section.check()
        vars(args).update(dataclasses.asdict(section))
