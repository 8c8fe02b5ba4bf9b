"""``ShardIter`` with ``producer="process"``: the trainer's side of the producer
process (:mod:`loader.producer`), which does all of an iterator's reading, shuffling and batch
assembly. The trainer's ``next()`` only waits on a socket (the GIL released), maps a shared-memory
slot and lends it to MXNet without a copy: tens of microseconds of Python, and none of the producer's
work competes with the training loop for this process's GIL.

The iterator behaves as the in-process one (``producer="thread"``) does; its epochs, order,
resumption, generations and errors are that one's, run in the producer process.
"""

from __future__ import annotations

import inspect
import os
import weakref
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import mxnet as mx

from shardgen.format.schema import Schema

from . import lifecycle
from .errors import LoaderError
from .generations import Choice
from .objcache import resolve
from .plan import default_cache_dir
from .selection import load_manifest, manifest_path_of, normalize_dates
from .session import Session
from .settings import check_arguments
from .shard_iter import ShardIter

__all__ = ["ProcessShardIter", "START_TIMEOUT_S"]

EPOCH_COMMANDS = ("init", "reset", "load", "close")

START_TIMEOUT_S = 120.0  # the producer process's start (it imports MXNet) and an iterator's first epoch
CLOSE_TIMEOUT_S = 5.0  # close() waits this long for the producer to close the session, then lets go


class ProcessShardIter(ShardIter):
    """A ``ShardIter`` whose work runs in the producer process; see the module docstring."""

    def __init__(self, manifest: os.PathLike | str, batch_size: int, *, producer: str = "process", **kwargs: Any):
        # The in-process signature, defaults included: a TypeError as in-process, one set of defaults.
        bound = inspect.signature(ShardIter.__init__).bind(self, manifest, batch_size, **kwargs)
        bound.apply_defaults()
        a = bound.arguments
        check_arguments(batch_size=batch_size, num_parts=a["num_parts"], part_index=a["part_index"],
                        preprocess_threads=a["preprocess_threads"], prefetch_buffer=a["prefetch_buffer"],
                        readers=a["readers"], native_batch=a["native_batch"], last_batch=a["last_batch"],
                        seed=a["seed"], verify=a["verify"])
        mx.io.DataIter.__init__(self, int(batch_size))
        self.manifest_path = manifest_path_of(resolve(manifest, bound.arguments.get("cache_dir"),
                                                      bound.arguments.get("cache_limit")))
        load_manifest(self.manifest_path)  # a missing or bad manifest: said at once, before the producer starts
        self.shuffle, self.seed = bool(a["shuffle"]), int(a["seed"])
        self.preprocess_threads, self.prefetch_buffer = int(a["preprocess_threads"]), int(a["prefetch_buffer"])
        self.num_parts, self.part_index = int(a["num_parts"]), int(a["part_index"])
        self.last_batch, self.verify = a["last_batch"], a["verify"]
        self._dates = normalize_dates(a["dates"])
        self.cache_dir = Path(a["cache_dir"]) if a["cache_dir"] is not None else default_cache_dir()
        self.epoch, self.history, self._closed = 0, [], False
        self._choice = Choice(pin=a["generation"])
        self._error = None
        self._ack_every = max(1, (self.prefetch_buffer + 1) // 2)
        self._session = Session(self.manifest_path)
        self._finalizer = weakref.finalize(self, self._session.close, CLOSE_TIMEOUT_S)
        try:
            info = self._call("init", (str(manifest), batch_size), kwargs, timeout=START_TIMEOUT_S)
        except BaseException:
            self.close()
            raise
        self.schema = Schema.from_json(info["schema"])
        self.label_names = tuple(info["label_names"])
        self.memory = info["memory"]
        self._describe()
        self._start(info)
        lifecycle.track(self)

    # -- messages -------------------------------------------------------------------------------

    def _call(self, kind: str, *args: Any, timeout: float = START_TIMEOUT_S) -> Any:
        """A command to the producer. One interrupted before its answer (Ctrl-C, a timeout) leaves
        the two sides apart: every later ``next()`` says so until a ``reset()`` succeeds."""
        try:
            return self._session.call(kind, *args, timeout=timeout)
        except LoaderError as exc:
            if self._session.gone is not None or "did not answer" in str(exc):
                self._error = LoaderError(f"{exc}; this iterator cannot go on: make a new ShardIter"
                                          if self._session.gone is not None else f"{exc}; call reset()")
            raise
        except BaseException:
            self._error = LoaderError(f"{self.manifest_path}: {kind}() was interrupted before the producer "
                                      "answered; call reset() to start a clean epoch")
            raise

    # -- epochs ---------------------------------------------------------------------------------

    def _start(self, info: dict) -> None:
        self.epoch, self._batches = info["epoch"], info["batches"]
        self._part_samples, self._readers = info["records"], info["readers"]
        self._plan = SimpleNamespace(**info["plan"])
        self._epoch_state = info["state"]
        self._cursor, self._samples, self._blocked = info["cursor"], 0, 0.0
        self._epoch_t0 = self._epoch_t1 = None
        self._error = None

    @property
    def plan(self) -> Any:
        return self._plan

    @property
    def readers(self) -> int:
        return self._readers

    @ShardIter.dates.setter
    def dates(self, value: Any) -> None:
        self._check_open()
        dates = normalize_dates(value)
        self._call("dates", dates)
        self._dates = dates

    def reset(self) -> None:
        self._check_open()
        self._close_epoch()
        try:
            generation = self._choice.manifest(self.manifest_path).generation if self._choice.kv is not None else None
            info = self._call("reset", generation)
        except LoaderError:
            self._cursor, self._batches = 0, max(1, self._batches)
            if self._session.gone is None:
                self._error = LoaderError(f"{self.manifest_path}: no epoch to read: the last reset() failed; fix the "
                                          "cause (e.g. the date selection) and call reset() again")
            raise
        except BaseException:
            self._cursor, self._batches = 0, max(1, self._batches)
            raise
        self._start(info)

    def _take(self) -> tuple[list, int]:
        if self._error is not None:
            raise self._error
        item = self._session.take(self._cursor, self._ack_every)
        if item[0] == "error":
            self._error = LoaderError(item[1])
            raise self._error
        return item[1], item[2]

    # -- resumption -----------------------------------------------------------------------------

    def state_dict(self) -> dict:
        state = dict(self._epoch_state)
        state.update(batches=self._cursor, pinned=self._choice.pin, dates=list(self.dates) if self.dates else None)
        return state

    def load_state_dict(self, state: dict) -> None:
        from .checkpoint import check_state

        check_state(self, state)
        self._check_open()
        info = self._call("load", state)
        self._dates = normalize_dates(state.get("dates"))
        if state.get("pinned") is not None:
            self._choice = Choice(pin=state["pinned"])
        self._start(info)

    # -- the end --------------------------------------------------------------------------------

    def _close_epoch(self) -> None:
        if self._cursor:
            self.history.append(self.stats)

    def _epoch_running(self) -> bool:
        return True

    def _release(self) -> None:
        if getattr(self, "_session", None) is not None:
            self._finalizer()
