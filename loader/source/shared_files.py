"""Kept files (no bound on the cache) open in this process, shared by the plans that read them
(:class:`loader.source.files.PlanFiles`): a new generation's plan opens, checks and links only its
new shards (400 shards: 53 ms of opens, checks and links in the caller's reset() before).

``_HELD``: key -> ``[fd, frames, link, identity, plans holding it]``. ``_HELD_LOCK`` guards it, and
every link folder is made and removed under it (a folder emptied in another thread is removed), and
so is this process's folder (``FOLDERS``: a plan's folder made in it while another thread removes
it, empty, failed with FileExistsError or FileNotFoundError)."""

from __future__ import annotations

import contextlib
import os
import shutil
import threading
from typing import Optional

__all__ = ["FOLDERS", "adopt", "found_good", "make_link", "drop", "release"]

_HELD: dict = {}
_HELD_LOCK = threading.Lock()
FOLDERS = _HELD_LOCK  # this process's folder and its link folders are made and removed under it


def adopt(key: Optional[tuple]) -> Optional[tuple]:
    """``(fd, frames, link, identity)`` of the file ``key`` names if a plan of this process holds it
    open (one more hold taken), else None."""
    if key is None:
        return None
    with _HELD_LOCK:
        held = _HELD.get(key)
        if held is None:
            return None
        held[4] += 1
        return tuple(held[:4])


def found_good(key: tuple, seen: tuple) -> tuple:
    """The shared file ``key`` was found good as it was at ``seen`` (its ``identity``)."""
    with _HELD_LOCK:
        _HELD[key][3] = seen
    return seen


def make_link(link: str, target: str, key: Optional[tuple], held: tuple) -> bool:
    """``<link>/s.rec`` made anew, pointing at ``target``; with a ``key``, the file ``held``
    (``(fd, frames, link, identity)``) is shared from now on, held by one plan (True). False: not
    shared, the opener's own, when another plan of this process shared its copy since the opener
    looked (``adopt``): replacing that entry made each plan's release count the other's holds, and
    one plan's close closed the other's descriptor under its reads."""
    with _HELD_LOCK:
        with contextlib.suppress(FileNotFoundError):
            shutil.rmtree(link)
        os.makedirs(link)
        os.symlink(target, f"{link}/s.rec")
        if key is None or key in _HELD:
            return False
        _HELD[key] = [*held, 1]
        return True


def drop(fd: int, key: Optional[tuple], link: Optional[str]) -> None:
    """A plan lets go of a file: closed at once if not shared (``key`` None), else one hold released."""
    if key is None:
        _close(fd, link)
    else:
        release(key)


def release(key: tuple) -> None:
    """One hold of the shared file ``key`` let go: closed with its link once no plan holds it."""
    with _HELD_LOCK:
        held = _HELD[key]
        held[4] -= 1
        if held[4] > 0:
            return
        del _HELD[key]
    _close(held[0], held[2])


def _close(fd: int, link: Optional[str]) -> None:
    """Close a shard file and remove its link, and the link folder once empty."""
    with _HELD_LOCK:
        if link is not None:
            shutil.rmtree(link, ignore_errors=True)
            with contextlib.suppress(OSError):
                os.rmdir(os.path.dirname(link))  # fails while other links are in it
                os.rmdir(os.path.dirname(os.path.dirname(link)))  # this process's folder, once it holds no plan
        with contextlib.suppress(OSError):
            os.close(fd)
