"""What the example trainer's ``--module`` path needs beside ``Module.fit``: ``--max-batches``
(``FirstBatches``) and the validation figure over the real rows (``evaluate_module``), so that both
paths honour the same flags."""

from __future__ import annotations

import mxnet as mx

from loader.shard_iter import ShardIter

__all__ = ["FirstBatches", "evaluate_module"]


class FirstBatches(mx.io.DataIter):
    """``--max-batches`` for ``Module.fit``: the first ``n`` batches of each epoch of ``it`` (fit
    resets it after every epoch, as the Gluon loop does after it stops early)."""

    def __init__(self, it: ShardIter, n: int):
        super().__init__(it.batch_size)
        self.it, self.n, self.taken = it, n, 0

    provide_data = property(lambda self: self.it.provide_data)
    provide_label = property(lambda self: self.it.provide_label)

    def reset(self) -> None:
        self.taken = 0
        self.it.reset()

    def next(self) -> mx.io.DataBatch:
        if self.taken >= self.n:
            raise StopIteration
        batch = self.it.next()
        self.taken += 1
        return batch


def evaluate_module(mod, it: ShardIter, target: int) -> float:
    """The Module's mean squared error over ``it``'s real rows (the pad of a last batch left out)."""
    total, count = 0.0, 0
    for batch in it:
        mod.forward(batch, is_train=False)
        n = batch.data[0].shape[0] - batch.pad
        out = mod.get_outputs()[0].asnumpy().reshape(-1)[:n]
        total += float(((out - batch.label[target].asnumpy()[:n]) ** 2).sum())
        count += n
    it.reset()  # ready for the next evaluation, on the newest generation
    return total / max(count, 1.0)
