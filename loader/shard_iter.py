"""``ShardIter``: an ``mx.io.DataIter`` over a shardgen manifest, read by MXNet's native C++
``ImageRecordIter`` (with ``preprocess_threads`` decode threads, none of them holding the GIL).
Records carry a pack of windows or a run of rows; a loader thread fills the order's blocks into
shuffle buffers and a producer thread cuts the caller's batches from them
(:mod:`loader.pipeline.pipeline`), so ``next()`` only takes a ready batch. The loader fills the
next epoch's first block before this one ends, so ``reset()`` is nearly free. Every shard is
checked (:mod:`shardgen.format.check`) before MXNet reads it.

This class is MXNet's face of it (the contract, named arrays, statistics); what is read and where
the iterator is belongs to its :class:`loader.reader.Reader`.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any, Callable, Optional, Sequence

import mxnet as mx

from loader.checkpoint import at_end, ends_epoch, rewound
from loader.epoch_clock import EpochClock
from loader.errors import IteratorClosed, LoaderError
from loader.first_agreement import FirstAgreement
from loader.fit_resume import fit_checkpoint
from loader.lifecycle import report_rank, start, track
from loader.pipeline.batches import asked_labels
from loader.pipeline.settings import check_arguments, check_removed
from loader.reader import Reader
from loader.source.generations import Choice
from loader.source.opening import open_store
from loader.source.plan import cache_root
from loader.source.selection import DateRange, normalize_dates
from shardgen.store import Store
from shardgen.store.naming import MANIFEST_NAME

__all__ = ["ShardIter"]


def _setting(name: str) -> property:
    """A read-only attribute of the iterator: the reader's setting ``name``."""
    return property(lambda self: getattr(self.reader.params, name), doc=f"``{name}``, as constructed")


def _of_reader(name: str, doc: str) -> property:
    """A read-only attribute of the iterator: the reader's ``name``."""
    return property(lambda self: getattr(self.reader, name), doc=doc)


