"""Train a small LSTM regressor ``seq_var -> bd_return`` on a shard store, the way a user would.

    python -m loader.tools.train --manifest shards/manifest.json --epochs 2 --gpus 0,1 --val-from 2024-01-29

Gluon with ``ShardIter``: each batch is split over the contexts (``--gpus``; CPU when none), padded
rows of the last batch are masked out of the loss; ``--module`` uses ``mx.mod.Module.fit`` instead. Both
train on the dates before ``--val-from`` (and report the mse of the dates from it on) and stop each epoch
after ``--max-batches``.
``--kvstore dist_sync`` (under ``python -m loader.tools.launch``): each worker reads its own part of
every epoch (with ``--module`` too: the iterator and ``Module.fit`` share the one kvstore).

Stop and resume (Gluon): ``--stop-after N`` stops every worker after its N-th batch of the run, and
rank 0 writes ``--checkpoint DIR`` (the iterator's ``state_dict()`` and the parameters; not the
optimizer state, which MXNet cannot save from a dist kvstore's servers). ``--resume DIR`` starts
from it on any number of workers: the rest of that epoch split among them, then whole epochs.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any, Optional, Sequence

import mxnet as mx
import numpy as np
from mxnet import autograd, gluon

from loader.errors import LoaderError
from loader.shard_iter import ShardIter
from loader.tools.train_checkpoint import load_checkpoint, save_checkpoint
from loader.tools.train_fit import FirstBatches, evaluate_module

__all__ = ["main", "build_net", "batch_losses", "contexts"]

log = logging.getLogger("loader.tools.train")


def contexts(gpus: str, cpu_devices: int = 1) -> list:
    """``--gpus 0,1`` -> [gpu(0), gpu(1)]; empty -> CPU contexts."""
    ids = [int(g) for g in gpus.split(",") if g.strip()] if gpus else []
    return [mx.gpu(i) for i in ids] if ids else [mx.cpu(i) for i in range(cpu_devices)]


class LSTMRegressor(gluon.HybridBlock):
    def __init__(self, hidden: int, **kwargs):
        super().__init__(**kwargs)
        with self.name_scope():
            self.lstm = gluon.rnn.LSTM(hidden, layout="NTC")
            self.head = gluon.nn.Dense(1, flatten=False)

    def hybrid_forward(self, F, x):
        out = self.lstm(x)  # (N, T, H)
        last = F.squeeze(F.slice_axis(out, axis=1, begin=-1, end=None), axis=1)
        return F.reshape(self.head(last), (-1,))


def build_net(hidden: int, ctx: list, seed: int = 0) -> LSTMRegressor:
    mx.random.seed(seed)
    net = LSTMRegressor(hidden)
    net.initialize(mx.init.Xavier(), ctx=ctx)
    net.hybridize()
    return net


def batch_losses(net, batch: mx.io.DataBatch, ctx: list, target: int) -> list:
    """Squared error of each row, one array per context; the padded rows of a last batch weigh 0."""
    n = batch.data[0].shape[0]
    w = np.ones(n, np.float32)
    if batch.pad:
        w[n - batch.pad:] = 0
    xs = gluon.utils.split_and_load(batch.data[0], ctx, even_split=False)
    ys = gluon.utils.split_and_load(batch.label[target], ctx, even_split=False)
    ws = gluon.utils.split_and_load(mx.nd.array(w), ctx, even_split=False)
    return [((net(x) - y) ** 2) * w for x, y, w in zip(xs, ys, ws)]


def _evaluate(net, it: ShardIter, ctx: list, target: int) -> float:
    total, count = 0.0, 0
    for batch in it:
        total += sum(float(loss.sum().asscalar()) for loss in batch_losses(net, batch, ctx, target))
        count += batch.data[0].shape[0] - batch.pad
    it.reset()  # ready for the next evaluation, on the newest generation
    return total / max(count, 1.0)


def _rank(kv) -> int:
    return kv.rank if kv is not None else 0


def _prefix(kv) -> str:
    """What a worker's lines start with in a job of several."""
    return f"[rank {kv.rank}] " if kv is not None and kv.num_workers > 1 else ""


def _real_labels(batch: mx.io.DataBatch, target: int) -> list:
    """The target values of a batch's real rows (its pad left out), for ``--record-log``."""
    values = batch.label[target].asnumpy()
    return values[: len(values) - batch.pad].tolist()


def _write_outputs(args: argparse.Namespace, kv, save_params: Any, seen: list) -> None:
    """``--params-out`` (``save_params(path)``) and ``--record-log``, named with this worker's rank."""
    if args.params_out:
        save_params(str(args.params_out).format(rank=_rank(kv)))
    if args.record_log:
        Path(str(args.record_log).format(rank=_rank(kv))).write_text(json.dumps(seen))


