"""``ShardIter.state_dict()``: what it holds and when a saved state can be continued (of a
:class:`loader.reader.Reader`)."""

from __future__ import annotations

from typing import Any

from loader.errors import LoaderError

__all__ = ["STATE_VERSION", "state_of", "check_state"]

STATE_VERSION = 3  # 3: parts balanced by samples, readers over exact record ranges
MUST_MATCH = ("batch_size", "num_parts", "part_index", "shuffle", "last_batch", "seed")


def state_of(reader: Any, manifest: str) -> dict:
    """Where ``reader`` is: enough to continue the same epoch in a new process."""
    p, plan = reader.params, reader.plan
    return {
        "version": STATE_VERSION,
        "manifest": manifest,
        "generation": plan.generation,
        "fingerprint": plan.fingerprint,
        "shards": [s.to_json() for s in plan.shards],
        "dates": list(reader.dates) if reader.dates else None,
        "epoch": reader.epoch,
        "seed": p.seed,
        "batches": reader.cursor,
        "batch_size": p.batch_size,
        "num_parts": p.num_parts,
        "part_index": p.part_index,
        "shuffle": p.shuffle,
        "last_batch": p.last_batch,
        "readers": p.readers,
        "native_batch": p.native_batch,
        "shuffle_buffer": p.buffer_records,
        "pinned": reader.choice.pin,
    }


def check_state(reader: Any, state: dict) -> None:
    """LoaderError unless ``reader`` can continue from ``state``."""
    version = state.get("version")
    if version == 2 and state.get("batches"):
        raise LoaderError(f"state_dict version 2 was saved mid-epoch by a loader that split parts and readers "
                          f"by records: this one cannot continue that order; resume from the start of epoch "
                          f"{state.get('epoch')} (set 'batches' to 0) or of the next one")
    if version not in (2, STATE_VERSION):
        raise LoaderError(f"state_dict version {version!r}, expected {STATE_VERSION}")
    for key in MUST_MATCH:
        if state[key] != getattr(reader.params, key):
            raise LoaderError(f"state_dict was saved with {key}={state[key]!r}, this iterator has "
                              f"{getattr(reader.params, key)!r}")
    if state["fingerprint"] != reader.schema.fingerprint:
        raise LoaderError("state_dict was saved for another schema")
