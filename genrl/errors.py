"""Errors a user fixes with one change, and how scripts show them: one sentence, no traceback.

A model id that cannot be fetched or reward weights that are nowhere to be found are not bugs:
the traceback (70-140 lines through huggingface_hub and the reward scorer) would hide the one
thing to change. Code that detects such a problem raises ``SetupError`` with a sentence naming
what to change; the scripts print it (see ``find_setup_error``). Reward failures reach the
training loop wrapped by the reward registry and the scorer, hence the walk along the causes.
"""

from __future__ import annotations

import os
import traceback
from typing import Any

# The file, inside the run's log folder, that keeps the tracebacks behind a one-sentence stop
# (``error-rank<r>.log`` for the other ranks of a multi-process run).
TRACEBACK_FILE = "error.log"


class SetupError(ValueError):
    """Input or environment the user must fix; its message is the whole report on the console
    (the tracebacks behind it, if any, go to a file: see ``stop_line``)."""


def find_setup_error(error: BaseException | None) -> SetupError | None:
    """``error`` itself or the first ``SetupError`` among its causes (``raise ... from``, or an
    exception raised while handling another), or None."""
    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, SetupError):
            return error
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return None


def said_once(line: str) -> str | None:
    """``line`` in the first process of each machine, None in the others: a refusal that every
    process reaches alike (one command line, the same files) is printed once under a launcher
    (``LOCAL_RANK``), not once per process; the others exit with the same status, silently."""
    return line if os.environ.get("LOCAL_RANK", "0") == "0" else None


def json_type(value: Any) -> str:
    """How JSON calls the type of a parsed value (for messages): object, list, string, number,
    boolean, null; other Python types by their name."""
    names = {dict: "object", list: "list", str: "string", bool: "boolean", int: "number", float: "number"}
    return "null" if value is None else names.get(type(value), type(value).__name__)


def _has_cause(error: BaseException) -> bool:
    """Whether ``error`` came from another exception (``raise ... from``, or raised while
    handling one), so that its traceback holds more than its sentence."""
    return error.__cause__ is not None or (error.__context__ is not None and not error.__suppress_context__)


def write_traceback(error: BaseException, folder: str) -> str | None:
    """The chain of tracebacks of ``error`` written to ``TRACEBACK_FILE`` in ``folder`` (created
    if needed; ``error-rank<r>.log`` on ranks other than 0); its path, or None when it could not
    be written (a full disk is a reason to stop, too)."""
    rank = os.environ.get("RANK", "0")
    name = TRACEBACK_FILE if rank == "0" else TRACEBACK_FILE.replace(".log", f"-rank{rank}.log")
    path = os.path.join(os.path.abspath(folder), name)
    try:
        os.makedirs(folder, exist_ok=True)
        with open(path, "w") as f:
            f.write("".join(traceback.format_exception(error)))
    except OSError:
        return None
    return path


def stop_line(script: str, reason: object, error: BaseException, log_folder: str | None) -> str:
    """The line a script ends with when it stops for ``reason`` (one sentence) raised as
    ``error``: ``<script>: error: <reason>``. When ``error`` or the ``SetupError`` behind it came
    from another exception (a reward's own error, a failed download, the OS's write error), the
    tracebacks go to a file in ``log_folder`` that the sentence names: the console keeps one
    sentence and nothing is lost."""
    sentence = str(reason)
    if log_folder and (reason is not error or _has_cause(error)):
        path = write_traceback(error, log_folder)
        if path is not None:
            sentence = f"{sentence.rstrip('.')} (the traceback is in {path})."
    return f"{script}: error: {sentence}"


def hub_failure_reason(error: BaseException) -> str:
    """Why a Hub download failed, in words that say what to do about it."""
    from huggingface_hub import constants
    from huggingface_hub.errors import GatedRepoError, HFValidationError, RepositoryNotFoundError, RevisionNotFoundError

    if isinstance(error, HFValidationError):
        return "it is not a valid Hub id ('org/name')"
    if constants.HF_HUB_OFFLINE:
        return "HF_HUB_OFFLINE is set and it is not in the local Hub cache"
    if isinstance(error, GatedRepoError):
        return "the repo is gated: accept its licence on huggingface.co, then log in with `hf auth login`"
    if isinstance(error, RepositoryNotFoundError):
        return "no such repo on the Hub, or a private one (log in with `hf auth login`)"
    if isinstance(error, RevisionNotFoundError):
        return "no such revision in the repo"
    return f"the Hub could not be reached and it is not in the local cache ({type(error).__name__})"


def hub_hint() -> str:
    """What to do instead of fetching from the Hub."""
    return "pass a local folder instead, or fetch it once with network access (later runs with HF_HUB_OFFLINE=1 read the cache)"
