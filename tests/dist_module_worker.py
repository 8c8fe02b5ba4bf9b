"""A dist_sync worker written the way a Module user writes it (run under ``loader.tools.launch``):
the iterator first, then ``Module.fit(it, kvstore=kv)``. Writes ``<out>/rank-<r>.json`` (the
label values each epoch read) and ``<out>/params-<r>.params``.

``--fit-kvstore NAME`` passes a kvstore name to ``fit`` instead of the object (a second dist
kvstore in the worker: it must fail at once, not hang).
"""

import argparse
import json
from pathlib import Path

import mxnet as mx

from loader import ShardIter


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--store", required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--fit-kvstore")
    args = p.parse_args()
    kv = mx.kv.create("dist_sync")
    it = ShardIter.for_kvstore(kv, args.store, 8, label_names=["a"], seed=3)
    data = mx.sym.var("seq_var")
    out = mx.sym.flatten(mx.sym.FullyConnected(mx.sym.flatten(data), num_hidden=1))
    net = mx.sym.LinearRegressionOutput(out, label=mx.sym.var("a"), name="out")
    mod = mx.mod.Module(net, data_names=["seq_var"], label_names=["a"])
    seen = [[] for _ in range(args.epochs)]

    def on_batch(param) -> None:
        batch = param.locals["data_batch"]
        values = batch.label[0].asnumpy()
        seen[param.epoch] += values[: len(values) - batch.pad].astype(int).tolist()

    mod.fit(it, kvstore=args.fit_kvstore or kv, num_epoch=args.epochs, optimizer="sgd",
            optimizer_params={"learning_rate": 1e-5}, eval_metric="mse", batch_end_callback=on_batch)
    mod.save_params(str(args.out / f"params-{kv.rank}.params"))
    (args.out / f"rank-{kv.rank}.json").write_text(json.dumps({"epochs": seen, "generation": it.generation}))
    it.close()


if __name__ == "__main__":
    main()
