"""``ShardIter``: an ``mx.io.DataIter`` over a shardgen manifest, read by MXNet's native C++
``ImageRecordIter`` (``preprocess_threads`` decode threads and a ``prefetch_buffer`` of batches,
none of them holding the GIL). Python does no per-record work: per batch, a producer thread splits
the header-label payload into the named arrays of the schema, ``prefetch_buffer`` batches ahead,
so the caller's ``next()`` only takes a ready batch. The next epoch's native iterator is opened in
the background while the current epoch runs, so ``reset()`` is nearly free.

Epochs are exact: every record of this part once, whatever MXNet's ``round_batch`` does (it is
wrong in 1.9.1), with ``pad`` counted here. Each epoch gets a fresh native iterator seeded from
``(seed, epoch)``, so the order is a function of seed, epoch and selection alone: reproducible,
and resumable from ``state_dict()``.
"""

from __future__ import annotations

import atexit
import dataclasses
import math
import os
import queue
import threading
import time
import weakref
from pathlib import Path
from typing import Any, Optional, Sequence

import mxnet as mx
import numpy as np

from shardgen.lease import Lease
from shardgen.manifest import ShardEntry

from .errors import LoaderError
from .generations import Choice, agreed_start
from .native import Ahead, epoch_seed, next_label, open_record_iter
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
    part_sizes,
    select_shards,
)

__all__ = ["ShardIter", "to_datetime64"]

_STATE_VERSION = 1
_LIVE: weakref.WeakSet = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    """Stop every iterator's threads before the interpreter (and MXNet's engine) shuts down:
    native threads still running then crash the process ("pure virtual method called"). MXNet
    registers its own exit hook at import, earlier, so this one runs first."""
    for it in list(_LIVE):
        it.close()


def to_datetime64(days: Any) -> np.ndarray:
    """The ``date`` label (float32 days since 1970-01-01) as ``datetime64[D]``."""
    arr = days.asnumpy() if hasattr(days, "asnumpy") else np.asarray(days)
    return arr.astype(np.int64).astype("datetime64[D]")


