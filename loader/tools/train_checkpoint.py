"""The example trainer's checkpoint folder (``--stop-after N --checkpoint DIR``, ``--resume DIR``):
the iterator's ``state_dict()`` (``state.json``) and the network's parameters (``net.params``)."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import mxnet as mx

from loader.errors import LoaderError
from loader.shard_iter import ShardIter

__all__ = ["CHECKPOINT_FILES", "save_checkpoint", "load_checkpoint"]

CHECKPOINT_FILES = ("state.json", "net.params")


def _drop_checkpoint(folder: Path) -> None:
    """A checkpoint folder's files and the folder (anything else in it stays, and so does the folder)."""
    for name in CHECKPOINT_FILES:
        (folder / name).unlink(missing_ok=True)
    with contextlib.suppress(OSError):
        folder.rmdir()


def save_checkpoint(folder: Path, it: ShardIter, net) -> None:
    """Rank 0's checkpoint: written whole into ``<folder>.tmp``, then renamed into place (an
    earlier one there is replaced only then). Not the optimizer state: under a dist kvstore the
    servers hold it, and MXNet cannot save it ("Cannot save states for distributed training")."""
    mx.nd.waitall()
    tmp, old = folder.with_name(folder.name + ".tmp"), folder.with_name(folder.name + ".old")
    _drop_checkpoint(tmp)
    tmp.mkdir(parents=True)
    (tmp / "state.json").write_text(json.dumps({"iterator": it.state_dict()}))
    net.save_parameters(str(tmp / "net.params"))
    if folder.is_dir():
        _drop_checkpoint(old)
        folder.replace(old)
    tmp.replace(folder)
    _drop_checkpoint(old)


def load_checkpoint(folder: Path, it: ShardIter, net) -> int:
    """Every worker: the checkpoint's parameters and iterator state; the epoch it stopped in."""
    missing = [name for name in CHECKPOINT_FILES if not (folder / name).is_file()]
    if missing:
        raise LoaderError(f"--resume {folder}: not a checkpoint of this tool (missing {', '.join(missing)})")
    state = json.loads((folder / "state.json").read_text())["iterator"]
    net.load_parameters(str(folder / "net.params"), ctx=net.collect_params().list_ctx())
    it.load_state_dict(state)
    return int(state["epoch"])
