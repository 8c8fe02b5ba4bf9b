"""A dist_sync worker written the most natural way (not loader.tools.train): it ends right after its
last ``trainer.step``, with no ``mx.nd.waitall()``. ``import loader`` must make it exit cleanly."""

import sys

import mxnet as mx
from dist_model import setup

kv = mx.kv.create("dist_sync")
train, step = setup(kv, sys.argv[1])
for _epoch in range(2):
    train.reset()
    for batch in train:
        step(batch)
