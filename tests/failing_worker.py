"""A dist_sync Gluon worker (run under ``loader.launch``) whose rank ``FAIL_RANK`` fails after 3
batches, as ``HOW`` says: ``raise`` (RuntimeError), ``exit`` (``sys.exit(3)``) or ``kill``
(SIGKILL to itself). The other rank trains on, and waits in ``trainer.step`` once its peer is gone.

    failing_worker.py MANIFEST FAIL_RANK HOW
"""

import os
import signal
import sys

import mxnet as mx
from mxnet import autograd, gluon

from loader import ShardIter

manifest, fail_rank, how = sys.argv[1], int(sys.argv[2]), sys.argv[3]
kv = mx.kv.create("dist_sync")
train = ShardIter.for_kvstore(kv, manifest, batch_size=8)
net = gluon.nn.Dense(1)
net.initialize(mx.init.Xavier())
trainer = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.01}, kvstore=kv)
loss_fn = gluon.loss.L2Loss()
batches = 0
for _epoch in range(1000):
    for batch in train:
        x = batch.data[0].reshape((batch.data[0].shape[0], -1))
        with autograd.record():
            loss = loss_fn(net(x), batch.label[0])
        loss.backward()
        trainer.step(x.shape[0])
        batches += 1
        if batches == 3 and kv.rank == fail_rank:
            print(f"rank {kv.rank} fails now ({how})", flush=True)
            if how == "raise":
                raise RuntimeError(f"rank {kv.rank} broke on purpose")
            if how == "exit":
                sys.exit(3)
            os.kill(os.getpid(), signal.SIGKILL)
    train.reset()