class ShardIter(mx.io.DataIter):
    """Batches of a shard store: ``data = [x (B, T, C)]``, ``label = [each label..., date]``.

    ``manifest``: a manifest file, a store folder, or ``s3://bucket/prefix`` (downloaded into
    ``cache_dir``, at most ``cache_limit`` bytes: :mod:`shardgen.store.cached`). ``cache_dir``: the
    one root of what the loader writes locally (:func:`loader.source.plan.cache_root`).
    ``verify``: ``"crc"`` (default) checks every record's framing and payload CRC32 before MXNet
    reads it (once per file version), ``"frame"`` the framing only, ``"sha256"`` also the whole
    file against the manifest, ``"none"`` trusts the files.
    ``shuffle_buffer``: the block mixed in memory, in *records* (an int) or bytes (``"256MB"``).
    ``prefetch_buffer``: caller batches assembled ahead. ``stripes``: every block a piece of every
    date (default: for a folder). ``canonical_parts``: the order's part count (default
    ``num_parts``; :mod:`loader.pipeline.order`): a state resumes on any. What these hold in memory
    is computed at construction (:mod:`loader.pipeline.memory`); more than half the machine's memory
    is a LoaderError. ``readers`` and ``native_batch`` were removed (no measured effect): passing
    either is a LoaderError saying so (``settings.REMOVED``).
    """

    def __init__(self, manifest: os.PathLike | str | Store, batch_size: int, *, shuffle: bool = True,
                 seed: int = 0, preprocess_threads: int = 4, prefetch_buffer: int = 8, num_parts: int = 1,
                 part_index: int = 0, last_batch: str = "pad", dates: DateRange = None,
                 label_names: Optional[Sequence[str]] = None, cache_dir: Optional[os.PathLike] = None,
                 verify: str = "crc", shuffle_buffer: Optional[int | str] = None, generation: Optional[int] = None,
                 cache_limit: Optional[int | str] = None, canonical_parts: Optional[int] = None,
                 stripes: Optional[bool] = None, **removed: object):
        check_removed(removed)  # readers=, native_batch=: gone, saying why
        start()  # the process's exit hooks, with the first iterator (loader.lifecycle)
        knobs = dict(batch_size=batch_size, num_parts=num_parts, part_index=part_index, seed=seed,
                     preprocess_threads=preprocess_threads, prefetch_buffer=prefetch_buffer,
                     last_batch=last_batch, canonical_parts=canonical_parts, stripes=stripes)
        check_arguments(**knobs, verify=verify)
        super().__init__(int(batch_size))
        self._closed = False
        self.history: list[dict] = []
        self.cache_dir = cache_root(cache_dir)
        store = open_store(manifest, self.cache_dir, cache_limit)
        self.manifest_path = store.where(MANIFEST_NAME)
        self.reader = Reader.open(store, self.cache_dir, generation=generation, dates=dates, label_names=label_names,
                                  shuffle_buffer=shuffle_buffer, verify=verify, shuffle=shuffle, **knobs)
        self.label_names = self.reader.params.label_names
        self._describe()
        self._clock = EpochClock()
        track(self)

    @classmethod
    def for_kvstore(cls, kv: Any, manifest: os.PathLike | str, batch_size: int, **kwargs: Any) -> ShardIter:
        """One part per worker of a (distributed) kvstore: ``num_parts = kv.num_workers``, ``part_index = kv.rank``.
        The workers agree on the generation (rank 0's newest) through ``kv`` at the first batch (or
        the first ``reset()``) and at every ``reset()``; ``generation=N`` pins one instead.

        Nothing goes through ``kv`` here: its first keys are the model's, of a kind not known yet
        (:mod:`loader.first_agreement` says why); the agreement takes the kind found (``agree``)."""
        parts = dict(num_parts=kv.num_workers, part_index=kv.rank)
        it = cls(manifest, batch_size, **parts, **kwargs)  # unpinned: its newest, until the first batch
        if kwargs.get("generation") is None:
            it.reader.choice = Choice(kv=kv)  # every reset() agrees
            if kv.num_workers > 1:
                it._first_agreement = FirstAgreement(kv, it.dates)
        report_rank(kv.rank)  # loader.tools.launch labels this worker's lines with it
        return it

    _first_agreement: Optional[FirstAgreement] = None  # for_kvstore: the agreement due at the first batch
    epoch_ended = _loaded_end = False  # next() said StopIteration / the state loaded had: reset() clears them

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
                               for lab in asked_labels(self.reader.params)]

    def reset(self) -> None:
        """Start the next epoch on the newest manifest generation."""
        self._check_open()
        if not self._loaded_end:  # a loaded epoch-end state is its next epoch's start already: nothing to end
            self._keep_stats()
            self._first_agreement = None  # for_kvstore: this reset() is the agreement
            self.reader.reset()
            self._clock = EpochClock()
        self.epoch_ended = self._loaded_end = False

    def next(self) -> mx.io.DataBatch:
        if self._first_agreement is not None and not self._closed:
            pending, self._first_agreement = self._first_agreement, None
            pending.settle(self)
        reader = self.reader
        if not reader.running and not self._closed:  # the last reset() failed: take() says so, never an empty epoch
            reader.take()
        if reader.cursor >= reader.batches:
            self.epoch_ended = True  # fit_checkpoint: Module.fit holds no batch ahead now
            raise StopIteration
        self._loaded_end = False  # the epoch a loaded epoch-end state starts is being read: reset() ends it
        t0 = time.perf_counter()
        self._clock.begin(t0)
        if self._closed:
            raise self._closed_error()
        try:
            arrays, pad = reader.take()
        except LoaderError:
            if self._closed:  # closed while this next() waited
                raise self._closed_error() from None
            raise
        self._clock.took(t0, self.batch_size - pad)  # pad is 0 with last_batch="discard"
        return mx.io.DataBatch(data=arrays[:1], label=arrays[1:], pad=pad,
                               provide_data=self._provide_data, provide_label=self._provide_label)

    def _closed_error(self) -> BaseException:
        """``IteratorClosed``; in MXNet's ``PrefetchingIter`` thread, whose ``prefetch_func`` takes only StopIteration
        as an end (else the thread dies with a traceback, its wrapper waiting), the end of the data."""
        target = getattr(threading.current_thread(), "_target", None)  # the thread's entry, not a frame
        if (getattr(target, "__qualname__", "") == "PrefetchingIter.__init__.<locals>.prefetch_func"
                and getattr(target, "__module__", "") == "mxnet.io.io"):
            return StopIteration()
        return IteratorClosed(f"{self.manifest_path}: this ShardIter is closed")

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

    # -- what it reads ----------------------------------------------------------------------------

    schema = _of_reader("schema", "The store's :class:`shardgen.format.schema.Schema`.")
    # The reading settings, as constructed (read-only): the reader's StreamParams.
    shuffle = _setting("shuffle")
    seed = _setting("seed")
    num_parts = _setting("num_parts")
    part_index = _setting("part_index")
    last_batch = _setting("last_batch")
    preprocess_threads = _setting("preprocess_threads")
    prefetch_buffer = _setting("prefetch_buffer")

    verify = _of_reader("verify", "``verify``, as constructed")
    memory = _of_reader("memory", "Bytes each part of this iterator may hold at most (:mod:`loader.pipeline.memory`).")
    epoch = _of_reader("epoch", "The epoch being read (0 first).")
    plan = _of_reader("plan", "The epoch's :class:`loader.source.plan.EpochPlan` (None once closed).")
    batches_per_epoch = _of_reader("batches", "Batches this part yields this epoch.")

    @property
    def dates(self) -> Optional[tuple]:
        """The ``(start, end)`` date selection; setting it takes effect at the next ``reset()``."""
        return self.reader.dates

    @dates.setter
    def dates(self, value: DateRange) -> None:
        self.reader.dates = normalize_dates(value)

    @property
    def generation(self) -> int:
        return self.plan.generation

    @property
    def records_per_epoch(self) -> int:
        """Real (not padding) samples this part yields per epoch."""
        return self.reader.part_samples if self.last_batch == "pad" else self.reader.batches * self.batch_size

    # -- statistics -----------------------------------------------------------------------------

    def _keep_stats(self) -> None:
        """This epoch's statistics into ``history`` (if this process read a batch of it)."""
        if self._clock.batches and self.reader.running:
            self.history.append(self._clock.figures(self.reader))

    @property
    def stats(self) -> dict:
        """This epoch so far: samples/s, payload MB/s and the data-stall fraction; ``last_epoch``:
        the same figures of the last epoch that ended (``history[-1]``, None before), which is what
        is left to read after ``Module.fit``: it resets the iterator at the end of every epoch.
        ``downloaded_bytes``: fetched from an object store so far; ``dates_per_block``: the fewest
        dates a block of this epoch spans (far below the dates read: raise ``shuffle_buffer``)."""
        return {**self._clock.figures(self.reader), "last_epoch": dict(self.history[-1]) if self.history else None,
                "downloaded_bytes": self.reader.store.downloaded_bytes,
                "dates_per_block": self.reader.dates_per_block}

    # -- resumption -----------------------------------------------------------------------------

    def state_dict(self, *, untrained: int = 0) -> dict:
        """Where this iterator is, after every batch ``next()`` handed out; ``state["epoch"]`` is the epoch it
        resumes (after StopIteration: the next one, from its first batch). ``untrained``: the last batches handed
        out that the caller has not trained, left to read (``Module.fit`` holds one: :meth:`fit_checkpoint`)."""
        self._check_open()
        state = rewound(self.reader.state(str(self.manifest_path)), untrained)
        ended = not untrained and (self.epoch_ended or self._loaded_end)
        return at_end(state, ended_now=self.epoch_ended) if ended else state

    def fit_checkpoint(self, save: Callable[[dict], None], *, every: int = 1) -> Callable[[Any], None]:
        """``Module.fit``'s ``batch_end_callback``: ``save(state)`` of what fit trained (:mod:`loader.fit_resume`)."""
        return fit_checkpoint(self, save, every)

    def load_state_dict(self, state: dict) -> None:
        """Continue from ``state``: same shards, same epoch order, the same remaining batches."""
        reader = self.reader
        reader.check(state)
        ended = ends_epoch(state)
        self._check_open()
        if reader.load(state, before_end=self._keep_stats):
            self._clock = EpochClock()
        self.epoch_ended, self._loaded_end = False, ended
        if self._first_agreement is not None:  # the first batch still agrees, on the state's generation
            self._first_agreement.loaded = True

    # -- the end --------------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise LoaderError(f"{self.manifest_path}: this ShardIter is closed")

    def close(self) -> None:
        """Stop the native threads, let go of the files and drop the reader lease now rather than
        at garbage collection. Safe to call more than once, and after an error. A ``next()`` waiting
        in another thread, or called afterwards, raises ``IteratorClosed``, a LoaderError (an epoch
        is never cut short silently), except in MXNet's ``PrefetchingIter`` thread, which asks for a
        batch ahead: there it is the end of the data, so that thread ends without a traceback."""
        reader = getattr(self, "reader", None)
        if reader is not None and not self._closed:
            self._keep_stats()
        self._closed = True
        if reader is not None:
            reader.close()  # runs once to its end (again after a Ctrl-C in it: loader.pipeline.shutdown)

    def __enter__(self) -> ShardIter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

