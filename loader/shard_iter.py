"""``ShardIter``: an ``mx.io.DataIter`` over a shardgen manifest, read by MXNet's native C++
``ImageRecordIter`` (``preprocess_threads`` decode threads and a ``prefetch_buffer`` of batches,
none of them holding the GIL). Records carry a pack of windows or a run of rows; a producer
thread mixes them in a shuffle buffer and cuts the caller's batches (:mod:`loader.pipeline.stream`), so
``next()`` only takes a ready batch. The next epoch's stream starts before this one ends, so
``reset()`` is nearly free. Every shard is checked (:mod:`shardgen.format.check`) before MXNet reads it.

Epochs are exact: every sample of this part once, with ``pad`` counted here. The order is a
function of seed, epoch and selection alone: reproducible, and resumable from ``state_dict()``
without re-reading what was consumed.
"""

from __future__ import annotations

import dataclasses
import os
import time
import weakref
from pathlib import Path
from typing import Any, Optional, Sequence

import mxnet as mx

from loader import lifecycle
from loader.checkpoint import check_state, state_of
from loader.errors import LoaderError
from loader.pipeline.epochs import Epochs
from loader.pipeline.memory import Arena, settle_allocator
from loader.pipeline.settings import (
    buffer_records,
    check_arguments,
    check_memory,
    default_native_batch,
    default_readers,
)
from loader.pipeline.stream import StreamParams, batch_floats
from loader.source.generations import Choice, agreed_start
from loader.source.objcache import lease_for, mirror_of, resolve
from loader.source.plan import EpochPlan, default_cache_dir, make_plan, recheck
from loader.source.selection import (
    DateRange,
    load_manifest,
    manifest_path_of,
    normalize_dates,
    select_shards,
    to_datetime64,
)
from shardgen.store.manifest import ShardEntry

__all__ = ["ShardIter", "to_datetime64"]

