"""``ShardIter.state_dict()``: where in the epoch's order (:mod:`loader.pipeline.order`) an
iterator is, and when a saved state can be continued (of a :class:`loader.reader.Reader`).

A state holds what shapes the order (the shards and selection, seed, shuffle, the order's
``canonical_parts`` and ``block``) and the phases read so far (``num_parts``, ``batch_size``,
batches each part read), and nothing that depends on the cache, the readers, the prefetch
settings or the store's kind: those may all change between saving and loading.
"""

from __future__ import annotations

from typing import Any

from loader.errors import LoaderError
from loader.pipeline.order import Phase, count, remainder

__all__ = ["STATE_VERSION", "state_of", "check_state"]

STATE_VERSION = 4  # 4: the order is a value; a state lists the phases read (any num_parts resumes)
MUST_MATCH = ("seed", "shuffle")


def state_of(reader: Any, manifest: str) -> dict:
    """Where ``reader`` is: enough to continue the same epoch in a new process."""
    p, plan = reader.params, reader.plan
    phases = [list(ph) for ph in reader.phases] + [[p.num_parts, p.batch_size, reader.cursor]]
    total = plan.samples
    consumed = total - count(remainder(total, [Phase(*ph) for ph in phases]))
    return {
        "version": STATE_VERSION,
        "manifest": manifest,
        "generation": plan.generation,
        "fingerprint": plan.fingerprint,
        "shards": [s.to_json() for s in plan.shards],
        "dates": list(reader.dates) if reader.dates else None,
        "epoch": reader.epoch,
        "seed": p.seed,
        "shuffle": p.shuffle,
        "canonical_parts": p.canonical_parts,
        "block": p.block,
        "phases": phases,
        "batches": reader.cursor,
        "samples": consumed,  # of the epoch's order, by every part
        "batch_size": p.batch_size,
        "num_parts": p.num_parts,
        "part_index": p.part_index,
        "last_batch": p.last_batch,
        "pinned": reader.choice.pin,
    }


def check_state(reader: Any, state: dict) -> None:
    """LoaderError unless ``reader`` can continue from ``state``."""
    version = state.get("version")
    if version in (2, 3):
        raise LoaderError(f"state_dict version {version} was saved by a loader whose order depended on its cache, "
                          f"readers and store settings: this one cannot find its place in the computed order. "
                          f"Start epoch {state.get('epoch')} again (a new ShardIter, then reset() "
                          f"{state.get('epoch')} times) or go on with the next one; states saved from now on "
                          f"resume exactly")
    if version != STATE_VERSION:
        raise LoaderError(f"state_dict version {version!r}, expected {STATE_VERSION}")
    for key in MUST_MATCH:
        if state[key] != getattr(reader.params, key):
            raise LoaderError(f"state_dict was saved with {key}={state[key]!r}, this iterator has "
                              f"{getattr(reader.params, key)!r}")
    if state["fingerprint"] != reader.schema.fingerprint:
        raise LoaderError("state_dict was saved for another schema")
    phases = state.get("phases")
    if not isinstance(phases, list) or not all(isinstance(ph, list) and len(ph) == 3 and all(
            isinstance(v, int) and v >= 0 for v in ph) and ph[0] >= 1 and ph[1] >= 1 for ph in phases):
        raise LoaderError(f"state_dict 'phases' must be a list of [num_parts, batch_size, batches], got {phases!r}")
