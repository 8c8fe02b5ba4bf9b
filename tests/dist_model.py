"""The small model the dist_sync worker scripts train: a Dense layer on flattened windows."""

import mxnet as mx
from mxnet import autograd, gluon

from loader import ShardIter


def setup(kv, manifest: str):
    """(iterator, step): ``step(batch)`` runs one training step on ``batch``."""
    train = ShardIter.for_kvstore(kv, manifest, batch_size=8)
    net = gluon.nn.Dense(1)
    net.initialize(mx.init.Xavier())
    trainer = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.01}, kvstore=kv)
    loss_fn = gluon.loss.L2Loss()

    def step(batch) -> None:
        x = batch.data[0].reshape((batch.data[0].shape[0], -1))
        with autograd.record():
            loss = loss_fn(net(x), batch.label[0])
        loss.backward()
        trainer.step(x.shape[0])

    return train, step
