"""``ShardIter``: an ``mx.io.DataIter`` over a shardgen manifest, read by MXNet's native C++
``ImageRecordIter`` (``preprocess_threads`` decode threads and a ``prefetch_buffer`` of batches,
none of them holding the GIL). Records carry a pack of windows or a run of rows; a producer
thread mixes them in a shuffle buffer and cuts the caller's batches (:mod:`loader.stream`), so
``next()`` only takes a ready batch. The next epoch's stream starts before this one ends, so
``reset()`` is nearly free. Every shard is checked (:mod:`shardgen.format.check`) before MXNet reads it.

Epochs are exact: every sample of this part once, with ``pad`` counted here. The order is a
function of seed, epoch and selection alone: reproducible, and resumable from ``state_dict()``
without re-reading what was consumed.
"""

from __future__ import annotations

import dataclasses
import math
import os
import threading
import time
import weakref
from pathlib import Path
from typing import Any, Optional, Sequence

import mxnet as mx
import numpy as np

from shardgen.format.check import VERIFY_MODES
from shardgen.lease import Lease
from shardgen.manifest import ShardEntry

from .errors import LoaderError
from .generations import Choice, agreed_start
from .memory import Arena, check_footprint, footprint, parse_size, settle_allocator
from .plan import (
    DateRange,
    EpochPlan,
    default_cache_dir,
    drop,
    hold,
    load_manifest,
    make_plan,
    manifest_path_of,
    normalize_dates,
    recheck,
    select_shards,
)
from .shuffle_buffer import buffer_bytes, default_capacity
from .stream import EpochStream, StreamParams, batch_floats, buffer_capacity

__all__ = ["ShardIter", "to_datetime64"]

_STATE_VERSION = 3  # 3: parts balanced by samples, readers over exact record ranges
_LIVE: weakref.WeakSet = weakref.WeakSet()


def _close_all() -> None:
    """Stop every iterator's threads before the interpreter (and MXNet's engine) shuts down:
    native threads still running then crash the process ("pure virtual method called").
    ``loader.shutdown``'s exit hook calls it, before MXNet's own hook."""
    for it in list(_LIVE):
        it.close()


def to_datetime64(days: Any) -> np.ndarray:
    """The ``date`` label (float32 days since 1970-01-01) as ``datetime64[D]``."""
    arr = days.asnumpy() if hasattr(days, "asnumpy") else np.asarray(days)
    return arr.astype(np.int64).astype("datetime64[D]")




def _default_native_batch(pack: int) -> int:
    """Records per native batch: about 2048 samples, within [8, 256] records."""
    return max(8, min(256, math.ceil(2048 / pack)))


class _Resources:
    """What an iterator holds that must be let go even if the iterator is dropped without
    ``close()``: its streams (threads, native iterators), its plans (open files) and its lease.
    Threads reference this, never the iterator, so garbage collection can release it."""

    def __init__(self, lease: Lease):
        self.lease = lease
        self.stream: Optional[EpochStream] = None
        self.ahead: Optional[EpochStream] = None
        self.plan: Optional[EpochPlan] = None
        self.arena: Optional[Arena] = None
        self.lock = threading.Lock()

    def close_streams(self) -> None:
        for name in ("stream", "ahead"):
            stream = getattr(self, name)
            setattr(self, name, None)
            if stream is not None:
                stream.close()

    def close(self) -> None:
        with self.lock:
            self.close_streams()
            if self.plan is not None:
                drop(self.plan)
                self.plan = None
            self.lease.release()


