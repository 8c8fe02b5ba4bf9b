"""The ``shardgen`` command (``[project.scripts]``): SIGINT and SIGTERM are noted from its first
instant -- importing the library takes about half a second, and a Ctrl-C then printed a traceback
from inside an import -- and handed to :func:`shardgen.cli.main`, which acts on them once it knows
the command (:mod:`shardgen.stopping`). Only ``signal`` is imported before the handlers are in:
what remains is Python's own start (tens of milliseconds)."""

import signal

__all__ = ["main"]


def main() -> int:
    early = []

    def note(signum, _frame) -> None:  # only noted: an import half done must not be broken off
        early.append(signum)

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, note)
    from shardgen import cli

    return cli.main(early=early)
