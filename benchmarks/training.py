"""The loader's cost to a real training loop: an imperative Gluon loop (a small LSTM on the CPU,
as ``loader.tools.train`` runs) over the same number of batches, fed by ``ShardIter`` and by batches
already in RAM. The loop holds the GIL for much of each step (Python, MXNet's imperative calls),
so whatever Python a loader runs in the trainer's process slows it."""

from __future__ import annotations

import statistics
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


def loop_cost(store: Path, batch_size: int, cache: Path, steps: int = 30, rounds: int = 5) -> dict:
    """Seconds of the same loop fed from RAM and by ShardIter; the ratio to RAM. The machine is
    shared and its speed drifts by more than the effect measured, so the two run side by side in ``rounds`` rounds
    (their order rotating) and each ratio is the median of the rounds' ratios to the RAM run of the
    same round."""
    out: dict = {"steps": steps, "rounds": rounds, "batch_size": batch_size}
    with ShardIter(store, batch_size, cache_dir=cache) as it:
        ram = [(b.data[0].copy(), b.label[0].copy()) for b, _ in zip(it, range(8))]
    mx.nd.waitall()

    def from_ram():
        while True:
            yield from ram

    def run(name: str) -> float:
        if name == "ram":
            return _loop(from_ram(), steps)
        with ShardIter(store, batch_size, cache_dir=cache) as it:
            return _loop(_from(it), steps)

    names = ["ram", "thread"]
    times: dict = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % 2:] + names[:r % 2]:
            times[name].append(run(name))
    for name in names:
        out[f"{name}_s"] = statistics.median(times[name])
        out[f"{name}_rounds_s"] = times[name]
    for name in ("thread",):
        out[f"{name}_ratio"] = statistics.median(t / r for t, r in zip(times[name], times["ram"]))
    return out
