"""Saving a ``ShardIter``'s place from ``Module.fit``'s callbacks (``ShardIter.fit_checkpoint``).

MXNet 1.9.1's ``BaseModule.fit`` asks the iterator for batch k+1 *before* it runs the
``batch_end_callback`` of batch k: there ``state_dict()`` counts one batch the model has not
trained, and a resume from it never trains that batch. Only after the epoch's last batch (its
``next()`` raised StopIteration) does fit hold no batch ahead. ``fit_checkpoint`` gives a callback
that saves the state of the batches fit has trained: ``state_dict(untrained=1)`` inside the epoch,
``state_dict()`` after its last batch (the next epoch's start). ``epoch_end_callback`` runs after the
last batch too: a plain ``state_dict()`` there is right. Either way ``fit(begin_epoch=state["epoch"])``.
"""

from __future__ import annotations

from typing import Any, Callable

from loader.checkpoint import count_of
from loader.errors import LoaderError

__all__ = ["fit_checkpoint"]


def fit_checkpoint(it: Any, save: Callable[[dict], None], every: int = 1) -> Callable[[Any], None]:
    """A ``batch_end_callback`` for ``Module.fit(it, ...)`` that calls ``save(state)`` after every
    ``every``-th batch fit trains in an epoch (its ``nbatch + 1``) and after the epoch's last batch,
    with the state of what fit trained: loaded into a new iterator, then ``fit(begin_epoch=
    state["epoch"])``, every batch of the epoch is trained once over both runs."""
    count = count_of(every)
    if not (count is not None and count >= 1):
        raise LoaderError(f"fit_checkpoint: every={every!r}, expected a number of batches >= 1")

    def on_batch(param: Any) -> None:
        ended = it.epoch_ended
        if ended or (param.nbatch + 1) % count == 0:
            save(it.state_dict(untrained=0 if ended else 1))

    return on_batch
