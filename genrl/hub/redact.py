"""Secrets kept out of everything a run records: configs, model cards, logs, trackers.

A Hub token reaches the trainer as ``--hub_token`` (or pasted by mistake into another value).
The run keeps it in ``args.hub_token`` for the push alone; the command line and the
arguments are redacted with these functions before they are written anywhere, because
``genrl_config.json`` and the model card are uploaded next to the weights.
"""

from __future__ import annotations

import re
from typing import Any, Mapping, Sequence

REDACTED = "***"

# Flags whose value is a secret, each with the shortest prefix argparse accepts for it
# (argparse takes any unambiguous prefix; --hub_ alone also fits --hub_model_id).
_SECRET_FLAGS = {"--hub_token": "--hub_t"}
# Argument names (argparse dests) whose value is a secret.
SECRET_ARGS = ("hub_token",)
# A Hugging Face user access token: "hf_" and 34 letters and digits. 20 or more is enough to
# catch one, and more than names such as hf_cache or hf_home have.
_HF_TOKEN = re.compile(r"(?<![A-Za-z0-9])hf_[A-Za-z0-9]{20,}")


def redact_text(text: str) -> str:
    """``text`` with every Hugging Face token-looking substring replaced by ``***``."""
    return _HF_TOKEN.sub(REDACTED, text)


def _is_secret_flag(flag: str) -> bool:
    return any(full.startswith(flag) and flag.startswith(short) for full, short in _SECRET_FLAGS.items())


def redact_argv(argv: Sequence[str]) -> list[str]:
    """A command line with secrets replaced by ``***``: the value of ``--hub_token X`` and
    ``--hub_token=X`` (and of their argparse abbreviations), and any token-looking string
    anywhere else. The flags themselves stay, so the line still reads as what was run."""
    out: list[str] = []
    secret_next = False
    for word in argv:
        flag, eq, _ = word.partition("=")
        if secret_next:
            out.append(REDACTED)
        elif eq and _is_secret_flag(flag):
            out.append(f"{flag}={REDACTED}")
        else:
            out.append(redact_text(word))
        secret_next = not secret_next and not eq and _is_secret_flag(word)
    return out


def _redact_value(value: Any) -> Any:
    if isinstance(value, str):
        return redact_text(value)
    if isinstance(value, (list, tuple)):
        return type(value)(_redact_value(v) for v in value)
    if isinstance(value, Mapping):
        return {k: _redact_value(v) for k, v in value.items()}
    return value


def redact_args(args: Mapping[str, Any]) -> dict[str, Any]:
    """Parsed arguments (``vars(args)``) fit to record: the secret ones dropped, token-looking
    strings in the others replaced by ``***``."""
    return {k: _redact_value(v) for k, v in args.items() if k not in SECRET_ARGS}
