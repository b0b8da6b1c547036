"""Where each rank's checkpoint files live, and the checkpoint every rank resumes from.

A multi-node run may write ``--output_dir`` to one shared file system or to each node's own disk
(local NVMe is the fast choice). :func:`output_dir_is_node_local` finds out at start-up, before
any model loads: the main process writes a probe file and every rank says whether it sees it.
With node-local folders each node's local main process creates, completes (``genrl_state.json``,
the ``.tmp`` rename) and prunes its own copy of every checkpoint, Accelerate saves its files on
each node (``save_on_each_node``) and DeepSpeed its model states on each node's first rank
(``use_node_local_storage``); the export for inference is written on the main node only.

On resume, :func:`agree_on_resume` has every rank list the checkpoints whose files for that rank
are all present, and every rank resumes the newest one they all have; when they have none in
common, the run stops before any training step with one sentence naming what each rank found.
"""

from __future__ import annotations

import glob
import logging
import os
import re
import uuid

from accelerate.utils import broadcast_object_list, gather_object

from genrl.errors import SetupError

logger = logging.getLogger(__name__)

STATE_FILE = "genrl_state.json"
_CHECKPOINT_RE = re.compile(r"^checkpoint-(\d+)$")


def node_index(accelerator) -> int:
    """This process's node (machine rank): torchrun's GROUP_RANK, else the rank over the processes per node."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", accelerator.num_processes))
    return int(os.environ.get("GROUP_RANK", accelerator.process_index // max(1, local)))


def output_dir_is_node_local(accelerator, output_dir: str) -> bool:
    """Whether the nodes of this run each have their own ``output_dir`` rather than one shared
    folder (collective; False on one node). The main process writes a probe file there and every
    rank says whether it sees it; ranks of one node that disagree, or some nodes seeing it and
    others not, are a ``SetupError`` naming them."""
    if accelerator.num_processes == int(os.environ.get("LOCAL_WORLD_SIZE", accelerator.num_processes)):
        return False
    token = broadcast_object_list([uuid.uuid4().hex if accelerator.is_main_process else None])[0]
    probe = os.path.join(output_dir, f".genrl-shared-disk-probe-{token}")
    if accelerator.is_main_process:
        os.makedirs(output_dir, exist_ok=True)
        open(probe, "w").close()
    accelerator.wait_for_everyone()
    seen = gather_object([(node_index(accelerator), os.path.exists(probe))])
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        os.remove(probe)
    by_node: dict[int, set[bool]] = {}
    for node, sees in seen:
        by_node.setdefault(node, set()).add(sees)
    if all(sees == {True} for sees in by_node.values()):
        return False
    main_node = seen[0][0]
    if all(sees == {False} for node, sees in by_node.items() if node != main_node):
        return True
    described = ", ".join(
        f"node {node} {'sees' if sees == {True} else 'does not see' if sees == {False} else 'partly sees'} it"
        for node, sees in sorted(by_node.items())
    )
    raise SetupError(
        f"--output_dir {output_dir} is shared by some nodes and not by others (a file the main node wrote there: "
        f"{described}): give every node the same shared folder, or each node a folder of its own."
    )


def checkpoint_writer(accelerator, node_local: bool) -> bool:
    """Whether this process creates, completes and prunes checkpoint folders: the main process on
    a shared folder, each node's local main process on node-local ones."""
    return accelerator.is_local_main_process if node_local else accelerator.is_main_process


def use_node_local_checkpoints(accelerator, node_local: bool) -> None:
    """Make Accelerate and DeepSpeed write each node's files on that node (call before
    ``accelerator.prepare``: DeepSpeed reads its checkpoint settings when the engine is built)."""
    accelerator.project_configuration.save_on_each_node = node_local
    plugin = accelerator.state.deepspeed_plugin
    if plugin is not None:
        plugin.deepspeed_config.setdefault("checkpoint", {})["use_node_local_storage"] = node_local


def checkpoint_step(path: str) -> int | None:
    """The step of a ``checkpoint-<step>`` folder, None for any other name."""
    match = _CHECKPOINT_RE.match(os.path.basename(os.path.normpath(path)))
    return int(match.group(1)) if match else None


