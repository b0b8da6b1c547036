"""Errors a user fixes with one change, and how scripts show them: one sentence, no traceback.

A model id that cannot be fetched or reward weights that are nowhere to be found are not bugs:
the traceback (70-140 lines through huggingface_hub and the reward scorer) would hide the one
thing to change. Code that detects such a problem raises ``SetupError`` with a sentence naming
what to change; the scripts print it (see ``find_setup_error``). Reward failures reach the
training loop wrapped by the reward registry and the scorer, hence the walk along the causes.
"""

from __future__ import annotations

from typing import Any


class SetupError(ValueError):
    """Input or environment the user must fix; its message is the whole report."""


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


def json_type(value: Any) -> str:
    """How JSON calls the type of a parsed value (for messages): object, list, string, number,
    boolean, null; other Python types by their name."""
    names = {dict: "object", list: "list", str: "string", bool: "boolean", int: "number", float: "number"}
    return "null" if value is None else names.get(type(value), type(value).__name__)


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
