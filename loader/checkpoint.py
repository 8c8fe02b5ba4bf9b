"""``ShardIter.state_dict()``: where in the epoch's order (:mod:`loader.pipeline.order`) an
iterator is, and when a saved state can be continued (of a :class:`loader.reader.Reader`).

A state holds what shapes the order (the shards and selection, seed, shuffle, the order's
``canonical_parts`` and ``block``) and the phases read so far (``num_parts``, ``batch_size``,
batches each part read), and nothing that depends on the cache, the prefetch and decode
settings or the store's kind: those may all change between saving and loading. Nor the loading
iterator's own settings: which part it reads, its batch size, its part count and ``last_batch``
(what is left of the order after the phases does not depend on it: a padded batch counts as a
full one, a discarded tail is left). States written before these were left out carried
``manifest``, ``batches``, ``samples``, ``batch_size``, ``num_parts``, ``part_index`` and
``last_batch``, which nothing read: such a state still loads (its digest covers the keys it has).
"""

from __future__ import annotations

import hashlib
import json
import operator
from typing import Any, Optional

import numpy as np

from loader.errors import LoaderError, StoreUnreachableError, as_loader_errors
from loader.pipeline.order import MAX_CANONICAL_PARTS, Phase, remainder
from loader.source.generations import generation_of
from loader.source.selection import normalize_dates, select_shards
from loader.state_versions import STATE_VERSION, check_version
from shardgen.store.manifest import Manifest, ShardEntry

__all__ = ["STATE_VERSION", "state_of", "check_state", "rewound", "at_end", "ends_epoch", "check_origin"]

MUST_MATCH = ("seed", "shuffle")


def state_of(reader: Any, manifest: str) -> dict:
    """Where ``reader`` is: enough to continue the same epoch in a new process. ``manifest`` is
    not written (the store may move or change kind); it goes once ``Reader.state`` stops passing it."""
    p, plan = reader.params, reader.plan
    phases = [list(ph) for ph in reader.phases] + [[p.num_parts, p.batch_size, reader.cursor]]
    state = {
        "version": STATE_VERSION,
        "generation": plan.generation,
        "fingerprint": plan.fingerprint,
        "shards": [s.to_json() for s in plan.shards],
        "dates": list(reader.dates) if reader.dates else None,
        "epoch": reader.epoch,
        "seed": p.seed,
        "shuffle": p.shuffle,
        "canonical_parts": p.canonical_parts,
        "block": p.block,
        "stripes": p.stripes,
        "phases": phases,
        "pinned": reader.choice.pin,
    }
    return {**state, "sha256": _digest(state)}