class ShardIter(mx.io.DataIter):
    """Batches of a shard store: ``data = [x (B, T, C)]``, ``label = [each label..., date]``.

    ``verify``: ``"frame"`` (default) checks every record's framing before MXNet reads it,
    ``"sha256"`` also checks content against the manifest, ``"none"`` trusts the files.
    ``readers``: native iterators per part (each with its own I/O thread; default 2).
    ``shuffle_buffer``: what is held for mixing, as a number of *records* (an int) or a size
    in bytes (a string such as ``"256MB"`` or ``"1GiB"``; default 128 MB).
    ``native_batch``: records per native batch. ``prefetch_buffer``: caller batches assembled
    ahead. What these hold in memory is computed at construction (:mod:`loader.pipeline.memory`); more
    than half the machine's memory is a LoaderError.
    """

    def __init__(self, manifest: os.PathLike | str, batch_size: int, *, shuffle: bool = True, seed: int = 0,
                 preprocess_threads: int = 4, prefetch_buffer: int = 8, num_parts: int = 1,
                 part_index: int = 0, last_batch: str = "pad", dates: DateRange = None,
                 label_names: Optional[Sequence[str]] = None, cache_dir: Optional[os.PathLike] = None,
                 verify: str = "frame", readers: Optional[int] = None, shuffle_buffer: Optional[int | str] = None,
                 native_batch: Optional[int] = None, generation: Optional[int] = None,
                 cache_limit: Optional[int | str] = None):
        check_arguments(batch_size=batch_size, num_parts=num_parts, part_index=part_index,
                        preprocess_threads=preprocess_threads, prefetch_buffer=prefetch_buffer, readers=readers,
                        native_batch=native_batch, last_batch=last_batch, seed=seed, verify=verify)
        super().__init__(int(batch_size))
        self.manifest_path = manifest_path_of(resolve(manifest, cache_dir, cache_limit))
        self.shuffle, self.seed = bool(shuffle), int(seed)
        self.preprocess_threads, self.prefetch_buffer = int(preprocess_threads), int(prefetch_buffer)
        self.num_parts, self.part_index, self.last_batch = int(num_parts), int(part_index), last_batch
        self.verify = verify
        self._dates = normalize_dates(dates)
        self.cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
        self.epoch = 0
        self.history: list[dict] = []
        self._closed = False
        self._epochs = Epochs(lease_for(self.manifest_path.parent))  # tells gc which generation we read
        self._finalizer = weakref.finalize(self, self._epochs.close_when_free)
        self._choice = Choice(pin=generation)
        manifest_obj = self._choice.manifest(self.manifest_path)
        self.schema = manifest_obj.schema
        known = [lab.name for lab in self.schema.labels]
        self.label_names = tuple(known if label_names is None else label_names)
        unknown = [n for n in self.label_names if n not in known]
        if unknown or not self.label_names:
            raise LoaderError(f"label_names {list(self.label_names)!r}: choose among {known}")
        nb = int(native_batch) if native_batch is not None else default_native_batch(self.schema.pack)
        buffer = buffer_records(self.schema, shuffle_buffer, nb)
        self._params = StreamParams(
            schema=self.schema, batch_size=self.batch_size, shuffle=self.shuffle, seed=self.seed,
            num_parts=self.num_parts, part_index=self.part_index, last_batch=last_batch,
            readers=default_readers() if readers is None else int(readers),
            native_batch=nb, buffer_records=buffer,
            preprocess_threads=self.preprocess_threads, prefetch_buffer=self.prefetch_buffer,
            label_names=tuple(lab.name for lab in self._labels))
        self.memory = check_memory(self._params, shuffle_buffer)
        settle_allocator()
        # Batch buffers: the caller's queue and a few held by MXNet, for this and the next epoch's stream.
        self._epochs.arena = Arena(self.schema, batch_floats(self._params),
                                               keep=2 * (self.prefetch_buffer + 4))
        self._describe()
        self._start_epoch(self._plan_for(manifest_obj, select_shards(manifest_obj, self.dates)))
        lifecycle.track(self)

    @classmethod
    def for_kvstore(cls, kv: Any, manifest: os.PathLike | str, batch_size: int, **kwargs: Any) -> ShardIter:
        """One part per worker of a (distributed) kvstore: ``num_parts = kv.num_workers``, ``part_index = kv.rank``.
        The workers agree on the generation (rank 0's newest) through ``kv`` at construction and at
        every ``reset()``; ``generation=N`` pins one instead."""
        if kwargs.get("generation") is not None:
            return cls(manifest, batch_size, num_parts=kv.num_workers, part_index=kv.rank, **kwargs)
        kwargs.pop("generation", None)
        manifest = resolve(manifest, kwargs.get("cache_dir"), kwargs.get("cache_limit"))
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
        return self._epochs.plan

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
        return self._epochs.stream.readers if self._epochs.stream else 0

    def reset(self) -> None:
        """Start the next epoch on the newest manifest generation."""
        self._check_open()
        self._close_epoch()
        manifest = self._choice.manifest(self.manifest_path)
        if manifest.schema.fingerprint != self.schema.fingerprint:
            raise LoaderError(f"{self.manifest_path}: the store's schema changed (fingerprint "
                              f"{self.schema.fingerprint} -> {manifest.schema.fingerprint}); make a new ShardIter")
        shards = select_shards(manifest, self.dates)
        current = self.plan
        if current is None:  # close() from another thread while this reset() ran
            raise LoaderError(f"{self.manifest_path}: this ShardIter was closed (by another thread) during reset()")
        if shards != current.shards:
            plan = self._plan_for(manifest, shards)
        elif manifest.generation != current.generation:  # same files: only the generation moves on
            plan = dataclasses.replace(current, generation=manifest.generation)
        else:
            plan = current
        if plan.folder == current.folder:
            recheck(plan, self.schema, self.verify)
        self._start_epoch(plan, epoch=self.epoch + 1)

    def next(self) -> mx.io.DataBatch:
        t0 = time.perf_counter()
        if self._epoch_t0 is None:
            self._epoch_t0 = t0
        if self._cursor >= self._batches:
            raise StopIteration
        self._check_open()
        arrays, pad = self._take()
        self._cursor += 1
        self._samples += self.batch_size - pad if self.last_batch == "pad" else self.batch_size
        t1 = time.perf_counter()
        self._blocked += t1 - t0
        self._epoch_t1 = t1
        return mx.io.DataBatch(data=arrays[:1], label=arrays[1:], pad=pad,
                               provide_data=self._provide_data, provide_label=self._provide_label)

    def _take(self) -> tuple[list, int]:
        """The next batch's arrays and pad."""
        res = self._epochs
        if res.stream is None:
            raise LoaderError(f"{self.manifest_path}: no epoch to read: the last reset() failed; fix the cause "
                              "(e.g. the date selection) and call reset() again")
        arrays, valid = res.stream.get()
        if not self._ahead_asked and self._cursor + 1 >= self._ahead_at:
            self._open_ahead()
        return arrays, self.batch_size - valid if self.last_batch == "pad" else 0

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
        return state_of(self)

    def load_state_dict(self, state: dict) -> None:
        """Continue from ``state``: same shards, same epoch order, the same remaining batches. The
        consumed batches are not assembled again: the stream passes over them."""
        check_state(self, state)
        self._check_open()
        self._dates = normalize_dates(state.get("dates"))  # the saved selection, from the next reset() on
        shards = tuple(ShardEntry.from_json(s) for s in state["shards"])
        same = (shards == self.plan.shards and int(state["epoch"]) == self.epoch and self._cursor == 0
                and state["generation"] == self.plan.generation and state.get("pinned") == self._choice.pin
                and (state["readers"], state["native_batch"], state["shuffle_buffer"])
                == (self._params.readers, self._params.native_batch, self._params.buffer_records))
        if same and self._epochs.stream is not None:  # the stream this epoch already started: skip ahead in it
            self._epochs.stream.skip_to(int(state["batches"]))
            self._cursor = int(state["batches"])
            self._ahead_at = max(self._cursor, self._ahead_at)
            return
        params = dataclasses.replace(self._params, readers=int(state["readers"]),
                                     native_batch=int(state["native_batch"]),
                                     buffer_records=int(state["shuffle_buffer"]))
        self.memory = check_memory(params, int(state["shuffle_buffer"]))
        self._close_epoch()
        if state.get("pinned") is not None:
            self._choice = Choice(pin=state["pinned"])
        self._params = params
        manifest = load_manifest(self.manifest_path)
        plan = self.plan if shards == self.plan.shards else self._plan_for(manifest, shards)
        plan = dataclasses.replace(plan, generation=state["generation"])
        self._start_epoch(plan, skip=int(state["batches"]), epoch=int(state["epoch"]))

    # -- internals ------------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise LoaderError(f"{self.manifest_path}: this ShardIter is closed")

    def _plan_for(self, manifest: Any, shards: tuple) -> EpochPlan:
        return make_plan(self.manifest_path, manifest, shards, self.cache_dir, verify=self.verify,
                         fetcher=f"iter-{id(self)}")

    def _start_epoch(self, plan: EpochPlan, *, skip: int = 0, epoch: Optional[int] = None) -> None:
        """Make ``plan`` this iterator's, reading ``epoch`` (default: the current one). Nothing
        changes if the epoch cannot start (e.g. a part smaller than a batch): the error is raised
        and the plan's files are let go."""
        epoch = self.epoch if epoch is None else epoch
        stream = self._epochs.start(plan, epoch, self._params, skip)
        self.epoch = epoch
        self._part_samples, self._batches = stream.samples, stream.batches
        self._cursor, self._samples, self._blocked = skip, 0, 0.0
        self._epoch_t0 = self._epoch_t1 = None
        # The next epoch's stream starts half way through this one: its buffer fills (and its native
        # iterators open) while this epoch's batches are consumed. The stream's producer thread starts
        # it as it gets there (Epochs._half_way); next() asks again when the caller gets there.
        self._ahead_at = max(skip, self._batches // 2)
        self._ahead_asked = False
        if self._cursor >= self._ahead_at:
            self._open_ahead()

    def _open_ahead(self) -> None:
        """The next epoch's stream, on this plan, starts filling while this epoch ends (a new
        generation at ``reset()`` discards it)."""
        self._ahead_asked = True
        self._epochs.open_ahead(self.epoch + 1, self._params)
        cache = mirror_of(self.manifest_path)
        if cache is not None and self._choice.pin is None:  # a store on an object store: new shards ahead
            cache.fetch_ahead(lambda m: select_shards(m, self.dates))

    def _close_epoch(self) -> None:
        res = self._epochs
        if res.stream is not None:
            if self._cursor:
                self.history.append(self.stats)
            stream, res.stream = res.stream, None
            stream.close(wait=self._cursor < self._batches)  # read to its end: its thread is ending

    def close(self) -> None:
        """Stop the native threads, let go of the files and drop the reader lease now rather than
        at garbage collection. Safe to call more than once, and after an error."""
        if self._closed:
            return
        self._closed = True
        if getattr(self, "_cursor", 0) and self._epoch_running():
            self.history.append(self.stats)
        self._release()

    def _epoch_running(self) -> bool:
        res = getattr(self, "_epochs", None)
        return res is not None and res.stream is not None

    def _release(self) -> None:
        cache = mirror_of(self.manifest_path) if hasattr(self, "manifest_path") else None
        if cache is not None:
            cache.release(f"iter-{id(self)}")
        res = getattr(self, "_epochs", None)
        if res is not None:
            res.close()

    def __enter__(self) -> ShardIter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
