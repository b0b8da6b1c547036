"""What the trainer prints: one progress bar over the run, one line per evaluation, and none of
the start-up warnings a user cannot act on (nor the bars of loading components from disk).

Only known noise is dropped, each by its logger and the text of its message, so that the
same loggers' other warnings still show:

- transformers, without torchvision: "`CLIPImageProcessor` requires torchvision (not
  installed); falling back to ...Pil" (the PIL one is the processor a machine without
  torchvision has; it prepares Wan 2.1 I2V's CLIP input);
- diffusers: "There are modules in AutoencoderKL that should be kept in float32: []" (an
  empty list: there is nothing to keep in float32; a non-empty list still shows);
- DeepSpeed on a machine without GPU: "Setting accelerator to CPU" (the CPU run is meant);
- torch, as a Python warning each time DeepSpeed's ZeRO gathers or reduce-scatters:
  "`torch.distributed.all_gather_into_tensor` is deprecated" (and ``reduce_scatter_tensor``).
  It is DeepSpeed's call to change, not the user's, and a ZeRO-3 run printed it thousands of
  times: libraries that touch the warning filters reset Python's once-per-place memory.
- peft, loading a Wan 2.1 I2V LoRA that does not adapt the image attention (``add_k_proj``,
  ``add_v_proj``): diffusers adds zero LoRA layers for them, which its adapter config does not list.

accelerate's "The following values were not passed to `accelerate launch`" comes from the
launcher's process, before this script starts: ``--config_file accelerate_configs/single_gpu.yaml``
(or ``accelerate config default`` once) avoids it.
"""

from __future__ import annotations

import logging
import re
import warnings
from typing import Mapping

from genrl.evaluation.scores import reward_means

# logger name -> patterns of messages that are known noise (searched in the formatted message)
KNOWN_NOISE: dict[str, tuple[str, ...]] = {
    "transformers.utils.import_utils": (r"requires torchvision \(not installed\); falling back to",),
    "diffusers.models.modeling_utils": (r"should be kept in float32: \[\]\.",),
    "DeepSpeed": (r"^Setting accelerator to CPU\.",),
}


# (category, pattern matched at the start of the message) of Python warnings that are known noise
KNOWN_WARNINGS: tuple[tuple[type[Warning], str], ...] = (
    (FutureWarning, r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated"),
    (RuntimeWarning, r"While injecting the PEFT adapters, an inconsistency was discovered between the PEFT config and the "
                     r"provided state_dict\. .* additional target modules: \['blocks\.\d+\.attn2\.add_[kv]_proj'"),
)


class DropMessages(logging.Filter):
    """A logging filter that drops the records whose message matches one of ``patterns``."""

    def __init__(self, patterns: tuple[str, ...]):
        super().__init__()
        self.patterns = [re.compile(p) for p in patterns]

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(p.search(message) for p in self.patterns)


def silence_known_noise(noise: Mapping[str, tuple[str, ...]] = KNOWN_NOISE,
                        warning_noise: tuple[tuple[type[Warning], str], ...] = KNOWN_WARNINGS) -> None:
    """Attach a ``DropMessages`` filter to each logger of ``noise`` (once per logger) and ignore
    the Python warnings of ``warning_noise``. Call it before the libraries are imported: some
    warn at import time."""
    for name, patterns in noise.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, DropMessages) for f in logger.filters):
            logger.addFilter(DropMessages(patterns))
    for category, pattern in warning_noise:
        warnings.filterwarnings("ignore", message=pattern, category=category)


def hide_loading_bars() -> None:
    """No progress bars for loading a pipeline's components from disk: diffusers and
    transformers draw one per component, nested (about ten console lines for a few seconds).
    Downloads from the Hub keep their bars (huggingface_hub's own)."""
    from diffusers.utils import logging as diffusers_logging
    from transformers.utils import logging as transformers_logging

    diffusers_logging.disable_progress_bar()
    transformers_logging.disable_progress_bar()


def close_progress_bars() -> None:
    """Close the progress bars a stopped run left open, so that the line printed next (its one
    sentence) starts a line of its own instead of following the bar's last state."""
    from tqdm import tqdm

    for bar in list(getattr(tqdm, "_instances", ())):  # tqdm's set of the bars not closed yet
        bar.close()


def eval_line(step: int, values: Mapping[str, float], prefix: str = "eval", where: str = "") -> str:
    """The one line printed per evaluation: ``eval at step 20: toy_geneval 0.4920, ...``, of the
    ``<prefix>/<reward>_mean`` values; ``where`` follows the step (``at the pipeline's defaults``)."""
    means = reward_means(values, prefix)
    return f"eval at step {step}{' ' + where if where else ''}: " + ", ".join(f"{name} {v:.4f}" for name, v in means.items())


def progress_postfix(epoch_logs: Mapping[str, float], last_eval: Mapping[str, float]) -> str:
    """The progress bar's postfix: the latest epoch's mean training reward(s) and the first
    reward of the latest evaluation."""
    parts = [f"reward {name} {v:.4f}" for name, v in reward_means(epoch_logs, "reward").items()]
    evals = reward_means(last_eval, "eval")
    if evals:
        name, value = next(iter(evals.items()))
        parts.append(f"eval {name} {value:.4f}")
    return ", ".join(parts)
