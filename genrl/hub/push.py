"""Pushing an exported model to the Hugging Face Hub.

Call these from the MAIN process only (``if accelerator.is_main_process:``), and only after
the local export has been written completely: the push reads the folder as it is on disk.
A push never deletes, moves or rewrites a local file, so a failed push leaves the export
exactly as it was; the error names the step that failed, the repo, and the local folder.

What is uploaded from the export folder:
- everything the export holds (``genrl_config.json``, ``transformer/`` or the LoRA weights,
  ``README.md`` model card, sample images, ``logs/`` with ``metrics.jsonl`` and the
  TensorBoard events — small, and what makes a run reviewable on the Hub),
- except the intermediate ``checkpoint-<step>/`` folders (optimizer and RNG state, many GB
  each, only useful to resume training locally) and the run's lock of the folder (it names
  the host and PID that held it).

Where the Hub is: ``HF_ENDPOINT`` (read by huggingface_hub at import) or its default.
"""

from __future__ import annotations

import os
from concurrent.futures import Future, ThreadPoolExecutor

from huggingface_hub import HfApi

from genrl.checkpoints.output_lock import LOCK_FILE

# fnmatch patterns, relative to the export folder; "*" also matches "/", so this drops the
# checkpoint folders with everything inside them.
CHECKPOINT_PATTERNS = ["checkpoint-*"]
NEVER_PUSHED = CHECKPOINT_PATTERNS + [LOCK_FILE]

# The files of a checkpoint folder that make a loadable model (the export layout); the rest
# of a checkpoint is Accelerate/DeepSpeed training state that the Hub does not need.
EXPORT_PATTERNS = [
    "genrl_config.json",
    "README.md",
    "transformer/*",
    "transformer_ema/*",
    "pytorch_lora_weights*.safetensors",
]


class HubPushError(RuntimeError):
    """A push to the Hub failed; the local folder it names is untouched."""


def _ignore_cli_hint(repo_id: str, folder: str) -> str:
    return f"hf upload {repo_id} {folder} . " + " ".join(f"--exclude '{pattern}'" for pattern in NEVER_PUSHED)


def push_to_hub(
    export_dir: str,
    *,
    repo_id: str,
    token: str | None = None,
    private: bool = False,
    commit_message: str = "Upload genrl fine-tuned model",
    allow_patterns: list[str] | None = None,
    ignore_patterns: list[str] | None = None,
) -> str:
    """Create ``repo_id`` if needed (``exist_ok=True``) and upload ``export_dir`` to it.

    Args:
        export_dir: the finished local export (final ``output_dir`` or a ``checkpoint-<step>``).
        repo_id: ``"namespace/name"`` on the Hub.
        token: a Hub token; ``None`` uses the locally saved one.
        private: create the repo private (ignored when it already exists).
        allow_patterns: upload only these (fnmatch, relative paths); ``None`` = everything.
        ignore_patterns: skipped in addition to ``NEVER_PUSHED``.

    Returns:
        The URL of the commit on the Hub.

    Raises:
        ValueError: ``export_dir`` is not a folder holding files, or ``repo_id`` is empty.
        HubPushError: creating the repo or uploading failed; the message names the step,
            the repo and the local folder, which is left intact.
    """
    export_dir = os.path.abspath(export_dir)
    if not repo_id or not repo_id.strip():
        raise ValueError("push_to_hub got an empty repo_id; pass 'namespace/name', e.g. --hub_model_id me/wan-grpo.")
    if not os.path.isdir(export_dir) or not any(os.scandir(export_dir)):
        raise ValueError(
            f"push_to_hub got export_dir={export_dir!r}, which is not a folder holding an export; "
            "save the model locally first, then push that folder."
        )

    api = HfApi(token=token)
    try:
        api.create_repo(repo_id, private=private, exist_ok=True)
    except Exception as err:
        raise HubPushError(
            f"Creating the Hub repo {repo_id!r} at {api.endpoint} failed ({type(err).__name__}: {err}). "
            f"Nothing was uploaded; the local export at {export_dir} is intact. "
            f"Push it later with: {_ignore_cli_hint(repo_id, export_dir)}"
        ) from err
    try:
        info = api.upload_folder(
            repo_id=repo_id,
            folder_path=export_dir,
            commit_message=commit_message,
            allow_patterns=allow_patterns,
            ignore_patterns=NEVER_PUSHED + list(ignore_patterns or []),
        )
    except Exception as err:
        raise HubPushError(
            f"Uploading {export_dir} to the Hub repo {repo_id!r} at {api.endpoint} failed "
            f"({type(err).__name__}: {err}). The local export at {export_dir} is intact. "
            f"Push it later with: {_ignore_cli_hint(repo_id, export_dir)}"
        ) from err
    return str(info.commit_url)


# One worker: checkpoint pushes land on the Hub in the order they were saved, and at most
# one upload competes with training for bandwidth.
_checkpoint_pusher: ThreadPoolExecutor | None = None


def push_checkpoint_async(
    checkpoint_dir: str,
    *,
    repo_id: str,
    token: str | None = None,
    private: bool = False,
    step: int | None = None,
) -> Future:
    """Push the model files of a ``checkpoint-<step>`` folder (``EXPORT_PATTERNS``, not the
    optimizer/RNG state) to ``repo_id`` in a background thread; returns a ``Future[str]``
    whose result is the commit URL, or whose exception is a ``HubPushError``.

    Main process only. Training goes on while it uploads; the caller must not delete the
    checkpoint (``--checkpoints_total_limit``) before the future is done, and should call
    ``.result()`` on the last one before exiting to surface any error.
    """
    global _checkpoint_pusher
    if _checkpoint_pusher is None:
        _checkpoint_pusher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="genrl-hub-push")
    label = f"step {step}" if step is not None else os.path.basename(os.path.normpath(checkpoint_dir))
    return _checkpoint_pusher.submit(
        push_to_hub,
        checkpoint_dir,
        repo_id=repo_id,
        token=token,
        private=private,
        commit_message=f"Training in progress, {label}",
        allow_patterns=EXPORT_PATTERNS,
    )
