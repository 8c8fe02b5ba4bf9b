"""One epoch of one part, as a value: what the loader thread fills and the producer thread cuts
into batches (:mod:`loader.pipeline.pipeline`).

What the part reads, and in which order, is the epoch's order (:mod:`loader.pipeline.order`):
this part's slice of what the phases before left, as *visits* of the order's blocks. Everything
here follows from ``(plan, epoch, params, phases, skip)``, so the next epoch's job is known while
this one is read (``successor``), and a job is replaced, never changed, when a ``reset()`` or a
state asks for another.
"""

from __future__ import annotations

import functools
import math
import threading
from typing import Optional, Sequence

from loader.pipeline.batches import StreamParams
from loader.pipeline.order import EpochOrder, OrderSpec, Phase, cut, slice_of
from loader.pipeline.parts import split_phase
from loader.source.plan import EpochPlan

__all__ = ["EpochJob", "order_spec"]


def order_spec(p: StreamParams) -> OrderSpec:
    return OrderSpec(p.seed, p.shuffle, p.canonical_parts, p.block, p.schema.pack if p.schema is not None else 1,
                     p.stripes)


class EpochJob:
    """Epoch ``epoch`` of ``plan`` for the part ``params`` reads, after ``phases`` (a resumed state)
    and ``skip`` batches of this phase. LoaderError (``split_phase``) if the parts cannot split it."""

    def __init__(self, plan: EpochPlan, epoch: int, params: StreamParams, phases: Sequence[Phase] = (),
                 skip: int = 0):
        self.plan, self.epoch, self.params = plan, int(epoch), params
        self.phases, self.skip = tuple(phases), int(skip)
        self.order = EpochOrder(plan.sample_counts, order_spec(params), self.epoch)
        rest, self.part_samples, self.batches = split_phase(params, self.order.total, self.phases, plan.generation)
        mine = slice_of(rest, params.num_parts, params.part_index)
        self.samples = self.part_samples[params.part_index]
        bs = params.batch_size
        self.last_real = math.ceil(self.samples / bs) - 1  # batches after it (if any) repeat it (parts)
        self.first = min(self.skip, max(self.last_real, 0)) if self.batches else 0  # the first batch assembled
        self.visits = list(self.order.visits(cut(mine, self.first * bs, self.samples)))
        # What the threads and the caller tell each other about this job (under the pipeline's lock):
        self.halt = threading.Event()  # replaced by another job, or the iterator closed: its work stops
        self.opened = threading.Event()  # its first read is open (or it failed, or it reads nothing)
        self.done_fetching = threading.Event()  # the loader made its last block's files local
        self.error: Optional[BaseException] = None  # what stopped the loader on it
        self.open_error: Optional[BaseException] = None  # that error, if it came before its first read was open
        self.loading = self.producing = False  # a thread took it
        self.loaded = self.produced = False  # a thread finished it (loaded: not when it failed or was halted)
        self.followed = False  # the loader asked for its successor
        self.past_half = False  # the producer handed out half its batches

    def successor(self) -> EpochJob:
        """The next epoch of the same plan and settings, from its start: what ``reset()`` most often asks."""
        return EpochJob(self.plan, self.epoch + 1, self.params)

    def is_for(self, plan: EpochPlan, epoch: int, params: StreamParams, phases: tuple, skip: int) -> bool:
        """Whether this job reads what ``(plan, epoch, params, phases, skip)`` asks (a new generation
        of the same files is the same read), and may go on (it did not fail)."""
        return (self.plan.folder == plan.folder and self.epoch == epoch and self.params == params
                and self.phases == tuple(phases) and self.skip == skip and self.error is None
                and not self.halt.is_set())

    def renamed(self, plan: EpochPlan) -> None:
        """The same files as generation ``plan.generation`` (a manifest that only moved on)."""
        self.plan = plan

    @functools.cached_property
    def dates_per_block(self) -> Optional[int]:
        """The fewest shards a block this job reads spans (computed once: ``it.stats`` asks)."""
        pieces = {(v.c, v.b): self.order.block(v.c, v.b).pieces for v in self.visits}
        return min((len({k for k, _, _ in p}) for p in pieces.values()), default=None)