def _cache(args: argparse.Namespace, kv) -> dict:
    """The cache arguments (only given when set)."""
    out = {"cache_dir": args.cache_dir.format(rank=_rank(kv))} if args.cache_dir else {}
    return {**out, "cache_limit": args.cache_limit} if args.cache_limit else out


def _iterators(args: argparse.Namespace, kv, **kw: Any) -> tuple[ShardIter, Optional[ShardIter]]:
    """The training iterator (the dates before ``--val-from``) and the validation one (from it on;
    None without ``--val-from``), the same for both paths. With a kvstore every worker reads its own
    part of the generation rank 0 picked (at construction and each reset): train and val are made and
    reset in the same order everywhere."""
    common = dict(preprocess_threads=args.threads, prefetch_buffer=args.prefetch, seed=args.seed, **_cache(args, kv),
                  **kw)
    val_end = (np.datetime64(args.val_from) - np.timedelta64(1, "D")).astype(str) if args.val_from else None

    def make(**kw) -> ShardIter:
        if kv is not None:
            return ShardIter.for_kvstore(kv, args.manifest, args.batch_size, **kw, **common)
        return ShardIter(args.manifest, args.batch_size, **kw, **common)

    train = make(dates=(None, val_end) if val_end else None)
    return train, make(shuffle=False, dates=(args.val_from, None)) if args.val_from else None


def train_gluon(args: argparse.Namespace, ctx: list, kv) -> list[dict]:
    train, val = _iterators(args, kv)
    target = [lab.name for lab in train.schema.labels].index(args.target)
    net = build_net(args.hidden, ctx, args.seed)
    trainer = gluon.Trainer(net.collect_params(), "adam", {"learning_rate": args.lr},
                            kvstore=kv if kv is not None else "device")
    start = load_checkpoint(Path(args.resume), train, net) if args.resume else 0
    history, seen, done = [], [], 0
    rank, label = _rank(kv), _prefix(kv)
    for epoch in range(start, args.epochs):
        if epoch > start:
            train.reset()
        total, count, batches, t0 = 0.0, 0.0, 0, time.perf_counter()
        seen.append([])
        for batch in train:
            if args.record_log:
                seen[-1] += _real_labels(batch, target)
            with autograd.record():
                losses = batch_losses(net, batch, ctx, target)
            for loss in losses:
                loss.backward()
            trainer.step(args.batch_size)
            total += sum(float(loss.sum().asscalar()) for loss in losses)
            count += args.batch_size - batch.pad
            batches += 1
            done += 1
            if done == args.stop_after or (args.max_batches and batches >= args.max_batches):
                break
        stats = train.stats
        row = {"epoch": epoch, "train_mse": total / max(count, 1), "batches": batches,
               "samples": int(count), "seconds": time.perf_counter() - t0,
               "samples_per_s": stats["samples_per_s"], "stall_pct": 100 * stats["stall_fraction"],
               "generation": train.generation}
        if done == args.stop_after:  # every worker, after the same batch
            history.append(row)
            if rank == 0:
                save_checkpoint(Path(args.checkpoint), train, net)
            print(f"{label}stopped after {done} batches, in epoch {epoch}" +
                  (f"; checkpoint {args.checkpoint}" if rank == 0 else ""), flush=True)
            break
        if val is not None:
            row["val_mse"] = _evaluate(net, val, ctx, target)
        history.append(row)
        val_text = f", val mse {row['val_mse']:.4f}" if "val_mse" in row else ""
        print(f"{label}epoch {epoch}: train mse {row['train_mse']:.4f}{val_text} | {batches} batches, "
              f"{row['samples_per_s']:,.0f} samples/s, data stall {row['stall_pct']:.1f}%", flush=True)
    train.close()
    if val is not None:
        val.close()
    _write_outputs(args, kv, net.save_parameters, seen)
    return history


