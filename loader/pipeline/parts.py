"""An epoch's split over the parts: what is left of it after the phases read before (a resumed
state), each part's samples of that, and the batches every part yields (``last_batch``; see
docs/distributed.md, "Parts")."""

from __future__ import annotations

import math
from typing import Sequence

from loader.errors import LoaderError
from loader.pipeline.batches import StreamParams
from loader.pipeline.order import Phase, count, remainder, slice_of

__all__ = ["split_phase", "epoch_batches"]


def split_phase(p: StreamParams, total: int, phases: Sequence[Phase], generation: int) -> tuple[list, list, int]:
    """What is left of an epoch of ``total`` samples after ``phases``, each part's samples of it,
    and the batches every part yields (``epoch_batches``; LoaderError if the parts cannot split it)."""
    rest = remainder(total, phases)
    part_samples = [count(slice_of(rest, p.num_parts, q)) for q in range(p.num_parts)]
    return rest, part_samples, epoch_batches(p, part_samples, generation, count(rest), bool(phases))


def epoch_batches(p: StreamParams, part_samples: Sequence[int], generation: int, left: int,
                  resumed: bool = False) -> int:
    """Batches every part yields in this phase: ``"pad"``, ``ceil(largest part / batch_size)`` (a
    batch larger than a part: one batch, ``pad = batch_size - samples``, as ``NDArrayIter`` gives);
    ``"discard"``, ``smallest part // batch_size``. LoaderError for an empty part, or no batch at all
    (``resumed`` with ``"discard"``: none, what is left is what discard leaves out)."""
    smallest, bs = min(part_samples), p.batch_size
    if not any(part_samples) or (resumed and p.last_batch == "discard" and smallest < bs):
        return 0  # a state saved at the epoch's very end
    # name this worker's part when it is the one (else the first): a user sees their own part_index
    which = p.part_index if part_samples[p.part_index] == smallest else list(part_samples).index(smallest)
    if smallest == 0:
        empty = sum(1 for n in part_samples if n == 0)
        mine = "" if which == p.part_index else f"; this one, part_index {p.part_index}, is not"
        raise LoaderError(f"part {which} of {p.num_parts} would be empty ({empty} of the {p.num_parts} parts{mine}): "
                          f"{left} samples of generation {generation} are left to read, too few for every part; use "
                          "fewer parts (or resume from the next epoch)")
    if p.last_batch == "pad":
        return math.ceil(max(part_samples) / bs)
    if smallest < bs:
        raise LoaderError(f"batch_size {bs} is larger than part {which} of {p.num_parts} ({smallest} of {left} "
                          f"samples left in generation {generation}): last_batch='discard' leaves no batch; "
                          "last_batch='pad' gives one padded batch")
    return smallest // bs
