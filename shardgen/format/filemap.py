"""A read-only map of an open file, for the shard check (:mod:`shardgen.format.check`): unmapped
when the block ends, or when its last view goes.

A sampling profiler (Dask's worker samples every thread's frames every 10 ms) may hold a returned
frame, and with it numpy views of the map, a while longer; closing the map then raised BufferError
and failed the date (issue 44). Such a map is left to its last view (it holds its own dup of the
fd) and counted in ``DEFERRED_UNMAPS``: without a profiler none is (a view kept by our own code
would be a leaked map and descriptor)."""

from __future__ import annotations

import contextlib
import logging
import mmap
from typing import Iterator

__all__ = ["mapped", "DEFERRED_UNMAPS"]

DEFERRED_UNMAPS = 0  # maps left to their last view
log = logging.getLogger(__name__)


@contextlib.contextmanager
def mapped(fd: int) -> Iterator[memoryview]:
    """The whole file ``fd``, read-only."""
    global DEFERRED_UNMAPS
    mm = mmap.mmap(fd, 0, prot=mmap.PROT_READ)
    buf = memoryview(mm)
    try:
        yield buf
    finally:
        try:
            buf.release()
            mm.close()
        except BufferError:  # the map (and its own dup of the fd) is freed with the last view
            DEFERRED_UNMAPS += 1
            log.debug("a view of a checked shard's map is still held (a sampling profiler?): unmapped later")
