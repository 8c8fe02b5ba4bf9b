"""``ShardIter.for_kvstore``'s first agreement, due at the first batch (or settled by the first ``reset()``).

Nothing goes through the kvstore when the iterator is made: its first keys are the model's. MXNet
refuses integer and string keys in one kvstore, and the model's kind is not known yet (``Module.fit``
puts string keys in at ``init_optimizer``, before its first batch; a Gluon ``Trainer`` integer keys at
its first ``step()``, after it). So every worker takes rank 0's generation at its first ``next()`` (a
collective call, as ``reset()`` is). A worker built on another generation is built again on rank 0's;
after ``load_state_dict`` the loaded state must be of rank 0's generation.
"""

from __future__ import annotations

from typing import Any

from loader.errors import LoaderError
from loader.source.generations import Choice, agree
from shardgen.store import Store

__all__ = ["FirstAgreement"]


class FirstAgreement:
    """What ``for_kvstore`` needs to agree at the first batch and build the iterator again."""

    def __init__(self, kv: Any, store: Store, kwargs: dict):
        self.kv, self.store, self.kwargs = kv, store, kwargs
        self.loaded = False  # load_state_dict() ran before the first batch

    def settle(self, it: Any) -> None:
        """Agree on rank 0's generation for the ``ShardIter`` ``it``; build its reader again on it if
        it differs from the one ``it`` was built on."""
        held = it.generation
        agreed = agree(self.kv, held)
        if agreed == held:
            return
        if self.loaded:
            raise LoaderError(f"{it.manifest_path}: this worker resumed a state of generation {held}, rank 0 one of "
                              f"generation {agreed}: load the same state on every worker")
        fresh = type(it)(self.store, it.batch_size, generation=agreed, **self.kwargs)
        if fresh.schema.fingerprint != it.schema.fingerprint:
            fresh.close()
            raise LoaderError(f"{it.manifest_path}: the store's schema changed (fingerprint {it.schema.fingerprint}"
                              f" -> {fresh.schema.fingerprint}) between this worker's generation {held} and rank 0's "
                              f"{agreed}; make the iterators again")
        old, it.reader = it.reader, fresh.reader
        fresh._closed = True  # its reader is ``it``'s now
        it.reader.choice = Choice(kv=self.kv)
        it.reader.dates = old.dates  # a selection set before the first batch
        old.close()
