"""Work a finalizer hands off: garbage collection runs a finalizer in whatever thread allocates at
that moment, possibly holding one of our locks, so work that waits (a request with retries, joining
threads) runs in a thread of its own. At interpreter exit it runs in place: ``weakref.finalize``'s
exit hook runs its finalizers after threading's shutdown (the main thread is no longer alive then)
and before it sets its own ``_shutdown`` flag, and Python 3.12 starts no thread at that point.

Users: a dropped reader lease's removal (:mod:`shardgen.store.lease`), a dropped iterator's close
(:mod:`loader.pipeline.pipeline`).
"""

from __future__ import annotations

import _thread
import signal
import threading
import time
from typing import Callable, Optional

from shardgen.stopping import Terminated

__all__ = ["OffThread", "send_again"]


class OffThread:
    """Runs finalizers' work in daemon threads named ``name``; ``join`` waits for those under way."""

    def __init__(self, name: str):
        self.name = name
        self.pending: set = set()  # threads under way (set.add: no lock taken inside a collection)
        self.left: list = []  # work whose thread a Ctrl-C kept from starting: ``join`` runs it

    def run(self, work: Callable[[], object]) -> None:
        if not threading.main_thread().is_alive():  # interpreter exit
            work()
            return
        thread = None
        try:
            thread = threading.Thread(target=self._run, args=(work,), name=self.name, daemon=True)
            self.pending.add(thread)
            thread.start()
        except KeyboardInterrupt as exc:
            # Python swallows an exception in a finalizer ("Exception ignored in ..."), and one raised
            # again here (``_thread.interrupt_main()`` in the main thread) is raised at once, in the
            # finalizer still: the user's Ctrl-C was lost (1 run in 5-15 of a loop that drops an
            # iterator). Its signal is sent again to the main thread once this finalizer has returned; work
            # whose thread never started is left for ``join`` (the exit hook).
            if thread is None or thread.ident is None:
                self.pending.discard(thread)
                self.left.append(work)
            send_again(type(exc))

    def _run(self, work: Callable[[], object]) -> None:
        try:
            work()
        finally:
            self.pending.discard(threading.current_thread())

    def join(self, timeout: Optional[float] = None) -> None:
        """Wait for the work under way (daemon threads die with the interpreter: exit hooks call this),
        and run what an interrupt left."""
        while self.left:
            self.left.pop()()
        for thread in list(self.pending):
            if thread.ident is not None:
                thread.join(timeout)


def send_again(kind: type = KeyboardInterrupt) -> None:
    """The signal behind ``kind`` (what a finalizer caught: SIGTERM for ``shardgen.stopping.Terminated``,
    else SIGINT) sent again to the main thread once the finalizer that caught it has returned, from a
    thread of ``_thread``'s (its start does not wait, so no second interrupt can land in it): a real
    signal, so a blocking call wakes and the process's handler raises it anew. Not sent when that
    handler is no longer Python's (one that armed ``SIG_DFL`` for a second Ctrl-C: the signal would
    kill), nor once the main thread has ended (the exit hooks, which close what the finalizer left,
    run in full; the exit status is then 0). Not ``PyThreadState_SetAsyncExc``: on 3.11 a thread
    being started holds the starting thread's id until it runs, and took the exception instead
    (it died, and the main thread waited in ``Thread.start`` for ever)."""
    signum = signal.SIGTERM if issubclass(kind, Terminated) else signal.SIGINT

    def send() -> None:
        time.sleep(0.05)  # the finalizer's last few steps run meanwhile
        main = threading.main_thread()
        if main.is_alive() and main.ident is not None and callable(signal.getsignal(signum)):
            if hasattr(signal, "pthread_kill"):
                signal.pthread_kill(main.ident, signum)
            else:  # Windows
                _thread.interrupt_main(signum)

    try:
        _thread.start_new_thread(send, ())
    except RuntimeError:  # no thread to be had
        pass