class ShardIter(mx.io.DataIter):
    """Batches of a shard store: ``data = [x (B, T, C)]``, ``label = [each label..., date]``.

    ``verify``: ``"frame"`` (default) checks every record's framing before MXNet reads it,
    ``"sha256"`` also checks content against the manifest, ``"none"`` trusts the files.
    ``readers``: native iterators per part (each with its own I/O thread). ``shuffle_buffer``:
    what is held for mixing, as a number of *records* (an int) or a size in bytes (a string such as
    ``"256MB"`` or ``"1GiB"``; default 128 MB). ``native_batch``: records per native batch.
    ``prefetch_buffer``: caller batches assembled ahead. What these hold in memory is computed at
    construction (:mod:`loader.memory`); more than half the machine's memory is a LoaderError.
    """

    def __init__(self, manifest: os.PathLike | str, batch_size: int, *, shuffle: bool = True, seed: int = 0,
                 preprocess_threads: int = 4, prefetch_buffer: int = 4, num_parts: int = 1,
                 part_index: int = 0, last_batch: str = "pad", dates: DateRange = None,
                 label_names: Optional[Sequence[str]] = None, cache_dir: Optional[os.PathLike] = None,
                 verify: str = "frame", readers: int = 2, shuffle_buffer: Optional[int | str] = None,
                 native_batch: Optional[int] = None, generation: Optional[int] = None):
        for name, value, low in (("batch_size", batch_size, 1), ("num_parts", num_parts, 1),
                                 ("preprocess_threads", preprocess_threads, 1),
                                 ("prefetch_buffer", prefetch_buffer, 1), ("readers", readers, 1),
                                 ("native_batch", 1 if native_batch is None else native_batch, 1)):
            if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < low:
                raise LoaderError(f"{name} must be an integer >= {low}, got {value!r}")
        if not isinstance(part_index, (int, np.integer)) or not 0 <= part_index < num_parts:
            raise LoaderError(f"part_index must be in [0, {num_parts}), got {part_index!r}")
        if last_batch not in ("pad", "discard"):
            raise LoaderError(f"last_batch must be 'pad' or 'discard', got {last_batch!r}")
        if not isinstance(seed, (int, np.integer)) or not 0 <= seed < 2**31:
            raise LoaderError(f"seed must be an integer in [0, 2^31), got {seed!r}")
        if verify not in VERIFY_MODES:
            raise LoaderError(f"verify must be one of {', '.join(VERIFY_MODES)}, got {verify!r}")
        super().__init__(int(batch_size))
        self.manifest_path = manifest_path_of(Path(manifest))
        self.shuffle, self.seed = bool(shuffle), int(seed)
        self.preprocess_threads, self.prefetch_buffer = int(preprocess_threads), int(prefetch_buffer)
        self.num_parts, self.part_index, self.last_batch = int(num_parts), int(part_index), last_batch
        self.verify = verify
        self._dates = normalize_dates(dates)
        self.cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
        self.epoch = 0
        self.history: list[dict] = []
        self._closed = False
        self._res = _Resources(Lease(self.manifest_path.parent))  # tells gc which generation we read
        self._finalizer = weakref.finalize(self, self._res.close)
        self._choice = Choice(pin=generation)
        manifest_obj = self._choice.manifest(self.manifest_path)
        self.schema = manifest_obj.schema
        known = [lab.name for lab in self.schema.labels]
        self.label_names = tuple(known if label_names is None else label_names)
        unknown = [n for n in self.label_names if n not in known]
        if unknown or not self.label_names:
            raise LoaderError(f"label_names {list(self.label_names)!r}: choose among {known}")
        nb = int(native_batch) if native_batch is not None else _default_native_batch(self.schema.pack)
        if shuffle_buffer is None:
            buffer = default_capacity(self.schema, nb)
        else:
            unit, amount = parse_size(shuffle_buffer)
            buffer = amount if unit == "records" else max(1, amount // buffer_bytes(self.schema, 1))
        self._params = StreamParams(
            schema=self.schema, batch_size=self.batch_size, shuffle=self.shuffle, seed=self.seed,
            num_parts=self.num_parts, part_index=self.part_index, last_batch=last_batch, readers=int(readers),
            native_batch=nb, buffer_records=buffer,
            preprocess_threads=self.preprocess_threads, prefetch_buffer=self.prefetch_buffer,
            label_names=tuple(lab.name for lab in self._labels))
        self.memory = self._check_memory(self._params, shuffle_buffer)
        settle_allocator()
        # Batch buffers: the caller's queue and a few held by MXNet, for this and the next epoch's stream.
        self._res.arena = Arena(self.schema, batch_floats(self._params), keep=2 * (self.prefetch_buffer + 4))
        self._describe()
        self._start_epoch(self._plan_for(manifest_obj, select_shards(manifest_obj, self.dates)))
        _LIVE.add(self)

    @classmethod
    def for_kvstore(cls, kv: Any, manifest: os.PathLike | str, batch_size: int, **kwargs: Any) -> ShardIter:
        """One part per worker of a (distributed) kvstore: ``num_parts = kv.num_workers``, ``part_index = kv.rank``.
        The workers agree on the generation (rank 0's newest) through ``kv`` at construction and at
        every ``reset()``; ``generation=N`` pins one instead."""
        if kwargs.get("generation") is not None:
            return cls(manifest, batch_size, num_parts=kv.num_workers, part_index=kv.rank, **kwargs)
        kwargs.pop("generation", None)
        with agreed_start(kv, manifest) as generation:
            it = cls(manifest, batch_size, num_parts=kv.num_workers, part_index=kv.rank, generation=generation,
                     **kwargs)
        it._choice = Choice(kv=kv)
        return it

    # -- the contract ---------------------------------------------------------------------------

    @property
    def provide_data(self) -> list:
        return list(self._provide_data)

    @property
    def provide_label(self) -> list:
        return list(self._provide_label)

    def _describe(self) -> None:
        s, b = self.schema, self.batch_size
        self._provide_data = [mx.io.DataDesc(s.data_name, (b, s.time_steps, s.num_inputs), layout="NTC")]
        self._provide_label = [mx.io.DataDesc(lab.name, (b,), layout="N") if lab.width == 1
                               else mx.io.DataDesc(lab.name, (b, lab.width), layout="NC")
                               for lab in self._labels]

    @property
    def _labels(self) -> list:
        return [lab for lab in self.schema.labels if lab.name in self.label_names]

    @property
    def dates(self) -> Optional[tuple]:
        """The ``(start, end)`` date selection; setting it takes effect at the next ``reset()``."""
        return self._dates

    @dates.setter
    def dates(self, value: DateRange) -> None:
        self._dates = normalize_dates(value)

    @property
    def plan(self) -> EpochPlan:
        return self._res.plan

    @property
    def generation(self) -> int:
        return self.plan.generation

    @property
    def batches_per_epoch(self) -> int:
        return self._batches

    @property
    def records_per_epoch(self) -> int:
        """Real (not padding) samples this part yields per epoch."""
        return self._part_samples if self.last_batch == "pad" else self._batches * self.batch_size

    @property
    def readers(self) -> int:
        """Native iterators reading this part (fewer than asked when the plan is small)."""
        return self._res.stream.readers if self._res.stream else 0

    def reset(self) -> None:
        """Start the next epoch on the newest manifest generation."""
        self._check_open()
        self._close_epoch()
        manifest = self._choice.manifest(self.manifest_path)
        if manifest.schema.fingerprint != self.schema.fingerprint:
            raise LoaderError(f"{self.manifest_path}: the store's schema changed (fingerprint "
                              f"{self.schema.fingerprint} -> {manifest.schema.fingerprint}); make a new ShardIter")
        shards = select_shards(manifest, self.dates)
        if shards != self.plan.shards:
            plan = self._plan_for(manifest, shards)
        elif manifest.generation != self.plan.generation:  # same files: only the generation moves on
            plan = dataclasses.replace(self.plan, generation=manifest.generation)
        else:
            plan = self.plan
        if plan.folder == self.plan.folder:
            recheck(plan, self.schema, self.verify)
        self._start_epoch(plan, epoch=self.epoch + 1)

    def next(self) -> mx.io.DataBatch:
        t0 = time.perf_counter()
        if self._epoch_t0 is None:
            self._epoch_t0 = t0
        if self._cursor >= self._batches:
            raise StopIteration
        self._check_open()
        res = self._res
        if res.stream is None:
            raise LoaderError(f"{self.manifest_path}: no epoch to read: the last reset() failed; fix the cause "
                              "(e.g. the date selection) and call reset() again")
        arrays, valid = res.stream.get()
        self._cursor += 1
        if res.ahead is None and self._cursor >= self._ahead_at:
            self._open_ahead()
        pad = self.batch_size - valid if self.last_batch == "pad" else 0
        self._samples += valid if self.last_batch == "pad" else self.batch_size
        t1 = time.perf_counter()
        self._blocked += t1 - t0
        self._epoch_t1 = t1
        return mx.io.DataBatch(data=arrays[:1], label=arrays[1:], pad=pad,
                               provide_data=self._provide_data, provide_label=self._provide_label)

    def iter_next(self) -> bool:  # what PrefetchingIter and friends call
        try:
            self._pending = self.next()
        except StopIteration:
            return False
        return True

    def getdata(self) -> list:
        return self._pending.data

    def getlabel(self) -> list:
        return self._pending.label

    def getpad(self) -> int:
        return self._pending.pad

    def getindex(self) -> None:
        return None

    # -- statistics -----------------------------------------------------------------------------

    @property
    def stats(self) -> dict:
        """This epoch so far: samples/s, payload MB/s and the data-stall fraction."""
        wall = (self._epoch_t1 or 0) - (self._epoch_t0 or 0)
        payload = self._samples * (self.schema.x_floats + self.schema.label_floats + 1) * 4
        return {
            "epoch": self.epoch,
            "generation": self.plan.generation,
            "batches": self._cursor,
            "samples": self._samples,
            "seconds": wall,
            "samples_per_s": self._samples / wall if wall > 0 else 0.0,
            "payload_mb_per_s": payload / wall / 1e6 if wall > 0 else 0.0,
            "stall_fraction": self._blocked / wall if wall > 0 else 0.0,
        }

    # -- resumption -----------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """Where this iterator is: enough to continue the same epoch in a new process."""
        return {
            "version": _STATE_VERSION,
            "manifest": str(self.manifest_path),
            "generation": self.plan.generation,
            "fingerprint": self.plan.fingerprint,
            "shards": [s.to_json() for s in self.plan.shards],
            "dates": list(self.dates) if self.dates else None,
            "epoch": self.epoch,
            "seed": self.seed,
            "batches": self._cursor,
            "batch_size": self.batch_size,
            "num_parts": self.num_parts,
            "part_index": self.part_index,
            "shuffle": self.shuffle,
            "last_batch": self.last_batch,
            "readers": self._params.readers,
            "native_batch": self._params.native_batch,
            "shuffle_buffer": self._params.buffer_records,
            "pinned": self._choice.pin,
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue from ``state``: same shards, same epoch order, the same remaining batches. The
        consumed batches are not assembled again: the stream passes over them."""
        version = state.get("version")
        if version == 2 and state.get("batches"):
            raise LoaderError(f"state_dict version 2 was saved mid-epoch by a loader that split parts and readers "
                              f"by records: this one cannot continue that order; resume from the start of epoch "
                              f"{state.get('epoch')} (set 'batches' to 0) or of the next one")
        if version not in (2, _STATE_VERSION):
            raise LoaderError(f"state_dict version {version!r}, expected {_STATE_VERSION}")
        for key in ("batch_size", "num_parts", "part_index", "shuffle", "last_batch", "seed"):
            if state[key] != getattr(self, key):
                raise LoaderError(f"state_dict was saved with {key}={state[key]!r}, this iterator has "
                                  f"{getattr(self, key)!r}")
        if state["fingerprint"] != self.schema.fingerprint:
            raise LoaderError("state_dict was saved for another schema")
        self._check_open()
        self._dates = normalize_dates(state.get("dates"))  # the saved selection, from the next reset() on
        shards = tuple(ShardEntry.from_json(s) for s in state["shards"])
        same = (shards == self.plan.shards and int(state["epoch"]) == self.epoch and self._cursor == 0
                and state["generation"] == self.plan.generation and state.get("pinned") == self._choice.pin
                and (state["readers"], state["native_batch"], state["shuffle_buffer"])
                == (self._params.readers, self._params.native_batch, self._params.buffer_records))
        if same and self._res.stream is not None:  # the stream this epoch already started: skip ahead in it
            self._res.stream.skip_to(int(state["batches"]))
            self._cursor = int(state["batches"])
            self._ahead_at = max(self._cursor, self._ahead_at)
            return
        params = dataclasses.replace(self._params, readers=int(state["readers"]),
                                     native_batch=int(state["native_batch"]),
                                     buffer_records=int(state["shuffle_buffer"]))
        self.memory = self._check_memory(params, int(state["shuffle_buffer"]))
        self._close_epoch()
        if state.get("pinned") is not None:
            self._choice = Choice(pin=state["pinned"])
        self._params = params
        manifest = load_manifest(self.manifest_path)
        plan = self.plan if shards == self.plan.shards else self._plan_for(manifest, shards)
        plan = dataclasses.replace(plan, generation=state["generation"])
        self._start_epoch(plan, skip=int(state["batches"]), epoch=int(state["epoch"]))

    # -- internals ------------------------------------------------------------------------------

    def _check_memory(self, params: StreamParams, shuffle_buffer: object) -> dict:
        """What ``params`` would hold (``loader.memory``); LoaderError before anything is allocated
        if that is more than the machine can spare."""
        records = buffer_capacity(params)
        held = footprint(self.schema, buffer_records=records, native_batch=params.native_batch,
                         readers=params.readers, prefetch_buffer=params.prefetch_buffer,
                         batch_floats=batch_floats(params))
        check_footprint(held, f"shuffle_buffer={shuffle_buffer!r} ({records:,} records), "
                              f"native_batch={params.native_batch}, readers={params.readers}, "
                              f"prefetch_buffer={params.prefetch_buffer}, batch_size={params.batch_size}")
        return held

    def _check_open(self) -> None:
        if self._closed:
            raise LoaderError(f"{self.manifest_path}: this ShardIter is closed")

    def _plan_for(self, manifest: Any, shards: tuple) -> EpochPlan:
        return make_plan(self.manifest_path, manifest, shards, self.cache_dir, verify=self.verify)

    def _start_epoch(self, plan: EpochPlan, *, skip: int = 0, epoch: Optional[int] = None) -> None:
        """Make ``plan`` this iterator's, reading ``epoch`` (default: the current one). Nothing
        changes if the epoch cannot start (e.g. a part smaller than a batch): the error is raised
        and the plan's files are let go."""
        epoch = self.epoch if epoch is None else epoch
        res = self._res
        with res.lock:
            previous = res.plan
            ahead, res.ahead = res.ahead, None
            if ahead is not None and (ahead.plan.folder != plan.folder or ahead.epoch != epoch or skip):
                ahead.close()  # reads files of the old plan: gone before its files are let go
                ahead = None
            try:
                stream = ahead if ahead is not None else EpochStream(plan, epoch, self._params, res.arena, skip=skip)
            except BaseException:
                if plan.files is not None and (previous is None or previous.folder != plan.folder):
                    plan.files.close()
                raise
            if previous is None or previous.folder != plan.folder:
                hold(plan)
            res.plan = plan
            if previous is not None and previous.folder != plan.folder:
                drop(previous)
            res.lease.renew(plan.generation)
            res.stream = stream
        self.epoch = epoch
        self._part_samples, self._batches = stream.samples, stream.batches
        self._cursor, self._samples, self._blocked = skip, 0, 0.0
        self._epoch_t0 = self._epoch_t1 = None
        # The next epoch's stream starts half way through this one: its buffer fills (and its native
        # iterators open) while this epoch's batches are consumed.
        self._ahead_at = max(skip, self._batches // 2)
        if self._cursor >= self._ahead_at:
            self._open_ahead()

    def _open_ahead(self) -> None:
        """The next epoch's stream, on this plan, starts filling while this epoch ends (a new
        generation at ``reset()`` discards it)."""
        res = self._res
        if res.ahead is None and res.plan is not None:
            try:
                res.ahead = EpochStream(res.plan, self.epoch + 1, self._params, res.arena)
            except LoaderError:
                res.ahead = None

    def _close_epoch(self) -> None:
        res = self._res
        if res.stream is not None:
            if self._cursor:
                self.history.append(self.stats)
            stream, res.stream = res.stream, None
            stream.close()

    def close(self) -> None:
        """Stop the native threads, let go of the files and drop the reader lease now rather than
        at garbage collection. Safe to call more than once, and after an error."""
        if self._closed:
            return
        self._closed = True
        res = getattr(self, "_res", None)
        if res is not None:
            if getattr(self, "_cursor", 0) and res.stream is not None:
                self.history.append(self.stats)
            res.close()

    def __enter__(self) -> ShardIter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
