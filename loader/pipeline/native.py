"""Plumbing around MXNet's native ``ImageRecordIter``: opening one for an epoch (quietly), opening
the next one in the background, and taking just the label array of each batch."""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import tempfile
import threading
from typing import Iterator, Optional

import mxnet as mx
import numpy as np
from mxnet.base import _LIB, check_call

from loader.source.plan import ReaderSource

__all__ = ["open_record_iter", "one_openmp_thread", "next_label", "copy_into", "free"]

_CHATTER = re.compile(rb"ImageRecordIOParser2: .* threads for decoding")
_STDERR_LOCK = threading.Lock()


@contextlib.contextmanager
def quiet_native_info() -> Iterator[None]:
    """Drop the INFO line MXNet's C++ prints at each iterator creation; keep anything else."""
    with _STDERR_LOCK:  # fd 2 is process-wide: one redirection at a time
        try:
            saved = os.dup(2)
        except OSError:  # no stderr to guard
            yield
            return
        with tempfile.TemporaryFile() as tmp:
            os.dup2(tmp.fileno(), 2)
            try:
                yield
            finally:
                os.dup2(saved, 2)
                os.close(saved)
                tmp.seek(0)
                rest = [ln for ln in tmp.read().splitlines(keepends=True) if not _CHATTER.search(ln)]
                if rest:
                    os.write(2, b"".join(rest))


class _Native(mx.io.MXDataIter):
    """An ``MXDataIter`` the loader frees itself (``free``), in the thread and at the moment it
    chooses: before the files it reads are let go. Left to ``__del__``, one held by a reference
    cycle was freed by the garbage collector in whatever thread allocated next, while its segment's
    files were gone or another thread used MXNet: a segfault or ``producer_sig_ != kDestroy``."""

    def free(self) -> None:
        handle, self.handle = getattr(self, "handle", None), None
        if handle is not None:
            check_call(_LIB.MXDataIterFree(handle))

    def __del__(self) -> None:
        self.free()


def free(native) -> None:
    """Free a native iterator now (see ``_Native``); None is ignored."""
    if native is not None:
        native.free()


def one_openmp_thread() -> None:
    """Parallel regions this thread starts without ``num_threads`` run on this thread alone (the
    OpenMP ICV of the calling thread only: nothing else in the process changes).

    ``ImageRecordIter``'s constructor runs a bare ``#pragma omp parallel`` (to read the number of
    processors) in the thread that opens it: a team of one thread per core, whose idle workers then
    spin-wait after every open (GOMP's default policy). Measured (demo store, 8 opens an epoch):
    12% of the process's CPU; in order 1.41 -> 1.02-1.11 us of CPU per window. The decode regions
    (``num_threads(preprocess_threads)``) run in the reader's own thread and are unchanged."""
    with contextlib.suppress(AttributeError):  # an MXNet built without OpenMP
        _LIB.omp_set_num_threads(ctypes.c_int(1))


def open_record_iter(source: ReaderSource, *, record_floats: int, batch_size: int, shuffle: bool, seed: int,
                     preprocess_threads: int, prefetch_buffer: int) -> mx.io.DataIter:
    """MXNet's C++ record iterator over one reader's records; the whole sample rides in the header label."""
    one_openmp_thread()
    with quiet_native_info():
        native = mx.io.ImageRecordIter(
            path_imgrec=source.rec_paths, path_imgidx=str(source.index), data_shape=(1, 1, 1),
            label_width=record_floats, batch_size=batch_size, shuffle=shuffle, seed=seed,
            num_parts=source.num_parts, part_index=source.part_index, round_batch=False,
            preprocess_threads=preprocess_threads, prefetch_buffer=prefetch_buffer)
    native.__class__ = _Native
    return native


def next_label(native: mx.io.DataIter) -> Optional[mx.nd.NDArray]:
    """The next batch's label array only (``MXDataIter.next()`` would also fetch data, pad and
    index through ctypes and build a DataBatch), or None at the end."""
    if native.first_batch is not None:  # MXDataIter reads one batch when it is created
        label, native.first_batch = native.first_batch.label[0], None
        return label
    return native.getlabel() if native.iter_next() else None


def copy_into(array: mx.nd.NDArray, out: np.ndarray) -> np.ndarray:
    """``array.asnumpy()`` into ``out``, a float32 buffer reused batch after batch (a fresh array of
    a megabyte or more per batch churned the allocator), as a view of ``array``'s shape."""
    n = array.size
    if n > out.size or array.dtype != np.float32:
        raise ValueError(f"an array of {n} {array.dtype} does not fit a buffer of {out.size} float32")
    check_call(_LIB.MXNDArraySyncCopyToCPU(array.handle, out.ctypes.data_as(ctypes.c_void_p), ctypes.c_size_t(n)))
    return out.reshape(-1)[:n].reshape(array.shape)