def _digest(state: dict) -> str:
    """sha256 of every field but itself: a state is written by ``state_of`` alone."""
    body = {k: v for k, v in state.items() if k != "sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def check_state(reader: Any, state: dict) -> None:
    """LoaderError unless ``reader`` can continue from ``state``."""
    if not isinstance(state, dict):
        raise LoaderError(f"state_dict must be the dict state_dict() returned, got {type(state).__name__}")
    check_version(state)
    try:
        sound = state.get("sha256") == _digest(state)
    except (TypeError, ValueError):  # not JSON
        sound = False
    if not sound:
        raise LoaderError("state_dict differs from what state_dict() saved (its 'sha256' does not match its "
                          "fields): it was altered or damaged; load an unaltered copy")
    check_origin(state, reader)
    for key in MUST_MATCH:
        if state.get(key) != getattr(reader.params, key):
            raise LoaderError(f"state_dict was saved with {key}={state.get(key)!r}, this iterator has "
                              f"{getattr(reader.params, key)!r}")
    if state.get("fingerprint") != reader.schema.fingerprint:
        raise LoaderError("state_dict was saved for another schema")
    _check_fields(state)


def _check_fields(state: dict) -> None:
    """LoaderError naming the first field of ``state`` that could not have been saved by
    ``state_of`` (a hand-edited or damaged state), before the epoch being read is let go."""
    def want(ok: bool, key: str, what: str) -> None:
        if not ok:
            raise LoaderError(f"state_dict {key!r} must be {what}, got {state.get(key)!r}: the state was altered "
                              "or damaged after state_dict() saved it")

    def integer(key: str, low: int, high: float = float("inf")) -> None:
        v = state.get(key)
        want(isinstance(v, int) and not isinstance(v, bool) and low <= v <= high, key,
             f"an integer in [{low}, {high}]" if high != float("inf") else f"an integer >= {low}")

    for key, low in (("epoch", 0), ("generation", 0), ("block", 1)):
        integer(key, low)
    integer("canonical_parts", 1, MAX_CANONICAL_PARTS)
    pinned = state.get("pinned")
    want(pinned is None or (isinstance(pinned, int) and not isinstance(pinned, bool) and pinned >= 0), "pinned",
         "null or a generation number")
    want(isinstance(state.get("stripes", False), bool), "stripes", "true or false")
    shards = state.get("shards")
    want(isinstance(shards, list) and len(shards) > 0, "shards", "the non-empty list of the epoch's shards")
    try:
        entries = [ShardEntry.from_json(s) for s in shards]
        normalize_dates(state.get("dates"))
    except (KeyError, TypeError, ValueError, LoaderError) as exc:
        raise LoaderError(f"state_dict 'shards' or 'dates' cannot be read ({exc}): the state was altered or "
                          "damaged after state_dict() saved it") from None
    phases = state.get("phases")
    want(isinstance(phases, list) and all(isinstance(ph, list) and len(ph) == 3 and all(
        isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 2**31 for v in ph) and
        1 <= ph[0] <= MAX_CANONICAL_PARTS and ph[1] >= 1 for ph in phases), "phases",
        f"a list of [num_parts <= {MAX_CANONICAL_PARTS}, batch_size, batches]")
    try:
        remainder(sum(e.samples for e in entries), [Phase(*ph) for ph in phases])
    except ValueError as exc:
        raise LoaderError(f"state_dict 'phases' {phases!r}: {exc}") from None


def rewound(state: dict, batches: int) -> dict:
    """``state`` (of ``state_of``) as it was ``batches`` batches earlier in its last phase: the
    batches handed out that the caller has not trained (``ShardIter.state_dict(untrained=...)``)."""
    *done, (parts, size, read) = state["phases"]
    batches = count_of(batches)
    if batches == 0:
        return state
    if not (batches is not None and 0 < batches <= read):
        raise LoaderError(f"untrained={batches!r}: expected a number of batches from 0 to the {read} this "
                          f"iterator handed out since its epoch (or its resumed state) began")
    body = {k: v for k, v in state.items() if k != "sha256"}
    body["phases"] = [*done, [parts, size, read - batches]]
    return {**body, "sha256": _digest(body)}


def count_of(value: object) -> Optional[int]:
    """``value`` as a number of batches: a Python or numpy integer, never a bool (None: not one)."""
    if isinstance(value, (bool, np.bool_)):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def at_end(state: dict, *, ended_now: bool = True) -> dict:
    """``state`` (of ``state_of``) saved after its epoch's end was signalled (``next()`` raised
    StopIteration: ``Module.fit``'s ``epoch_end_callback``, or after a loop's ``for``), as the state of
    the next epoch's start: ``state["epoch"]`` is always the epoch a state resumes, so
    ``fit(begin_epoch=state["epoch"])`` (or a loop from that epoch) goes on with the next epoch's first
    batch, whatever shape loads it. Marked ``ended``: a ``reset()`` right after loading it starts that
    epoch rather than the one after. ``ended_now=False``: ``state`` is already that start (nothing was
    read since such a state was loaded): only marked. A state saved after the last batch but before
    StopIteration keeps the meaning of a loop that may still ask: the rest of its epoch, nothing."""
    body = {k: v for k, v in state.items() if k != "sha256"}
    if ended_now:
        parts, size, _ = body["phases"][-1]
        body["epoch"], body["phases"] = body["epoch"] + 1, [[parts, size, 0]]
    body["ended"] = True
    return {**body, "sha256": _digest(body)}


def ends_epoch(state: dict) -> bool:
    """Whether ``state`` was marked by ``at_end`` (LoaderError for a value ``at_end`` never writes)."""
    ended = state.get("ended")
    if ended is not None and ended is not True:
        raise LoaderError(f"state_dict 'ended' must be true or absent, got {ended!r}: the state was altered or "
                          "damaged after state_dict() saved it")
    phases = state.get("phases")
    if ended and not (isinstance(phases, list) and len(phases) == 1 and phases[0][2] == 0):
        raise LoaderError(f"state_dict 'ended' marks an epoch's start, but its 'phases' {phases!r} have read batches "
                          "of it: the state was altered or damaged after state_dict() saved it")
    return ended is True


def _span(shards: list) -> str:
    """What a list of shard entries covers, as a message names it."""
    dates = sorted(s.date for s in shards)
    return f"{len(dates)} shards, {dates[0]} .. {dates[-1]}" if dates else "no shards"


def check_origin(state: dict, reader: Any, known: tuple = (), listed: frozenset = frozenset()) -> None:
    """LoaderError when ``state`` was saved on another store, or on a generation whose files this
    store no longer holds. When this store keeps generation N's snapshot (N: the state's), the state's
    shards must be exactly the ones N selects for the state's dates, by file name and sha256. A shard
    file of the state that this store lists (``known``: entries this process checked or the store
    lists; default the reader's plan and generation) with other contents is refused; so, with
    ``listed`` (every file name the newest manifest lists, live and retired), is one this store does
    not list at all, and one listed only as retired (no sha256) that no kept snapshot lists with the
    state's sha256 (its bytes cannot be checked without reading them). The message names what the
    state records and what this iterator reads."""
    try:
        mine = [ShardEntry.from_json(s) for s in state["shards"]]
        generation = state.get("generation")
        dates = normalize_dates(state.get("dates"))
    except (KeyError, TypeError, ValueError, LoaderError):
        return  # not a state's shard list: _check_fields names it
    if not mine:
        return  # _check_fields names it
    plan = reader.plan
    if plan is None or state.get("fingerprint") != reader.schema.fingerprint:  # closed; another schema: said so
        return
    by_rec = {s.rec: s for s in (known or (*plan.shards, *reader.manifest.shards))}
    here = f"this iterator reads generation {plan.generation} of {reader.where} ({_span(list(plan.shards))})"
    saved = f"the state records generation {generation} ({_span(mine)})"
    snapshot = _snapshot(reader, generation)
    if snapshot is not None:  # this store's generation N: the state's shards must be its own
        theirs = {s.rec: s for s in select_shards(snapshot, dates)}
        differ = [s for s in mine if s.rec not in theirs or theirs[s.rec].sha256 != s.sha256]
        missing = sorted(set(theirs) - {s.rec for s in mine})
        if differ or missing:
            s = differ[0] if differ else theirs[missing[0]]
            what = (f"its shard {s.date} ({s.rec}) has sha256 {s.sha256[:12]}, this store's generation "
                    f"{generation} lists that name with {theirs[s.rec].sha256[:12]}" if differ and s.rec in theirs
                    else f"its shard {s.date} ({s.rec}) is not in this store's generation {generation}" if differ
                    else f"this store's generation {generation} also selects {s.date} ({s.rec}), the state does not")
            more = f", {len(missing)} of the generation's are not in the state" if missing else ""
            raise LoaderError(f"state_dict was saved on another store: {what} ({len(differ)} of its {len(mine)} "
                              f"shards differ{more}); {saved}, {here}. Load a state saved on this store")
    other = [s for s in mine if s.rec in by_rec and by_rec[s.rec].sha256 != s.sha256]
    unchecked = [s for s in mine if snapshot is None and listed and s.rec not in by_rec and s.rec in listed]
    if unchecked:  # listed as retired only: no sha256 here; a kept snapshot may list the file with one
        kept = _kept_entries(reader, {s.rec for s in unchecked})
        other += [s for s in unchecked if s.rec in kept and kept[s.rec].sha256 != s.sha256]
        by_rec = {**kept, **by_rec}
        unverified = [s for s in unchecked if s.rec not in kept]
        if unverified and not other:
            s = unverified[0]
            raise LoaderError(f"state_dict's shard {s.date} ({s.rec}) cannot be checked: this store lists that "
                              f"file only as retired and keeps no snapshot that records its sha256 "
                              f"({len(unverified)} of its {len(mine)} shards); the state was saved on another "
                              f"store, or on a generation of this one whose snapshot gc has deleted, and reading "
                              f"bytes not known to be the state's is refused; {saved}, {here}")
    if other:
        s = other[0]
        newest = max([reader.manifest.generation, plan.generation, *_generations(reader)])
        rebuilt = f"whose file {s.rec} gc deleted and a later build wrote again with other bytes"
        how = (f"saved on this store's generation {generation}, {rebuilt}" if snapshot is not None else
               "saved on another store" if not isinstance(generation, int) or generation > newest else
               f"saved on another store, or on this store's generation {generation} (its snapshot is gone), {rebuilt}")
        todo = "a state saved on this store" if how == "saved on another store" else "a state of a kept generation"
        raise LoaderError(f"state_dict was {how}: its shard {s.date} ({s.rec}) has sha256 "
                          f"{s.sha256[:12]}, this store's file of that name {by_rec[s.rec].sha256[:12]} "
                          f"({len(other)} of its {len(mine)} shards differ); {saved}, {here}. Load {todo}")
    gone = [s for s in mine if listed and s.rec not in by_rec and s.rec not in listed]
    if gone:
        s = gone[0]
        raise LoaderError(f"state_dict's shard {s.date} ({s.rec}) is not in this store ({len(gone)} of its "
                          f"{len(mine)} shards are not): the state was saved on another store, or on a generation "
                          f"whose files gc has deleted; {saved}, {here}")


def _snapshot(reader: Any, generation: object) -> Optional[Manifest]:
    """This store's generation ``generation`` (None: gone, or never published)."""
    if not isinstance(generation, int) or isinstance(generation, bool):
        return None
    if generation == reader.manifest.generation:  # the newest, read already: nothing is read again
        return reader.manifest
    try:
        return generation_of(reader.store, generation)
    except StoreUnreachableError:
        raise
    except LoaderError:
        return None


def _generations(reader: Any) -> list:
    with as_loader_errors():
        return list(reader.store.snapshot_generations())


def _kept_entries(reader: Any, recs: set) -> dict:
    """rec -> the entry of the newest kept snapshot that lists it (with its sha256), for ``recs``."""
    found: dict = {}
    for n in sorted(_generations(reader), reverse=True):
        snapshot = _snapshot(reader, n)
        for s in snapshot.shards if snapshot is not None else ():
            if s.rec in recs:
                found.setdefault(s.rec, s)
        if len(found) == len(recs):
            break
    return found
