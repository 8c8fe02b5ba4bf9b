"""The one order in which an iterator lets go of what it holds, whichever way it ends.

====================================  ==========================================  =====================
the way it ends                       who runs the steps                          steps
====================================  ==========================================  =====================
``close()``                           the caller's thread                         ``STEPS``
dropped without ``close()``           its finalizer hands them to a thread of     ``STEPS``
                                      their own (``Pipeline.close_when_free``)
interpreter exit                      ``loader.lifecycle``'s hook: ``close()`` of  ``STEPS``
                                      every live iterator, then it waits for the
                                      dropped ones' threads
``reset()``, ``load_state_dict()``    the caller's thread                         ``RESET_STEPS``, then
                                                                                  the old plan's
                                                                                  ``close_files`` by the
                                                                                  loader thread
====================================  ==========================================  =====================

``STEPS``, in order, and why that order:

1. ``stop_streams``: the loader and producer threads stop and are joined (the loader frees its
   native readers first: ``loader.pipeline.threads``); nothing reads a file after this.
2. ``free_arrays``: the shuffle buffers kept whole, and the arrays the caller dropped; loans MXNet
   gave back are let go.
3. ``close_files``: the plans' descriptors closed and their folders removed (plans left at a
   ``reset()`` first). A native iterator reading a file is gone by then: MXNet reads through its
   own descriptors, and a folder removed under one crashed it.
4. ``release_claim``: the store's cache forgets what this iterator wanted (its files may be
   evicted from now on) and its claim on a bounded cache, which another iterator of
   the process can then take (a new one waits for dropped ones' threads first).
5. ``drop_lease``: the reader lease, last: until then gc keeps the generation it names.

Every step runs even if one before it failed (an ``Exception``); the first failure is raised after
the last step. An interrupt (Ctrl-C, ``SystemExit``) stops the order where it is and is raised: the
later steps must not run while a thread may still read (``Pipeline.close`` then runs all of it again
at the next ``close()`` or at exit). Each step is logged at DEBUG by ``loader.pipeline.shutdown``.
"""

from __future__ import annotations

import logging
from typing import Callable, Mapping, Sequence

__all__ = ["STEPS", "RESET_STEPS", "run"]

log = logging.getLogger(__name__)

STEPS = ("stop_streams", "free_arrays", "close_files", "release_claim", "drop_lease")
RESET_STEPS = ("stop_streams",)  # the current job halted; its plan's files close once no job reads them


def run(steps: Mapping[str, Callable[[], object]], order: Sequence[str] = STEPS, *, who: str = "") -> None:
    """Run ``steps[name]`` for each name of ``order``, in that order; ``steps`` must name exactly
    those steps (a step left out or one unknown is a bug here, not an error of the caller's)."""
    if set(steps) != set(order):
        raise AssertionError(f"shutdown steps {sorted(steps)} are not {list(order)}")
    failure = None
    for name in order:
        log.debug("%s: %s", who, name)
        try:
            steps[name]()
        except Exception as exc:  # the steps after it still run: what they hold must go too
            failure = failure or exc
    if failure is not None:
        raise failure
