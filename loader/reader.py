"""``Reader``: what a ``ShardIter`` reads and where it is. It owns the store it reads, the
generation choice, the reading core (``Pipeline``: the plan and the threads), the cursor,
``reset()`` and the saved state; the ``ShardIter`` around it is only MXNet's ``DataIter`` face.

Epochs are exact: every sample of this part once, with ``pad`` counted here. The order is a value
(:mod:`loader.pipeline.order`): a function of seed, epoch, the selected shards and the order's own
settings alone. A state says where in it the iterator is (the phases read so far), so it resumes
with any cache, ``prefetch_buffer`` or store, on any number of parts, reading nothing consumed.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import weakref
from typing import Callable, Optional

from loader.checkpoint import check_origin, check_state, state_of
from loader.errors import LoaderError, StoreUnreachableError, as_loader_errors
from loader.pipeline.batches import StreamParams, batch_floats
from loader.pipeline.job import order_spec
from loader.pipeline.memory import Arena, caller_batches_held
from loader.pipeline.order import EpochOrder, Phase, slice_of
from loader.pipeline.parts import split_phase
from loader.pipeline.pipeline import Pipeline, join_closing
from loader.pipeline.settings import buffers_alive, check_label_names, check_memory, sized
from loader.source.generations import Choice, held_again, newest
from loader.source.plan import EpochPlan, make_plan
from loader.source.selection import DateRange, normalize_dates, select_shards
from shardgen.store import Store
from shardgen.store.lease import Lease
from shardgen.store.manifest import Manifest, ShardEntry
from shardgen.store.naming import MANIFEST_NAME

__all__ = ["Reader"]

log = logging.getLogger(__name__)


class Reader:
    """One part of a store, epoch after epoch: ``take()`` the next batch, ``reset()`` to the next
    epoch on the generation ``choice`` picks, ``state()``/``load()`` to resume."""

    def __init__(self, store: Store, root, manifest: Manifest, params: StreamParams, *, choice: Choice,
                 dates: DateRange, selected: tuple, verify: str, memory: dict,
                 sizing: Optional[Callable[[tuple], tuple]] = None):
        """``selected``: the shards of ``manifest`` that ``dates`` (normalized) select; ``sizing(shards)``:
        the settings (and memory) another generation's shards are read with (``settings.sized``)."""
        self.store, self.root, self.params, self.choice = store, root, params, choice
        self.sizing = sizing
        self.manifest = manifest  # the generation read now: reset() goes on with it if the store is out of reach
        self.schema = manifest.schema
        self.verify, self.memory = verify, memory
        self.dates = dates
        self.epoch = 0
        self.cursor = self.batches = self.part_samples = 0
        self.phases: tuple = ()  # the phases of this epoch read before the current one (a resumed state)
        self.who = who = f"iter-{id(self)}"  # what the store knows this reader by
        cap = store.group_bytes()  # None: no bound on what reading holds
        if cap is not None:
            join_closing(60)  # iterators dropped unclosed let go of their files and claim first (their close thread)
        with as_loader_errors():
            store.claim(who)  # a bounded cache is one iterator's alone
        # The lease tells gc which generation we read.
        self.pipeline = Pipeline(Lease(store), cap, release_claim=functools.partial(store.let_go, who), who=who)
        me = weakref.ref(self)  # threads reach the pipeline, never the reader (its finalizer must run)
        self.pipeline.on_ahead = lambda: (me() or _Gone)._ahead_opened()
        self._finalizer = weakref.finalize(self, self.pipeline.close_when_free)  # dropped: shutdown.STEPS
        # Batch buffers: the caller's queue and a few held by MXNet.
        self.pipeline.arena = Arena(self.schema, batch_floats(params), keep=caller_batches_held(params.prefetch_buffer),
                                  buffers=buffers_alive(params, selected))
        try:
            self._start(self._plan_for(manifest, selected))
        except BaseException:
            self.close()
            raise

    @classmethod
    def open(cls, store: Store, root, *, generation: Optional[int], dates: DateRange, label_names: object,
             shuffle_buffer: object, verify: str, **knobs: object) -> Reader:
        """The reader a ``ShardIter``'s arguments make (``knobs``: its settings, checked by ``check_arguments``):
        the generation chosen (``generation`` pins one), the labels asked for, the shards of ``dates``,
        the settings and what they hold in memory (a LoaderError before anything is allocated)."""
        choice = Choice(pin=generation)
        manifest = choice.manifest(store)
        schema = manifest.schema
        labels = check_label_names(label_names, [lab.name for lab in schema.labels])
        dates = normalize_dates(dates)
        selected = select_shards(manifest, dates)
        # An object store fetches whole files: its blocks hold consecutive shard pieces (stripes would
        # fetch every file for every block), so its part is one block wherever that fits (settings).
        stripes = knobs.pop("stripes", None)
        sizing = functools.partial(sized, schema, shuffle_buffer=shuffle_buffer, label_names=labels,
                                   knobs={**knobs, "stripes": store.in_place if stripes is None else stripes})
        params, memory = sizing(selected)
        return cls(store, root, manifest, params, choice=choice, dates=dates, selected=selected, verify=verify,
                   memory=memory, sizing=sizing)

    def move_to(self, manifest: Manifest, dates: DateRange) -> None:
        """This epoch from its start on ``manifest``'s generation (``for_kvstore``'s first agreement): the shards
        ``dates`` (this epoch's) select, their settings, a plan; ``self.dates`` applies from the next reset()."""
        selected = select_shards(manifest, dates)
        params, memory = self.sizing(selected)
        plan = self._plan_for(manifest, selected)
        self.end_epoch()
        self.pipeline.arena.new_blocks(buffers_alive(params, selected))
        self.params, self.memory = params, memory
        self._start(plan)
        self.manifest = manifest

    # -- where it is ------------------------------------------------------------------------------

    @property
    def where(self) -> str:
        """The store's manifest, as messages name it."""
        return self.store.where(MANIFEST_NAME)

    @property
    def plan(self) -> Optional[EpochPlan]:
        return self.pipeline.plan

    @property
    def dates_per_block(self) -> Optional[int]:
        """The fewest shards (dates) a block of this epoch's order that this part reads spans."""
        job = self.pipeline.current
        return job.dates_per_block if job is not None else None

    @property
    def running(self) -> bool:
        """An epoch is being read (``reset()`` did not fail, ``close()`` was not called)."""
        job = self.pipeline.current
        return job is not None and not job.halt.is_set() and not self.pipeline.closed

    # -- epochs -----------------------------------------------------------------------------------

    def take(self) -> tuple[list, int]:
        """The next batch's arrays and pad (the caller checked that the epoch has one left)."""
        if not self.running:
            raise LoaderError(f"{self.where}: no epoch to read: the last reset() failed; fix the "
                              "cause (e.g. the date selection) and call reset() again")
        arrays, valid = self.pipeline.get()
        self.cursor += 1
        return arrays, self.params.batch_size - valid if self.params.last_batch == "pad" else 0

    def reset(self) -> None:
        """Start the next epoch on the generation the choice picks (the newest, agreed or pinned)."""
        self.end_epoch()
        manifest = self.choice.manifest(self.store, held=self.manifest)
        if manifest.schema.fingerprint != self.schema.fingerprint:
            raise LoaderError(f"{self.where}: the store's schema changed (fingerprint "
                              f"{self.schema.fingerprint} -> {manifest.schema.fingerprint}); make a new ShardIter")
        current = self.plan
        if current is None:  # close() from another thread while this reset() ran
            raise LoaderError(f"{self.where}: this ShardIter was closed (by another thread) "
                              "during reset()")
        try:
            self._start_next(self._next_plan(manifest, current), current)
        except StoreUnreachableError as exc:
            # The manifest came, then the store went before the new generation's shards did. Alone
            # (no kvstore agreement, no pin), go on with the generation held, as when the manifest
            # itself cannot be had; the next reset() asks again.
            if self.choice.kv is not None or self.choice.pin is not None or manifest is self.manifest:
                raise
            manifest = held_again(exc, self.manifest)
            self._start_next(self._next_plan(manifest, current), current)
        self.manifest = manifest

    def _start_next(self, plan: EpochPlan, current: EpochPlan) -> None:
        if plan.folder == current.folder:
            self.pipeline.recheck(plan, self.schema, self.verify)
        self._start(plan, epoch=self.epoch + 1, wait=False)

    def _next_plan(self, manifest: Manifest, current: EpochPlan) -> EpochPlan:
        shards = select_shards(manifest, self.dates)
        if shards != current.shards:
            # A cache that holds the part fetches its new shards now, so a store lost since the
            # manifest came is met here, and the held generation is read again (``reset``).
            with as_loader_errors():
                self.store.fetch_part(self._part_of(manifest), who=f"{self.who}-next", schema=manifest.schema)
            return self._plan_for(manifest, shards)
        if manifest.generation != current.generation:  # same files: only the generation moves on
            return dataclasses.replace(current, generation=manifest.generation)
        return current

    def end_epoch(self) -> None:
        """End this epoch: no batch of it is handed out any more (a ``reset()`` or ``load()`` starts the next one)."""
        self.pipeline.end_current()

    def _plan_for(self, manifest: Manifest, shards: tuple) -> EpochPlan:
        with as_loader_errors():
            self.store.check_room(list(shards))
        return make_plan(self.store, self.root, manifest, shards, verify=self.verify, who=self.who)

    def _part_of(self, manifest: Manifest) -> tuple:
        """The shards of ``manifest`` this part reads in the next epoch (fetched ahead of a new generation)."""
        shards = select_shards(manifest, self.dates)
        order = EpochOrder([s.samples for s in shards], order_spec(self.params), self.epoch + 1)
        mine = slice_of([(0, order.total)], self.params.num_parts, self.params.part_index)
        return tuple(shards[k] for k in sorted(order.shards_of(mine)))

    def _start(self, plan: EpochPlan, *, phases: tuple = (), skip: int = 0, epoch: Optional[int] = None,
               wait: bool = True) -> None:
        """Make ``plan`` this reader's, reading ``epoch`` (default: the current one) after ``phases``
        and ``skip`` batches of this phase. Nothing changes if the epoch cannot start (e.g. a part
        smaller than a batch): the error is raised and the plan's files are let go. ``wait``
        (``ShardIter()``, ``load_state_dict()``): until the first read is open, its files fetched
        and checked, so what stops the epoch (a shard refused, the store out of reach) is raised
        here. ``reset()`` waits so for an object store only (out of reach, it goes on with the
        generation held); a folder's shard refused then is raised by ``next()``."""
        epoch = self.epoch if epoch is None else epoch
        job = self.pipeline.start(plan, epoch, self.params, phases, skip,
                                  wait=wait or not (plan.files.eager or self.store.in_place))
        self.epoch, self.phases = epoch, tuple(phases)
        self.part_samples, self.batches = job.samples, job.batches
        self.cursor = skip

    def _ahead_opened(self) -> None:
        """Half way through this epoch (``Pipeline``): a cache fetches the newest generation's part
        ahead too, once this epoch's files are fetched (``done_fetching``), unless pinned."""
        job = self.pipeline.current
        if self.choice.pin is None and job is not None:
            self.store.fetch_ahead(self._part_of, after=job.done_fetching)

    # -- resumption -------------------------------------------------------------------------------

    def state(self, manifest_path: str) -> dict:
        """Where this reader is: enough to continue the same epoch in a new process."""
        return state_of(self, manifest_path)

    def check(self, state: dict) -> None:
        """LoaderError unless this reader can continue from ``state``."""
        check_state(self, state)

    def load(self, state: dict, before_end: Callable[[], None] = lambda: None) -> bool:
        """Continue from ``state``: same shards, same epoch order, every window not consumed yet
        read once. When the last phase of ``state`` was read with this iterator's ``num_parts`` and
        ``batch_size``, it goes on with that phase (the same remaining batches); else what is left
        is split among this iterator's parts. Only the blocks from the resumption point on are read.
        ``before_end()`` is called before this epoch's stream ends. True (a new stream started)."""
        check_state(self, state)
        dates = normalize_dates(state.get("dates"))  # the saved selection, from the next reset() on
        shards = tuple(ShardEntry.from_json(s) for s in state["shards"])
        p = self.params
        phases = tuple(Phase(*map(int, ph)) for ph in state["phases"])
        skip = 0
        if phases and phases[-1][:2] == (p.num_parts, p.batch_size):
            phases, skip = phases[:-1], phases[-1].batches
        params = dataclasses.replace(p, canonical_parts=int(state["canonical_parts"]), block=int(state["block"]),
                                     stripes=state.get("stripes") is True)
        memory = self.memory
        if params.block != p.block:  # buffers for the state's blocks
            per = p.block / max(1, p.buffer_records)
            params = dataclasses.replace(params, buffer_records=max(1, math.ceil(params.block / per)))
            memory = check_memory(params, f"a state's block of {params.block:,} samples", shards)
        # Everything that can refuse the state is asked before this epoch is let go: the phase it
        # resumes (an empty part), and the state's shards (opened and checked for a folder).
        split_phase(params, sum(s.samples for s in shards), phases, int(state["generation"]))
        manifest = newest(self.store)
        known = {s.rec: s for s in (*manifest.shards, *self.plan.shards)}  # files this process checked or lists
        listed = frozenset({*manifest.files(), *(r.rec for r in manifest.retired)})
        check_origin(state, self, tuple(known.values()), listed)  # another store's, or a deleted generation's
        for s in shards:  # a file checked before is not checked again: its entry must be the one it was checked for
            if s.rec in known and known[s.rec] != s:
                raise LoaderError(f"state_dict's entry of shard {s.date} ({s.rec}) differs from the store's "
                                  f"({s.windows or s.records} windows, the store says "
                                  f"{known[s.rec].windows or known[s.rec].records}): the state was altered or "
                                  "damaged after state_dict() saved it")
        if shards == self.plan.shards:  # the files read now: checked again if they changed (found by review:
            plan = self.plan  # the block kept whole from before a rewrite was served)
            self.pipeline.recheck(plan, self.schema, self.verify)
        else:
            plan = self._plan_for(manifest, shards)
        before_end()
        self.end_epoch()
        if params.block != p.block:
            self.pipeline.arena.new_blocks(buffers_alive(params, shards))
        self.dates, self.memory, self.params = dates, memory, params
        if state.get("pinned") is not None:
            self.choice = Choice(pin=state["pinned"])
        plan = dataclasses.replace(plan, generation=state["generation"])
        self._start(plan, phases=phases, skip=skip, epoch=int(state["epoch"]))
        self.manifest = manifest
        return True

    # -- the end ----------------------------------------------------------------------------------

    def close(self) -> None:
        """``shutdown.STEPS``: stop the native threads, let go of the files and the store's claim,
        drop the reader lease."""
        self._finalizer.detach()
        self.pipeline.close()


class _Gone:
    @staticmethod
    def _ahead_opened() -> None:
        pass

