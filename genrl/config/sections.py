"""The configuration's sections in ``--help`` order: one dataclass per concern, each with the
checks of its own fields (``check``); the checks across sections are in ``genrl.config.checks``."""

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