class ShardIter(mx.io.DataIter):
    """Batches of a shard store: ``data = [x (B, T, C)]``, ``label = [each label..., date]``."""

    def __init__(self, manifest: os.PathLike | str, batch_size: int, *, shuffle: bool = True, seed: int = 0,
                 preprocess_threads: int = 4, prefetch_buffer: int = 4, num_parts: int = 1,
                 part_index: int = 0, last_batch: str = "pad", dates: DateRange = None,
                 label_names: Optional[Sequence[str]] = None, cache_dir: Optional[os.PathLike] = None,
                 generation: Optional[int] = None):
        for name, value, low in (("batch_size", batch_size, 1), ("num_parts", num_parts, 1),
                                 ("preprocess_threads", preprocess_threads, 1),
                                 ("prefetch_buffer", prefetch_buffer, 1)):
            if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < low:
                raise LoaderError(f"{name} must be an integer >= {low}, got {value!r}")
        if not isinstance(part_index, (int, np.integer)) or not 0 <= part_index < num_parts:
            raise LoaderError(f"part_index must be in [0, {num_parts}), got {part_index!r}")
        if last_batch not in ("pad", "discard"):
            raise LoaderError(f"last_batch must be 'pad' or 'discard', got {last_batch!r}")
        if not isinstance(seed, (int, np.integer)) or not 0 <= seed < 2**31:
            raise LoaderError(f"seed must be an integer in [0, 2^31), got {seed!r}")
        super().__init__(int(batch_size))
        self.manifest_path = manifest_path_of(Path(manifest))
        self.shuffle, self.seed = bool(shuffle), int(seed)
        self.preprocess_threads, self.prefetch_buffer = int(preprocess_threads), int(prefetch_buffer)
        self.num_parts, self.part_index, self.last_batch = int(num_parts), int(part_index), last_batch
        self._dates = normalize_dates(dates)
        self.cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
        self.epoch = 0
        self.history: list[dict] = []
        self._native: Optional[mx.io.DataIter] = None
        self._lease = Lease(self.manifest_path.parent)  # tells gc which generation we read, until close()
        self._choice = Choice(pin=generation)  # generation=N: every epoch reads generation N exactly
        manifest_obj = self._choice.manifest(self.manifest_path)
        self.schema = manifest_obj.schema
        known = [lab.name for lab in self.schema.labels]
        self.label_names = tuple(known if label_names is None else label_names)
        unknown = [n for n in self.label_names if n not in known]
        if unknown or not self.label_names:
            raise LoaderError(f"label_names {list(self.label_names)!r}: choose among {known}")
        self._describe()
        self._ahead: Optional[Ahead] = None  # the next epoch's native iterator, opening in the background
        self._producer: Optional[threading.Thread] = None
        self._closed = False
        self._start_epoch(make_plan(self.manifest_path, manifest_obj, select_shards(manifest_obj, self.dates),
                                    self.cache_dir))
        _LIVE.add(self)

    @classmethod
    def for_kvstore(cls, kv: Any, manifest: os.PathLike | str, batch_size: int, **kwargs: Any) -> ShardIter:
        """One part per worker of a (distributed) kvstore: ``num_parts = kv.num_workers``, ``part_index = kv.rank``.
        Every worker reads the generation rank 0 picks, here and at every ``reset()`` (see
        ``loader.generations``); ``generation=N`` pins one instead."""
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
    def generation(self) -> int:
        return self.plan.generation

    @property
    def batches_per_epoch(self) -> int:
        return self._batches

    @property
    def records_per_epoch(self) -> int:
        """Real (not padding) records this part yields per epoch."""
        return self._part_records if self.last_batch == "pad" else self._batches * self.batch_size

    def reset(self) -> None:
        """Start the next epoch on the newest manifest generation (or the pinned or agreed one)."""
        self._close_epoch()
        manifest = self._choice.manifest(self.manifest_path)
        if manifest.schema.fingerprint != self.schema.fingerprint:
            raise LoaderError(f"{self.manifest_path}: the store's schema changed (fingerprint "
                              f"{self.schema.fingerprint} -> {manifest.schema.fingerprint}); make a new ShardIter")
        shards = select_shards(manifest, self.dates)
        if shards != self.plan.shards:
            plan = make_plan(self.manifest_path, manifest, shards, self.cache_dir)
        elif manifest.generation != self.plan.generation:  # same files: only the generation moves on
            plan = dataclasses.replace(self.plan, generation=manifest.generation)
        else:
            plan = self.plan
        self.epoch += 1
        self._start_epoch(plan, self._take_ahead(plan, self.epoch))

    def next(self) -> mx.io.DataBatch:
        t0 = time.perf_counter()
        if self._epoch_t0 is None:
            self._epoch_t0 = t0
        if self._cursor >= self._batches:
            raise StopIteration
        if self._producer is None:
            self._start_producer()
        item = self._queue.get()
        if isinstance(item, BaseException):
            self._stop_producer()
            raise item
        arrays, valid = item
        self._cursor += 1
        pad = self.batch_size - valid if self.last_batch == "pad" else 0
        self._samples += valid if self.last_batch == "pad" else self.batch_size
        t1 = time.perf_counter()
        self._blocked += t1 - t0
        self._epoch_t1 = t1
        return mx.io.DataBatch(data=arrays[:1], label=arrays[1:], pad=pad,
                               provide_data=self._provide_data, provide_label=self._provide_label)

    # -- the producer: per-batch Python work off the caller's thread ----------------------------

    def _start_producer(self) -> None:
        """One thread pulls native batches and splits them, ``prefetch_buffer`` batches ahead: the
        caller's ``next()`` only takes a ready batch, and this work runs while the caller waits on
        its own step (which releases the GIL)."""
        self._queue = queue.Queue(maxsize=self.prefetch_buffer)
        self._halt = threading.Event()
        first, stop, q, halt = self._cursor, self._batches, self._queue, self._halt

        def offer(item: object) -> bool:
            """Hand an item over unless told to halt (never blocks a reset() or close())."""
            while not halt.is_set():
                try:
                    q.put(item, timeout=0.1)
                    return True
                except queue.Full:
                    continue
            return False

        def produce() -> None:
            try:
                for index in range(first, stop):
                    if not offer(self._fetch(index)):
                        return
            except BaseException as exc:  # handed to the caller's next()
                offer(exc)

        self._producer = threading.Thread(target=produce, name="shardgen-batches", daemon=True)
        self._producer.start()

    def _stop_producer(self) -> None:
        if self._producer is not None:
            self._halt.set()
            self._producer.join()
            self._producer = None

    def _fetch(self, index: int) -> tuple[list, int]:
        """Batch ``index`` of this epoch, split into named arrays (asynchronously), and its real rows."""
        valid = min(self.batch_size, self._part_records - index * self.batch_size)
        if valid <= 0:  # a part shorter than the longest: a whole batch of declared padding
            return self._last_arrays, 0
        payload = next_label(self._native)
        if payload is None:
            raise LoaderError(f"MXNet's iterator ended after {index} of {self._batches} batches "
                              f"(generation {self.plan.generation})")
        if valid < self.batch_size:
            # MXNet leaves stale or uninitialised memory (even NaN) in the rest of the last
            # batch; fill it with this batch's real rows so padding is always valid data.
            payload = mx.nd.take(payload, mx.nd.array(np.arange(self.batch_size) % valid))
        self._last_arrays = self._split(payload)
        return self._last_arrays, valid

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
        payload = self._samples * self.schema.record_floats * 4
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
            "pinned": self._choice.pin,
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
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue from ``state``: same shards, same epoch order, the same remaining batches."""
        if state.get("version") != _STATE_VERSION:
            raise LoaderError(f"state_dict version {state.get('version')!r}, expected {_STATE_VERSION}")
        for key in ("batch_size", "num_parts", "part_index", "shuffle", "last_batch", "seed"):
            if state[key] != getattr(self, key):
                raise LoaderError(f"state_dict was saved with {key}={state[key]!r}, this iterator has "
                                  f"{getattr(self, key)!r}")
        if state["fingerprint"] != self.schema.fingerprint:
            raise LoaderError("state_dict was saved for another schema")
        self._close_epoch()
        self._take_ahead(self.plan, -1)
        if state.get("pinned") is not None:
            self._choice = Choice(pin=state["pinned"])
        manifest = load_manifest(self.manifest_path)
        shards = tuple(ShardEntry.from_json(s) for s in state["shards"])
        plan = make_plan(self.manifest_path, manifest, shards, self.cache_dir)
        plan = EpochPlan(plan.store, state["generation"], plan.fingerprint, plan.shards, plan.folder, plan.records)
        self.epoch = int(state["epoch"])
        self._start_epoch(plan)
        for _ in range(int(state["batches"])):
            self.next()
        self._samples, self._blocked, self._epoch_t0, self._epoch_t1 = 0, 0.0, None, None

    # -- internals ------------------------------------------------------------------------------

    def _start_epoch(self, plan: EpochPlan, native: Optional[mx.io.DataIter] = None) -> None:
        sizes = part_sizes(plan.records, self.num_parts)
        smallest = min(sizes)
        if smallest < self.batch_size:
            which = sizes.index(smallest)
            raise LoaderError(
                f"batch_size {self.batch_size} is larger than part {which} of {self.num_parts} "
                f"({smallest} of {plan.records} records in generation {plan.generation})")
        previous, self.plan = getattr(self, "plan", None), plan
        if previous is None or previous.folder != plan.folder:
            hold(plan)
            if previous is not None:
                drop(previous)
        self._lease.renew(plan.generation)
        self._part_records = sizes[self.part_index]
        if self.last_batch == "pad":
            self._batches = math.ceil(max(sizes) / self.batch_size)
        else:
            self._batches = smallest // self.batch_size
        self._cursor, self._samples, self._blocked = 0, 0, 0.0
        self._epoch_t0 = self._epoch_t1 = None
        self._last_arrays = None
        self._native = native if native is not None else self._open_native(plan, self.epoch)
        # The next epoch's iterator opens now, fills its prefetch buffer and waits: reset() is then
        # nearly free when the manifest has not changed (a new generation discards it).
        self._ahead = Ahead(plan, self.epoch + 1, self._open_native)
        self._start_producer()  # batches get ready while the caller does other things

    def _open_native(self, plan: EpochPlan, epoch: int) -> mx.io.DataIter:
        return open_record_iter(plan, record_floats=self.schema.record_floats, batch_size=self.batch_size,
                                shuffle=self.shuffle, seed=epoch_seed(self.seed, epoch), num_parts=self.num_parts,
                                part_index=self.part_index, preprocess_threads=self.preprocess_threads,
                                prefetch_buffer=self.prefetch_buffer)

    def _take_ahead(self, plan: EpochPlan, epoch: int) -> Optional[mx.io.DataIter]:
        """The next epoch's iterator opened in the background, if it fits (plan, epoch). Any other
        is freed now: it reads files of the generation our lease still names, so it must be gone
        before the lease moves on (gc may then delete those files)."""
        ahead, self._ahead = self._ahead, None
        return ahead.take(plan, epoch) if ahead is not None else None

    def _close_epoch(self) -> None:
        self._stop_producer()
        if self._native is not None:
            if self._cursor:
                self.history.append(self.stats)
            self._native = None  # frees the native iterator and its threads

    def _split(self, payload: mx.nd.NDArray) -> list:
        s, b = self.schema, self.batch_size
        out = [mx.nd.slice_axis(payload, axis=1, begin=0, end=s.x_floats).reshape((b, s.time_steps, s.num_inputs))]
        slices = s.label_slices()
        for lab in self._labels:
            sl = slices[lab.name]
            part = mx.nd.slice_axis(payload, axis=1, begin=sl.start, end=sl.stop)
            out.append(part.reshape((b,)) if lab.width == 1 else part)
        return out

    def close(self) -> None:
        """Stop the native threads and drop the reader lease now rather than at garbage collection."""
        self._close_epoch()
        plan = getattr(self, "plan", None)  # None when the constructor failed
        if plan is not None:
            self._take_ahead(plan, -1)
            if not self._closed:
                drop(plan)
        self._closed = True
        self._lease.release()

    def __enter__(self) -> ShardIter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
