"""The producer thread's work (:mod:`loader.pipeline.pipeline`): one job's caller batches, each
gathered from the filled block(s) its samples are in, in the block's permuted order, split into
named arrays over one buffer lent to MXNet without a copy (``loader.pipeline.zerocopy``). The same
batches come every time for the same order, whatever only shapes how records got there."""

from __future__ import annotations

from typing import Callable

import numpy as np

from loader.errors import LoaderError
from loader.pipeline.batches import batch_views, fill_batch
from loader.pipeline.fill import Filled, Halted
from loader.pipeline.job import EpochJob
from loader.pipeline.memory import Arena

__all__ = ["produce"]


def produce(job: EpochJob, arena: Arena, take: Callable[[int], Filled], offer: Callable[[object], bool],
            held: dict, half: Callable[[], object] = lambda: None) -> None:
    """Every batch of ``job`` from its first (``job.first``) handed to ``offer((arrays, valid))``
    (False: the job was halted); ``take(v)``: visit ``v``'s filled block, in visit order. ``held``:
    visit -> the blocks taken and not handed back yet (the caller gives back what is left).
    ``half()``: once, at the first batch of the job's second half."""
    p = job.params
    bs, sc = p.batch_size, p.schema
    x_shape = (bs, sc.time_steps, sc.num_inputs)
    x_size = int(np.prod(x_shape))
    views = batch_views(p)
    visits = job.visits
    vi, u = 0, (visits[0].u0 if visits else 0)
    saved = None
    for index in range(job.first, job.batches):
        if job.halt.is_set():
            raise Halted
        if index == max(job.first, job.batches // 2):
            half()
        valid = min(bs, job.samples - index * bs)
        if valid <= 0:
            # Parts differ by one sample, so a shorter part can run out a batch early (docs/distributed.md,
            # "Parts"): it repeats its last real batch, pad = batch - 1.
            if index >= job.skip and not offer((_repeat(job, arena, saved, views), 1)):
                raise Halted
            continue
        pieces, need = [], valid
        while need:
            visit = visits[vi]
            if vi not in held:
                held[vi] = take(vi)
            n = min(need, visit.u1 - u)
            if n <= 0:  # past this part's last sample: counts gone wrong, never a loop without end
                raise LoaderError(f"epoch {job.epoch}: batch {index} asks for {need} samples past the end "
                                  f"of this part's {job.samples}: the iterator lost count of its batches")
            pieces.append((vi, held[vi].emit[u:u + n]))
            u += n
            need -= n
            if u == visit.u1 and vi + 1 < len(visits):
                vi, u = vi + 1, visits[vi + 1].u0
        flat = arena.batch()
        x = flat[:x_size].reshape(x_shape)
        labels = np.empty((valid, sc.label_floats), np.float32)
        days = np.empty(valid, np.float32)
        at = 0
        for v, codes in pieces:
            n = len(codes)
            _, labels[at:at + n], days[at:at + n] = held[v].buffer.gather(codes, out=x[at:at + n])
            at += n
        for v in {v for v, _ in pieces}:
            if v < vi or (v == vi and u == visits[v].u1):  # handed out whole: its buffer goes back
                arena.give_back(held.pop(v).buffer)
        fill_batch(p, views, flat, x, labels, days)
        if index == job.last_real and job.batches - 1 > job.last_real:
            saved = flat.copy()  # what the filler batches after it repeat
        if index >= job.skip and not offer((arena.hand_out(flat, views), valid)):
            raise Halted


def _repeat(job: EpochJob, arena: Arena, saved: np.ndarray, views: list) -> list:
    """A batch that repeats the last real one (docs/distributed.md, "Parts"), in a buffer of its own:
    the caller may have changed the original in place. A resume inside the repeated batches
    assembles the last real one again (``job.first``): never a batch of NaN for want of it."""
    if saved is None:
        raise LoaderError(f"epoch {job.epoch}: the batch to repeat after the last real one (batch "
                          f"{job.last_real}) was not assembled: the iterator lost count of its batches")
    flat = arena.batch()
    flat[:] = saved
    return arena.hand_out(flat, views)
