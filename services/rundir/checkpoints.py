"""A run's checkpoints on disk: their names, listing, verification and the trainer.json every training checkpoint
holds. Torch-free and Ray-free, so that `albert status`, schedules and the ledger read checkpoints without
loading a trainer; services.train.state writes and loads them.

    <run_dir>/checkpoints/step_00001000/   config.json, model.safetensors (the model: albert_core.model.checkpoint),
                                           optimizer.safetensors, trainer.json, MANIFEST.json (written last)
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import Any

from albert_core.files import CONFIG_FILE, WEIGHTS_FILE, CorruptCheckpoint, verify_manifest

log = logging.getLogger(__name__)

CHECKPOINTS_DIR = "checkpoints"  # under the run directory
OPTIMIZER_FILE = "optimizer.safetensors"
TRAINER_FILE = "trainer.json"
FORMAT = "albert-train-state"
VERSION = 1
REQUIRED_FILES = (CONFIG_FILE, WEIGHTS_FILE, OPTIMIZER_FILE, TRAINER_FILE)  # a training checkpoint
MODEL_FILES = (CONFIG_FILE, WEIGHTS_FILE)  # what evaluation loads
STEP_DIR = re.compile(r"^step_(\d+)$")


def checkpoint_dir(root: str | Path, step: int) -> Path:
    """`root/step_XXXXXXXX`: zero-padded so names sort by step."""
    return Path(root) / f"step_{step:08d}"


def verify(directory: str | Path) -> dict[str, Any]:
    """Check every file against MANIFEST.json; returns the manifest or raises CorruptCheckpoint naming the file."""
    return verify_manifest(directory, REQUIRED_FILES)


def list_checkpoints(root: str | Path) -> list[tuple[int, Path]]:
    """(step, path) of every `step_*` directory under root, newest first (hidden temporaries excluded)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        match = STEP_DIR.match(child.name)
        if match and child.is_dir():
            found.append((int(match.group(1)), child))
    return sorted(found, reverse=True)


def latest_good(checkpoints_root: str | Path) -> Path | None:
    """The newest checkpoint under root that verifies; damaged or partial ones are skipped with a warning."""
    for _, path in list_checkpoints(checkpoints_root):
        try:
            verify(path)
        except CorruptCheckpoint as err:
            log.warning("skipping damaged checkpoint %s: %s", path, err)
            continue
        return path
    return None


def read_trainer_json(directory: str | Path) -> dict[str, Any]:
    path = Path(directory) / TRAINER_FILE
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise CorruptCheckpoint(f"{path}: missing") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CorruptCheckpoint(f"{path}: not valid JSON ({err})") from None
    if data.get("format") != FORMAT or data.get("version") != VERSION:
        raise CorruptCheckpoint(
            f"{path}: format {data.get('format')!r} version {data.get('version')!r}, expected {FORMAT!r} {VERSION}"
        )
    return data


def verify_checkpoint(directory: str | Path) -> dict[str, Any]:
    """The checkpoint's MANIFEST.json checks out and lists the model files evaluation loads."""
    return verify_manifest(directory, MODEL_FILES)
