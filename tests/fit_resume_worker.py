"""A ``Module.fit`` user who checkpoints and resumes (tests/loader/test_fit_resume.py), in one process:

* ``--stop-at K``: fit with ``it.fit_checkpoint(save, every=2)``; the save at fit's K-th batch (or
  the first after it) ends the run (an exception out of fit, as a Ctrl-C would).
* ``--hang-at K``: the same, but that save then waits forever (the test kills the process with -9).
* ``--epoch-end``: fit one epoch; ``epoch_end_callback`` saves a plain ``it.state_dict()``.
* ``--resume``: a new iterator loads the saved state and ``fit(begin_epoch=state["epoch"],
  num_epoch=EPOCHS)``, as the README says (``num_epoch`` is the job's total, as a user sets it).

Every forward's real window ids (label ``a``) go to ``<out>/<tag>.jsonl`` as ``[epoch, ids]``, one
line each, flushed; the saved file records how many lines were written when it was saved.
"""

import argparse
import json
import os
import time
from pathlib import Path

import mxnet as mx

from loader import ShardIter


class Stop(Exception):
    pass


class Recording(mx.mod.Module):
    """A Module that logs the real (not padding) window ids of every batch it trains."""

    def __init__(self, log, it, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.log, self.it, self.lines = log, it, 0

    def forward_backward(self, data_batch):
        ids = data_batch.label[0].asnumpy().astype(int).tolist()
        self.log.write(json.dumps([self.it.epoch, ids[: len(ids) - data_batch.pad]]) + "\n")
        self.log.flush()
        self.lines += 1
        super().forward_backward(data_batch)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--store", required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--tag", required=True)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--stop-at", type=int, default=0)
    p.add_argument("--hang-at", type=int, default=0)
    p.add_argument("--epoch-end", action="store_true")
    p.add_argument("--resume", action="store_true")
    p.add_argument("--epochs", type=int, default=1)
    args = p.parse_args()
    it = ShardIter(args.store, args.batch, label_names=["a"], seed=5, shuffle_buffer=8, cache_dir=args.out / "cache")
    saved = args.out / "saved.json"
    log = (args.out / f"{args.tag}.jsonl").open("w")
    data = mx.sym.var("seq_var")
    out = mx.sym.flatten(mx.sym.FullyConnected(mx.sym.flatten(data), num_hidden=1))
    net = mx.sym.LinearRegressionOutput(out, label=mx.sym.var("a"), name="out")
    mod = Recording(log, it, net, data_names=["seq_var"], label_names=["a"])
    fit = dict(optimizer="sgd", optimizer_params={"learning_rate": 1e-6}, eval_metric="mse")
    stop = args.stop_at or args.hang_at

    def save(state: dict) -> None:
        tmp = saved.with_suffix(".tmp")
        tmp.write_text(json.dumps({"state": state, "forwards": mod.lines}))
        os.replace(tmp, saved)
        if stop and mod.lines >= stop:
            if args.hang_at:
                (args.out / "hanging").write_text(str(mod.lines))
                while True:
                    time.sleep(1)
            raise Stop

    try:
        if args.resume:
            state = json.loads(saved.read_text())["state"]
            it.load_state_dict(state)
            mod.fit(it, begin_epoch=state["epoch"], num_epoch=args.epochs, **fit)
        elif args.epoch_end:
            mod.fit(it, num_epoch=1, epoch_end_callback=lambda *_: save(it.state_dict()), **fit)
        else:
            mod.fit(it, num_epoch=1, batch_end_callback=it.fit_checkpoint(save, every=2), **fit)
    except Stop:
        pass
    log.close()
    it.close()


if __name__ == "__main__":
    main()
