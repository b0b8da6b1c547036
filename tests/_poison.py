"""A pickle payload that writes a marker file when it is loaded, for resume-safety tests."""

import os

import torch


class Payload:
    """Unpickling this calls ``exec``, which writes ``marker``: what a malicious checkpoint does."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return exec, (f"open({self.marker!r}, 'w').write('ran')",)


def poison(path: str, marker: str) -> None:
    """Rewrite the torch file ``path`` with the payload added, keeping its real content, so that
    a plain ``torch.load`` still returns usable state (and the run goes on) after running it."""
    state = torch.load(path, map_location="cpu", weights_only=False)
    if isinstance(state, dict):
        state["payload"] = Payload(marker)
    else:
        state = {"state": state, "payload": Payload(marker)}
    torch.save(state, path)


def ran(marker: str) -> bool:
    return os.path.exists(marker)
