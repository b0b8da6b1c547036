"""Prompt sets through `datasets`: text files, JSON lines, CSV, saved datasets, Hub datasets;
for image-to-video models each record also names its conditioning image (``genrl.data.prompt_images``)."""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field

import datasets

from genrl.data.prompt_images import ImageRef, resolve_image
from genrl.errors import json_type

logger = logging.getLogger(__name__)


@dataclass
class PromptSet:
    """Prompts and, per prompt, the other fields of its record (handed to rewards) and, for an
    image-to-video prompt set, its conditioning image (None: text only)."""

    prompts: list[str]
    metadata: list[dict] = field(default_factory=list)
    images: list[ImageRef] | None = None

    def __len__(self) -> int:
        return len(self.prompts)


_FILE_BUILDERS = {".txt": "text", ".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet"}


def _without_progress_bars(load):
    """``load()`` with datasets' progress bars off: a local prompt file loads in a moment, and
    its "Generating train split" bar would be one more console line per run."""
    was_enabled = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    try:
        return load()
    finally:
        if was_enabled:
            datasets.enable_progress_bars()


def _check_file(source: str, ext: str) -> None:
    """An empty file, or a JSON-lines line that is not a JSON object, is one sentence naming
    the file and the line (``datasets`` would name neither)."""
    if os.path.getsize(source) == 0:
        raise ValueError(f"Prompt file {source!r} is empty.")
    if ext != ".jsonl":
        return
    with open(source, encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line.strip())
            except json.JSONDecodeError as e:
                raise ValueError(f"Prompt file {source!r} line {number} is not valid JSON ({e.msg} at column {e.colno}).") from None
            if not isinstance(record, dict):
                raise ValueError(f"Prompt file {source!r} line {number} is not a JSON object (one record per line).")


def _load_split(source: str, split: str) -> datasets.Dataset:
    ext = os.path.splitext(source)[1].lower()
    if os.path.isfile(source):
        if ext not in _FILE_BUILDERS:
            raise ValueError(f"Prompt file {source!r} has extension {ext!r}; expected one of {sorted(_FILE_BUILDERS)}.")
        _check_file(source, ext)
        try:
            return _without_progress_bars(
                lambda: datasets.load_dataset(_FILE_BUILDERS[ext], data_files={"train": source}, split="train")
            )
        except Exception as e:  # datasets names neither the file nor what is wrong with it
            cause = e.__cause__ or e
            raise ValueError(f"Could not read prompt file {source!r}: {type(cause).__name__}: {str(cause).splitlines()[0]}.") from e
    if os.path.isdir(source):
        if os.path.exists(os.path.join(source, "dataset_dict.json")):
            return datasets.load_from_disk(source)[split]
        if os.path.exists(os.path.join(source, "dataset_info.json")):
            return datasets.load_from_disk(source)
        return datasets.load_dataset(source, split=split)
    if ext in _FILE_BUILDERS:
        raise FileNotFoundError(f"Prompt file {source!r} does not exist.")
    return datasets.load_dataset(source, split=split)  # a Hub dataset id


def load_prompts(source: str, *, split: str = "train", prompt_column: str = "prompt", image_column: str = "image") -> PromptSet:
    """Load a prompt set.

    ``source`` is a ``.txt`` file (one prompt per line, blank lines skipped), a ``.jsonl`` /
    ``.json`` / ``.csv`` / ``.parquet`` file with a ``prompt_column`` field (the other fields
    become the prompt's metadata), a folder written by ``Dataset.save_to_disk``, or a Hub
    dataset id (``split`` selects the split). A record's ``image_column`` (when the set has
    one) is its conditioning image, a path relative to the file's folder, a URL or a
    ``datasets.Image``; each is checked readable here (``genrl.data.prompt_images``) and kept out of
    the metadata.
    """
    ds = _load_split(source, split)
    column = "text" if "text" in ds.column_names and prompt_column not in ds.column_names else prompt_column
    if column not in ds.column_names:
        raise ValueError(
            f"Prompt dataset {source!r} has no column {prompt_column!r}; its columns are {ds.column_names} "
            f"(choose one with --prompt_column)."
        )
    has_images = image_column in ds.column_names and image_column != column
    if has_images and isinstance(ds.features[image_column], datasets.Image):
        ds = ds.cast_column(image_column, datasets.Image(decode=False))  # bytes or path, decoded when encoded
    # Relative image paths: from the prompt file's folder, a saved dataset's folder, else the working directory.
    base_dir = os.path.dirname(os.path.abspath(source)) if os.path.isfile(source) else os.path.abspath(
        source if os.path.isdir(source) else os.curdir)
    prompts, metadata, images, dropped = [], [], [], 0
    for number, record in enumerate(ds, start=1):
        prompt = record[column]
        if prompt is not None and not isinstance(prompt, str):  # str() of it would be sampled and trained on
            raise ValueError(
                f"Prompt dataset {source!r} record {number} has a {json_type(prompt)} as its {column!r} ({prompt!r:.60}), "
                f"not text; every prompt must be a string (--prompt_column chooses the field)."
            )
        if prompt is None or not prompt.strip():
            dropped += 1
            continue
        prompts.append(prompt.strip())
        metadata.append({k: v for k, v in record.items() if k not in (column, image_column if has_images else None)})
        if has_images:
            images.append(_record_image(source, number, record[image_column], image_column, base_dir))
    if not prompts:
        raise ValueError(f"The prompt set {source!r} (split {split!r}) is empty.")
    if dropped and column != "text":  # blank lines of a text file are not records
        logger.warning(f"{dropped} of {len(ds)} records of {source!r} have no {column!r} (missing or empty) and were skipped.")
    return PromptSet(prompts, metadata, images if has_images else None)


def _record_image(source: str, number: int, value, column: str, base_dir: str) -> ImageRef:
    """Record ``number``'s conditioning image, found and checked, or one sentence naming the record."""
    if value is None or (isinstance(value, str) and not value.strip()):
        raise ValueError(
            f"Prompt dataset {source!r} record {number} has no image in its {column!r} column; every record of an "
            f"image-to-video prompt set needs one."
        )
    try:
        return resolve_image(value, base_dir)
    except ValueError as error:
        raise ValueError(f"Prompt dataset {source!r} record {number}: its image {error}.") from None


def check_conditioning(train: PromptSet, held_out: PromptSet | None, image_column: str) -> None:
    """The evaluation prompts condition as the training ones do: both with images or neither."""
    if held_out is not None and (train.images is None) != (held_out.images is None):
        which = ("training", "evaluation") if held_out.images is None else ("evaluation", "training")
        raise ValueError(
            f"The {which[0]} prompts have an image column {image_column!r} and the {which[1]} prompts do not; "
            f"an image-to-video model needs an image for every prompt, a text-to-video model none."
        )
