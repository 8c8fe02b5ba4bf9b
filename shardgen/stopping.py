"""How a signal stops a ``shardgen`` command: from the start of :func:`shardgen.cli.main`, SIGINT
raises KeyboardInterrupt and SIGTERM ``Terminated`` until a command installs its own handlers (the
watcher stops cleanly on either). A watcher stopped by a signal, however sent, exits 0; any other
command 130 (SIGINT) or 143 (SIGTERM). Signals that came before ``main`` ran are noted by
:mod:`shardgen.entry` and acted on once the command is known."""

from __future__ import annotations

import signal
import threading
from typing import Callable

__all__ = ["Terminated", "with_stop_handlers"]


class Terminated(KeyboardInterrupt):
    """SIGTERM: stopped as Ctrl-C stops a command (a build's generators killed, its finished shards
    published), exit 143."""


def _on_sigterm(_signum, _frame) -> None:
    raise Terminated()


def with_stop_handlers(fn: Callable[..., int], *args) -> int:
    """``fn(*args)`` with SIGINT raising KeyboardInterrupt and SIGTERM ``Terminated`` (from the main
    thread; the handlers they replaced are put back after, for a caller such as a test process)."""
    if threading.current_thread() is not threading.main_thread():
        return fn(*args)
    previous = {signal.SIGINT: signal.signal(signal.SIGINT, signal.default_int_handler),
                signal.SIGTERM: signal.signal(signal.SIGTERM, _on_sigterm)}
    try:
        return fn(*args)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
