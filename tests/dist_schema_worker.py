"""A dist_sync worker (run under ``loader.tools.launch``) for issue 64, contract 3: rank 1 builds
its iterator first, on generation 1; the test then publishes generation 2 with another schema
(writes ``<flags>/published``), and rank 0 builds its iterator on that. At the first batch every
worker takes rank 0's generation. Writes ``<out>/rank-<r>.json``: the worker's ``provide_data``
shape and either its first batch's data shape or the LoaderError it raised."""

import argparse
import json
import sys
import time
from pathlib import Path

import mxnet as mx

from loader import LoaderError, ShardIter


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
    args = p.parse_args()
    kv = mx.kv.create("dist_sync")
    if kv.rank == 0:
        wait_for(args.flags / "published")
    it = ShardIter.for_kvstore(kv, args.store, 4, cache_dir=args.out / f"cache-{kv.rank}")
    if kv.rank == 1:
        (args.flags / "built").write_text("1")
    result = {"generation": it.generation, "provide_data": list(it.provide_data[0].shape)}
    try:
        result["batch"] = list(it.next().data[0].shape)  # the agreement: a collective call
    except LoaderError as exc:  # (a worker that raises hangs in KVStore.__del__: said, then it ends well)
        result["error"] = str(exc)
    it.close()
    (args.out / f"rank-{kv.rank}.json").write_text(json.dumps(result))
    mx.nd.waitall()


if __name__ == "__main__":
    main()
