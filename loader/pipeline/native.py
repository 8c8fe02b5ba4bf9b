"""Plumbing around MXNet's native ``ImageRecordIter``: opening one (quietly: ``verbose=False``, and
leaving no OpenMP team behind), freeing it, and taking just the label array of each batch."""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import threading
from typing import Callable, Optional

import mxnet as mx
import numpy as np
from mxnet.base import _LIB, check_call

from loader.source.plan import ReaderSource

__all__ = ["open_record_iter", "release_tape", "one_openmp_thread", "next_label", "label_view", "free"]


class _Native(mx.io.MXDataIter):
    """An ``MXDataIter`` the loader frees itself (``free``), in the thread and at the moment it
    chooses: before the files it reads are let go. Left to ``__del__``, one held by a reference
    cycle was freed by the garbage collector in whatever thread allocated next, while the files it
    read were gone or another thread used MXNet: a segfault or ``producer_sig_ != kDestroy``."""

    def free(self) -> None:
        handle, self.handle = getattr(self, "handle", None), None
        try:
            if handle is not None:
                check_call(_LIB.MXDataIterFree(handle))
        finally:
            source, self.tape = getattr(self, "tape", None), None
            if source is not None:  # after the native: its threads no longer read it
                release_tape(source)

    def __del__(self) -> None:
        self.free()


def release_tape(source: ReaderSource) -> None:
    """Close a read's tape (:func:`loader.source.plan.reader_source`) and remove its link (once)."""
    if source.tape is not None:
        source.tape.close()


def free(native) -> None:
    """Free a native iterator now (see ``_Native``); None is ignored."""
    if native is not None:
        native.free()


def one_openmp_thread() -> None:
    """Parallel regions this thread starts without ``num_threads`` run on this thread alone (the
    OpenMP ICV of the calling thread only: nothing else in the process changes)."""
    with contextlib.suppress(AttributeError):  # an MXNet built without OpenMP
        _LIB.omp_set_num_threads(ctypes.c_int(1))


def decode_threads(preprocess_threads: int) -> int:
    """The decode threads MXNet 1.9.1 runs for ``preprocess_threads``: at most max(processors / 2 - 1, 1)
    (``ImageRecordIOParser2::Init``; processors as OpenMP counts them)."""
    return min(preprocess_threads, _decode_cap())


@functools.cache
def _decode_cap() -> int:
    """MXNet's cap on decode threads, looked up once (every native open asks)."""
    for lib in (ctypes.CDLL(None), _LIB):  # the process's global symbols first (what MXNet's own call finds)
        with contextlib.suppress(AttributeError):
            return max(int(lib.omp_get_num_procs()) // 2 - 1, 1)
    return max((os.cpu_count() or 1) // 2 - 1, 1)


def _in_a_thread_of_its_own(fn: Callable[[], object]) -> object:
    """``fn()`` in a thread that ends with it (its OpenMP team ends with it: see ``open_record_iter``)."""
    out: dict = {}

    def run() -> None:
        try:
            out["value"] = fn()
        except BaseException as exc:  # raised in the caller's thread
            out["error"] = exc

    thread = threading.Thread(target=run, name="shardgen-open", daemon=True)
    thread.start()
    thread.join()
    if "error" in out:
        raise out["error"]
    return out["value"]


def open_record_iter(source: ReaderSource, *, record_floats: int, batch_size: int, shuffle: bool, seed: int,
                     preprocess_threads: int, prefetch_buffer: int) -> mx.io.DataIter:
    """MXNet's C++ record iterator over one reader's records; the whole sample rides in the header label.

    Its constructor runs two OpenMP regions in the thread that opens it: a bare ``omp parallel`` (to
    read the number of processors: a team of one thread per core) and one of
    ``num_threads(preprocess_threads)`` (capped by MXNet at about half the cores). An opening
    thread keeps its team, whose idle workers spin-wait after every open (GOMP's default policy;
    measured on the demo store, 8 opens an epoch: 12% of the process's CPU, in order 1.41 -> 1.02-1.11
    us of CPU per window). So the opening thread runs bare regions alone (``one_openmp_thread``),
    and where MXNet runs more than one decode thread (``decode_threads``: 6 processors or more) the
    reader is opened in a thread of its own, whose team ends with it; else in the calling thread (a
    team of one is no team). Decoding runs in the reader's own thread with ``preprocess_threads``."""
    def construct() -> mx.io.DataIter:
        one_openmp_thread()
        native = mx.io.ImageRecordIter(
            path_imgrec=source.rec_paths, path_imgidx=str(source.index), data_shape=(1, 1, 1),
            label_width=record_floats, batch_size=batch_size, shuffle=shuffle, seed=seed,
            num_parts=source.num_parts, part_index=source.part_index, round_batch=False,
            preprocess_threads=preprocess_threads, prefetch_buffer=prefetch_buffer,
            verbose=False)  # no INFO line per open (it was caught by redirecting the process's stderr)
        native.__class__ = _Native
        native.tape = source
        return native

    try:
        return _in_a_thread_of_its_own(construct) if decode_threads(preprocess_threads) > 1 else construct()
    except BaseException:
        release_tape(source)
        raise


def next_label(native: mx.io.DataIter) -> Optional[mx.nd.NDArray]:
    """The next batch's label array only (``MXDataIter.next()`` would also fetch data, pad and
    index through ctypes and build a DataBatch), or None at the end."""
    if native.first_batch is not None:  # MXDataIter reads one batch when it is created
        label, native.first_batch = native.first_batch.label[0], None
        return label
    return native.getlabel() if native.iter_next() else None


def label_view(array: mx.nd.NDArray) -> np.ndarray:
    """A numpy view of a native batch's label array, over MXNet's own memory (no copy): what the
    shuffle buffer copies each record from, once (``ShuffleBuffer.put``). Valid until the native
    iterator's next batch; the array must be float32 on the CPU, as an ``ImageRecordIter``'s is."""
    if array.dtype != np.float32 or array.context.device_type not in ("cpu", "cpu_pinned"):
        raise ValueError(f"a native label batch must be float32 on the CPU, got {array.dtype} on {array.context}")
    array.wait_to_read()  # MXNet 1.9.1's reader writes its batches outside the engine: a guard, not a wait
    ptr = ctypes.c_void_p()
    check_call(_LIB.MXNDArrayGetData(array.handle, ctypes.byref(ptr)))
    n = int(np.prod(array.shape))
    return np.frombuffer((ctypes.c_float * n).from_address(ptr.value), np.float32).reshape(array.shape)
