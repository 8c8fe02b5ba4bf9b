"""A dist_sync worker written the most natural way (not loader.train): it ends right after its
last ``trainer.step``, with no ``mx.nd.waitall()``. ``import loader`` must make it exit cleanly."""

import sys

import mxnet as mx
from mxnet import autograd, gluon

from loader import ShardIter

kv = mx.kv.create("dist_sync")
train = ShardIter.for_kvstore(kv, sys.argv[1], batch_size=8)
net = gluon.nn.Dense(1)
net.initialize(mx.init.Xavier())
trainer = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.01}, kvstore=kv)
loss_fn = gluon.loss.L2Loss()
for _epoch in range(2):
    train.reset()
    for batch in train:
        x = batch.data[0].reshape((batch.data[0].shape[0], -1))
        with autograd.record():
            loss = loss_fn(net(x), batch.label[0])
        loss.backward()
        trainer.step(x.shape[0])
