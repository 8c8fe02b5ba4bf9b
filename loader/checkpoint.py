"""``ShardIter.state_dict()``: what it holds and when a saved state can be continued."""

from __future__ import annotations

from typing import Any

from loader.errors import LoaderError

__all__ = ["STATE_VERSION", "state_of", "check_state"]

STATE_VERSION = 3  # 3: parts balanced by samples, readers over exact record ranges
MUST_MATCH = ("batch_size", "num_parts", "part_index", "shuffle", "last_batch", "seed")


def state_of(it: Any) -> dict:
    """Where iterator ``it`` is: enough to continue the same epoch in a new process."""
    params = it._params
    return {
        "version": STATE_VERSION,
        "manifest": str(it.manifest_path),
        "generation": it.plan.generation,
        "fingerprint": it.plan.fingerprint,
        "shards": [s.to_json() for s in it.plan.shards],
        "dates": list(it.dates) if it.dates else None,
        "epoch": it.epoch,
        "seed": it.seed,
        "batches": it._cursor,
        "batch_size": it.batch_size,
        "num_parts": it.num_parts,
        "part_index": it.part_index,
        "shuffle": it.shuffle,
        "last_batch": it.last_batch,
        "readers": params.readers,
        "native_batch": params.native_batch,
        "shuffle_buffer": params.buffer_records,
        "pinned": it._choice.pin,
    }


def check_state(it: Any, state: dict) -> None:
    """LoaderError unless iterator ``it`` can continue from ``state``."""
    version = state.get("version")
    if version == 2 and state.get("batches"):
        raise LoaderError(f"state_dict version 2 was saved mid-epoch by a loader that split parts and readers "
                          f"by records: this one cannot continue that order; resume from the start of epoch "
                          f"{state.get('epoch')} (set 'batches' to 0) or of the next one")
    if version not in (2, STATE_VERSION):
        raise LoaderError(f"state_dict version {version!r}, expected {STATE_VERSION}")
    for key in MUST_MATCH:
        if state[key] != getattr(it, key):
            raise LoaderError(f"state_dict was saved with {key}={state[key]!r}, this iterator has "
                              f"{getattr(it, key)!r}")
    if state["fingerprint"] != it.schema.fingerprint:
        raise LoaderError("state_dict was saved for another schema")