def train_module(args: argparse.Namespace, ctx: list, kv) -> list[dict]:
    """The same iterator through the symbolic Module API (a small MLP over the flattened window).
    With a kvstore, the iterator is ``for_kvstore``'s (this worker's part) and ``Module.fit`` gets
    the same kvstore object (a second ``mx.kv.create("dist_sync")`` in a worker never returns)."""
    it, val = _iterators(args, kv, label_names=[args.target])
    target = list(it.label_names).index(args.target)
    mx.random.seed(args.seed)
    data = mx.sym.var(it.provide_data[0].name)
    hidden = mx.sym.Activation(mx.sym.FullyConnected(mx.sym.flatten(data), num_hidden=args.hidden), "relu")
    out = mx.sym.flatten(mx.sym.FullyConnected(hidden, num_hidden=1))
    net = mx.sym.LinearRegressionOutput(out, label=mx.sym.var(args.target), name="out")
    mod = mx.mod.Module(net, data_names=[it.provide_data[0].name], label_names=[args.target], context=ctx)
    history: list[dict] = []
    mse = [float("nan")]
    seen: list[list] = [[]]
    label = _prefix(kv)

    def on_batch(param: Any) -> None:  # the metric accumulates over the epoch
        mse[0] = float(param.eval_metric.get()[1])
        if args.record_log:
            seen[-1] += _real_labels(param.locals["data_batch"], target)

    def on_epoch(epoch, *_):
        s = it.stats  # fit() calls this before it resets the iterator
        row = {"epoch": epoch, "batches": s["batches"], "samples": s["samples"], "train_mse": mse[0],
               "samples_per_s": s["samples_per_s"], "stall_pct": 100 * s["stall_fraction"]}
        if val is not None:
            row["val_mse"] = evaluate_module(mod, val, target)
        history.append(row)
        seen.append([])
        val_text = f", val mse {row['val_mse']:.4f}" if "val_mse" in row else ""
        print(f"{label}epoch {epoch}: train mse {mse[0]:.4f}{val_text} | {s['batches']} batches, {s['samples']} "
              f"samples, {s['samples_per_s']:,.0f} samples/s, data stall {100 * s['stall_fraction']:.1f}%", flush=True)

    batches = FirstBatches(it, args.max_batches) if args.max_batches else it
    mod.fit(batches, num_epoch=args.epochs, optimizer="adam", optimizer_params={"learning_rate": args.lr},
            eval_metric="mse", batch_end_callback=on_batch, epoch_end_callback=on_epoch,
            initializer=mx.init.Xavier(), kvstore=kv if kv is not None else "local")
    it.close()
    if val is not None:
        val.close()
    _write_outputs(args, kv, mod.save_params, seen[:-1])
    return history


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m loader.tools.train", description=__doc__.split("\n\n")[0])
    p.add_argument("--manifest", default="shards/manifest.json",
                   help="store manifest: a file, a store folder, or s3://bucket/prefix[/manifest.json]")
    p.add_argument("--cache-dir", help="the loader's local root: plan folders and s3:// downloads ({rank}: the "
                                       "worker's rank; default $XDG_CACHE_HOME/shardgen or ~/.cache/shardgen)")
    p.add_argument("--cache-limit", help="most bytes the s3:// cache may hold, e.g. 20GB (default: no limit)")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=256, help="global batch, split over the contexts")
    p.add_argument("--gpus", default="", help="comma-separated GPU ids, e.g. 0,1 (default: CPU)")
    p.add_argument("--cpu-devices", type=int, default=1, help=argparse.SUPPRESS)  # tests: several CPU contexts
    p.add_argument("--val-from", help="dates from this one (YYYY-MM-DD) are validation, earlier ones train")
    p.add_argument("--target", default="bd_return", help="label to regress (default: bd_return)")
    p.add_argument("--hidden", type=int, default=32)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=4, help="ShardIter preprocess_threads")
    p.add_argument("--prefetch", type=int, default=8, help="ShardIter prefetch_buffer")
    p.add_argument("--max-batches", type=int, default=0, help="stop each epoch after this many batches")
    p.add_argument("--kvstore", default=None, help="e.g. dist_sync (under loader.tools.launch); default: local")
    p.add_argument("--module", action="store_true", help="use mx.mod.Module.fit instead of Gluon")
    p.add_argument("--params-out", help="save the trained parameters here ({rank} is the worker's rank)")
    p.add_argument("--history-out", help="write per-epoch figures as JSON here ({rank} as above)")
    p.add_argument("--stop-after", type=int, default=0, metavar="N",
                   help="stop after the N-th batch of this run; rank 0 writes --checkpoint (Gluon)")
    p.add_argument("--checkpoint", help="the folder --stop-after writes (the iterator's state and the parameters)")
    p.add_argument("--resume", help="start from a --checkpoint folder, on any number of workers (Gluon)")
    p.add_argument("--record-log", help=argparse.SUPPRESS)  # tests: the target values seen, per epoch
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.module and (args.stop_after or args.resume):
        parser.error("--stop-after and --resume are for the Gluon loop (not --module)")
    if bool(args.stop_after) != bool(args.checkpoint):
        parser.error("--stop-after and --checkpoint go together")
    logging.basicConfig(level=logging.WARNING, format="loader: %(levelname)s: %(message)s")
    ctx = contexts(args.gpus, args.cpu_devices)
    try:
        kv = mx.kv.create(args.kvstore) if args.kvstore else None
        history = train_module(args, ctx, kv) if args.module else train_gluon(args, ctx, kv)
    except LoaderError as exc:  # the library names its keyword; this command's user has the flag
        print(f"loader: error: {str(exc).replace('pass cache_dir= ', 'pass --cache-dir ')}", file=sys.stderr)
        return 2
    if args.history_out:
        Path(args.history_out.format(rank=_rank(kv))).write_text(json.dumps(history, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
