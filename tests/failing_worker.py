"""A dist_sync Gluon worker (run under ``loader.tools.launch``) whose rank ``FAIL_RANK`` fails after 3
batches, as ``HOW`` says: ``raise`` (RuntimeError), ``exit`` (``sys.exit(3)``) or ``kill``
(SIGKILL to itself). The other rank trains on, and waits in ``trainer.step`` once its peer is gone.

    failing_worker.py MANIFEST FAIL_RANK HOW [guard]

With ``guard`` the script asks for the loader's exit guard itself (``loader.install_exit_guard()``),
as a worker under a launcher of its own does (the test runs it under ``--no-exit-guard``).
"""

import os
import signal
import sys

import mxnet as mx
from dist_model import setup

manifest, fail_rank, how = sys.argv[1], int(sys.argv[2]), sys.argv[3]
if sys.argv[4:] == ["guard"]:
    import loader

    loader.install_exit_guard()
kv = mx.kv.create("dist_sync")
train, step = setup(kv, manifest)
batches = 0
for _epoch in range(1000):
    for batch in train:
        step(batch)
        batches += 1
        if batches == 3 and kv.rank == fail_rank:
            print(f"rank {kv.rank} fails now ({how})", flush=True)
            if how == "raise":
                raise RuntimeError(f"rank {kv.rank} broke on purpose")
            if how == "exit":
                sys.exit(3)
            os.kill(os.getpid(), signal.SIGKILL)
    train.reset()