def missing_rank_files(path: str, rank: int, per_rank_dirs: list[str] | tuple[str, ...] = ()) -> list[str]:
    """What checkpoint ``path`` lacks of rank ``rank``'s files (names relative to ``path``): the
    state file, Accelerate's RNG states, the model and optimizer states (DeepSpeed's shard of this
    rank under ``pytorch_model/``, else Accelerate's model and optimizer files) and genrl's per-rank
    states (``<dir>/rank<r>.pt`` or ``.safetensors`` for each of ``per_rank_dirs``)."""
    missing = [name for name in (STATE_FILE, f"random_states_{rank}.pkl") if not os.path.isfile(os.path.join(path, name))]
    deepspeed_dir = os.path.join(path, "pytorch_model")
    if os.path.isdir(deepspeed_dir):
        zero3 = glob.glob(os.path.join(deepspeed_dir, "zero_pp_rank_*_mp_rank_00_model_states.pt"))
        model = f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt" if zero3 else "mp_rank_00_model_states.pt"
        if not os.path.isfile(os.path.join(deepspeed_dir, model)):
            missing.append(f"pytorch_model/{model}")
        if not glob.glob(os.path.join(deepspeed_dir, f"*zero_pp_rank_{rank}_mp_rank_00_optim_states.pt")):
            missing.append(f"pytorch_model/zero_pp_rank_{rank}_mp_rank_00_optim_states.pt")
    else:
        if not any(os.path.isfile(os.path.join(path, n)) for n in ("model.safetensors", "pytorch_model.bin")):
            missing.append("model.safetensors")
        if not os.path.isfile(os.path.join(path, "optimizer.bin")):
            missing.append("optimizer.bin")
    missing += [f"{d}/rank{rank}.pt" for d in per_rank_dirs if not glob.glob(os.path.join(path, d, f"rank{rank}.*"))]
    return missing


def _key(path: str) -> tuple[int, str]:
    """How ranks compare checkpoints: by step, then name (a folder named otherwise has step -1)."""
    step = checkpoint_step(path)
    return (-1 if step is None else step, os.path.basename(os.path.normpath(path)))


def _describe(found: list[tuple[int, str]]) -> str:
    return ", ".join(name for _, name in found) if found else "none"


def rank_findings(candidates: list[str], rank: int, per_rank_dirs: dict[str, list[str]]) -> dict:
    """What rank ``rank`` found among its ``candidates`` (checkpoint folders; ``per_rank_dirs``:
    each one's genrl per-rank folders): the checkpoints whose files for it are all present
    (``complete``), those missing some (``incomplete``), as :func:`_key` tuples, and whether any
    candidate is a checkpoint at all (``any``)."""
    complete = [p for p in candidates if not missing_rank_files(p, rank, per_rank_dirs.get(p, ()))]
    return {
        "rank": rank, "complete": [_key(p) for p in complete],
        "incomplete": [_key(p) for p in candidates if p not in complete],
        "any": any(os.path.isfile(os.path.join(p, STATE_FILE)) for p in candidates),
    }


def choose_resume(found: list[dict], *, latest: bool, named: str | None,
                  output_dir: str) -> tuple[tuple[int, str] | None, str | None]:
    """``(checkpoint, note)``: the checkpoint (a :func:`_key`) every rank resumes, from every rank's
    :func:`rank_findings`, the newest one they all have complete (None when no rank has any and
    ``latest``: a new run), and a warning when some rank has a newer one. A ``named`` folder no
    rank has, or ranks with nothing in common, are a ``SetupError``."""
    if not any(f["any"] for f in found):
        if latest:
            return None, None
        raise SetupError(f"--resume_from_checkpoint {named!r} is not a genrl checkpoint folder (no {STATE_FILE}); "
                         "pass 'latest' or a checkpoint-<step> folder.")
    every = [set(f["complete"]) for f in found]
    common = set.intersection(*every)
    if common:
        chosen = max(common)
        newer = sorted({key for keys in every for key in keys if key > chosen})
        note = f"Resuming {chosen[1]}, the newest one every rank has complete (not every rank has {_describe(newer)})."
        return chosen, note if newer else None
    described = "; ".join(
        f"rank {f['rank']} found {_describe(sorted(f['complete']))}"
        + (f" (incomplete for it: {_describe(sorted(f['incomplete']))})" if f["incomplete"] else "")
        for f in found
    )
    raise SetupError(
        f"The ranks have no checkpoint in common to resume from in --output_dir {output_dir} ({described}): give every "
        f"node the same checkpoints (copy the folders), or start afresh with --overwrite_output_dir or a new --output_dir."
    )


def agree_on_resume(accelerator, candidates: list[str], per_rank_dirs: dict[str, list[str]], *, latest: bool,
                    output_dir: str) -> str | None:
    """The checkpoint folder every rank resumes from (collective): each rank reports what it found
    among its ``candidates`` (its checkpoint folders, oldest first, with ``latest``; else the one
    folder named) and all apply :func:`choose_resume` to every rank's report."""
    found = gather_object([rank_findings(candidates, accelerator.process_index, per_rank_dirs)])
    chosen, note = choose_resume(found, latest=latest, named=None if latest else candidates[0], output_dir=output_dir)
    if note and accelerator.is_main_process:
        logger.warning(note)
    return None if chosen is None else next(p for p in candidates if _key(p) == chosen)
