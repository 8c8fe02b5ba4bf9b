"""``ShardIter.for_kvstore``'s first agreement, due at the first batch (or settled by the first ``reset()``).

Nothing goes through the kvstore when the iterator is made: its first keys are the model's. MXNet
refuses integer and string keys in one kvstore, and the model's kind is not known yet (``Module.fit``
puts string keys in at ``init_optimizer``, before its first batch; a Gluon ``Trainer`` integer keys at
its first ``step()``, after it). So every worker takes rank 0's generation at its first ``next()`` (a
collective call, as ``reset()`` is). A worker built on another generation reads rank 0's instead
(``Reader.move_to``); after ``load_state_dict`` the loaded state must be of rank 0's generation.
"""

from __future__ import annotations

from typing import Any, Optional

from loader.errors import LoaderError
from loader.source.generations import Choice, agree

__all__ = ["FirstAgreement"]


class FirstAgreement:
    """What ``for_kvstore`` needs to agree at the first batch."""

    def __init__(self, kv: Any, dates: Optional[tuple]):
        """``dates``: the selection the iterator was built with (its first epoch's, on any generation)."""
        self.kv, self.dates = kv, dates
        self.loaded = False  # load_state_dict() ran before the first batch

    def settle(self, it: Any) -> None:
        """Agree on rank 0's generation for the ``ShardIter`` ``it``; its reader reads this epoch on
        it from its start if it differs from the one ``it`` was built on."""
        held = it.generation
        agreed = agree(self.kv, held)
        if agreed == held:
            return
        if self.loaded:
            raise LoaderError(f"{it.manifest_path}: this worker resumed a state of generation {held}, rank 0 one of "
                              f"generation {agreed}: load the same state on every worker")
        reader = it.reader
        manifest = Choice(pin=agreed).manifest(reader.store)
        if manifest.schema.fingerprint != it.schema.fingerprint:
            raise LoaderError(f"{it.manifest_path}: the store's schema changed (fingerprint {it.schema.fingerprint}"
                              f" -> {manifest.schema.fingerprint}) between this worker's generation {held} and rank "
                              f"0's {agreed}; make the iterators again")
        reader.move_to(manifest, self.dates)  # a selection set since is the next reset()'s
