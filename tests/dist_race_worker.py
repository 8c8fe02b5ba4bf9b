"""A dist_sync worker (run under ``loader.tools.launch``) for the generation-agreement race test.

Rank 0 writes ``<flags>/proposed`` right after it has read its newest generation in round
``--publish-round`` (0: construction, k: the k-th reset); the test then publishes a new date and
writes ``<flags>/published``; rank 1 waits for that before it starts the same round, so it sees
the newer generation while rank 0 proposed the older one. Writes ``<out>/rank-<r>.json``.
"""

import argparse
import json
import sys
import time
from pathlib import Path

import mxnet as mx
from mxnet import autograd, gluon

from loader import ShardIter
from loader.source.generations import Choice


def wait_for(path: Path, timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            print(f"timed out waiting for {path}", file=sys.stderr)
            sys.exit(3)
        time.sleep(0.02)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--store", type=Path, required=True)
    p.add_argument("--flags", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--publish-round", type=int, required=True)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=8)
    args = p.parse_args()
    kv = mx.kv.create("dist_sync")
    rank, rounds, proposals = kv.rank, [0], []
    original = Choice.propose

    def propose(location, held=None):
        newest = original(location, held)
        proposals.append(newest.generation)
        if rank == 0 and rounds[0] == args.publish_round:
            (args.flags / "proposed").write_text(str(newest.generation))
        return newest

    Choice.propose = staticmethod(propose)

    def before_round() -> None:
        if rank == 1 and rounds[0] == args.publish_round:
            wait_for(args.flags / "published")

    before_round()
    it = ShardIter.for_kvstore(kv, args.store, args.batch_size, shuffle=True, seed=1,
                               cache_dir=args.out / f"cache-{rank}")
    net = gluon.nn.Dense(1)
    net.initialize(mx.init.Zero())
    trainer = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 1e-4}, kvstore=kv)
    epochs = []
    for epoch in range(args.epochs):
        if epoch:
            rounds[0] += 1
            before_round()
            it.reset()
        ids, batches = [], 0
        for batch in it:
            x, a = batch.data[0], batch.label[0]
            with autograd.record():
                loss = ((net(x.reshape((args.batch_size, -1))).reshape((-1,)) - a) ** 2).mean()
            loss.backward()
            trainer.step(args.batch_size)  # dist_sync: hangs if the workers' batch counts differ
            ids += a.asnumpy()[: args.batch_size - batch.pad].astype(int).tolist()
            batches += 1
        epochs.append({"generation": it.generation, "batches": batches, "ids": ids})
    state = it.state_dict()
    it.close()
    (args.out / f"rank-{rank}.json").write_text(json.dumps({"epochs": epochs, "proposals": proposals,
                                                            "pinned": state["pinned"]}))
    mx.nd.waitall()


if __name__ == "__main__":
    main()
