"""The loader's cost to a real training loop: an imperative Gluon loop (a small LSTM on the CPU,
as ``loader.train`` runs) over the same number of batches, fed by ``ShardIter`` and by batches
already in RAM. The loop holds the GIL for much of each step (Python, MXNet's imperative calls),
so a loader whose Python runs in the trainer's process slows it; one in its own process only
competes for cores."""

from __future__ import annotations

import time
from pathlib import Path

import mxnet as mx
from mxnet import autograd, gluon

from loader.shard_iter import ShardIter

__all__ = ["loop_cost"]


def _net() -> tuple:
    class Net(gluon.nn.Block):
        def __init__(self) -> None:
            super().__init__()
            self.lstm = gluon.rnn.LSTM(16, layout="NTC")
            self.out = gluon.nn.Dense(1)

        def forward(self, x):
            return self.out(self.lstm(x)[:, -1, :])

    mx.random.seed(0)
    net = Net()
    net.initialize(mx.init.Xavier())
    return net, gluon.Trainer(net.collect_params(), "adam", {"learning_rate": 1e-3}), gluon.loss.L2Loss()


def _loop(batches, steps: int) -> float:
    """Seconds for ``steps`` training steps over ``batches`` (an iterator of (x, y))."""
    net, trainer, loss_fn = _net()
    first = next(batches)  # shapes and the first allocations outside the timing
    with autograd.record():
        loss_fn(net(first[0]), first[1]).backward()
    trainer.step(first[0].shape[0])
    mx.nd.waitall()
    t0 = time.perf_counter()
    for _ in range(steps):
        x, y = next(batches)
        with autograd.record():
            loss = loss_fn(net(x), y)
        loss.backward()
        trainer.step(x.shape[0])
    mx.nd.waitall()
    return time.perf_counter() - t0


def _from(it: ShardIter):
    while True:
        for b in it:
            yield b.data[0], b.label[0]
        it.reset()


def loop_cost(store: Path, batch_size: int, cache: Path, steps: int = 30) -> dict:
    """Seconds of the same loop fed from RAM, by ShardIter in a thread (the default) and by
    ShardIter in its producer process; the ratios to RAM."""
    out: dict = {"steps": steps, "batch_size": batch_size}
    with ShardIter(store, batch_size, cache_dir=cache) as it:
        ram = [(b.data[0].copy(), b.label[0].copy()) for b, _ in zip(it, range(8))]
    mx.nd.waitall()

    def from_ram():
        while True:
            yield from ram

    rounds = {"ram": [], "process": [], "thread": []}
    for _ in range(2):  # interleaved, best of two: the machine is shared
        rounds["ram"].append(_loop(from_ram(), steps))
        for producer in ("process", "thread"):
            with ShardIter(store, batch_size, cache_dir=cache, producer=producer) as it:
                rounds[producer].append(_loop(_from(it), steps))
    for name, seconds in rounds.items():
        out[f"{name}_s"] = min(seconds)
    out["thread_ratio"] = out["thread_s"] / out["ram_s"]
    out["process_ratio"] = out["process_s"] / out["ram_s"]
    return out
