"""The versions of ``ShardIter.state_dict()`` (:mod:`loader.checkpoint`): which older states this
loader can still continue, and what a refused one's owner should do instead."""

from __future__ import annotations

from loader.errors import LoaderError

__all__ = ["STATE_VERSION", "check_version"]

STATE_VERSION = 6  # 4: the order is a value; a state lists the phases read; 5: blocks without a ramp, of equal size;
# 6: a shuffled part of several blocks reads them in stripes (a piece of every date each)


def check_version(state: dict) -> None:
    """LoaderError unless ``state``'s version is one whose place is in today's order."""
    version = state.get("version")
    if version in (2, 3):
        raise LoaderError(f"state_dict version {version} was saved by a loader whose order depended on its cache, "
                          f"readers and store settings: this one cannot find its place in the computed order. "
                          f"Start epoch {state.get('epoch')} again (a new ShardIter, then reset() "
                          f"{state.get('epoch')} times) or go on with the next one; states saved from now on "
                          f"resume exactly")
    if version == 4 and state.get("shuffle") is not False:  # in order, version 4's order is today's
        raise LoaderError(f"state_dict version 4 was saved by a loader whose epochs began with small blocks of one or "
                          f"two dates (2026-12-06): this one cuts its order into equal blocks, so that state's place "
                          f"is not in this order. Start epoch {state.get('epoch')} again (a new ShardIter, then "
                          f"reset() {state.get('epoch')} times) or go on with the next one; states saved from now "
                          f"on resume exactly")
    if version == 5 and state.get("shuffle") is not False and not _one_block_parts(state):
        raise LoaderError(f"state_dict version 5 was saved by a loader whose blocks held consecutive dates "
                          f"(before 2026-12-07): this one reads a part of several blocks in stripes, a piece of "
                          f"every date each, so that state's place is not in this order. Start epoch "
                          f"{state.get('epoch')} again (a new ShardIter, then reset() {state.get('epoch')} times) "
                          f"or go on with the next one; states saved from now on resume exactly")
    if version not in (4, 5, STATE_VERSION):
        raise LoaderError(f"state_dict version {version!r}, expected {STATE_VERSION}")


def _one_block_parts(state: dict) -> bool:
    """Every canonical part of ``state`` is one block (its order is the same in versions 5 and 6)."""
    try:
        total = sum(int(s.get("windows") or s["records"]) for s in state["shards"])
        return int(state["block"]) >= -(-total // int(state["canonical_parts"]))
    except (KeyError, TypeError, ValueError, AttributeError, ZeroDivisionError):
        return False
