"""How is this process ending? The exit code of a failure, for ``loader.lifecycle``'s exit hook
(used only once the exit guard, ``loader.install_exit_guard``, is installed: it calls ``install()``).

Python tells atexit hooks nothing about how the program ended. What is left to look at:

* an uncaught exception (other than ``SystemExit``) was printed by the interpreter, which sets
  ``sys.last_value`` first; Python then exits with 1 (130 for ``KeyboardInterrupt``). In an
  interactive session every error at the prompt sets it too, so it is ignored there;
* ``SystemExit`` leaves no trace, so ``install()`` (by the exit guard of a dist worker) wraps
  ``sys.exit`` and the builtins ``exit`` and ``quit`` to remember the code of the last call made
  in the main thread, and rebinds the module globals bound to them before it (``from sys
  import exit`` in the script, or in any module loaded by then) to the wrapped ones.

Not seen: ``raise SystemExit(n)`` written out (no function is called), and ``sys.exit`` held
before ``install()`` anywhere but a module global (a local variable, a default argument, an
attribute). A non-zero ``sys.exit`` that the program catches and survives is still remembered (the
last call wins).
"""

from __future__ import annotations

import builtins
import sys
import threading
import types
from typing import Any, Callable, Optional

__all__ = ["install", "failure_code", "system_exit_code"]

_last_exit: list[int] = []  # the code of the last sys.exit / exit / quit in the main thread


def system_exit_code(arg: Any) -> int:
    """The process exit code Python derives from ``SystemExit(arg)``: None is 0, an int is itself,
    anything else (a message, printed) is 1."""
    if arg is None:
        return 0
    return arg if isinstance(arg, int) else 1


def failure_code() -> Optional[int]:
    """The code this process is exiting with when it is failing, else None (a normal exit)."""
    if not (sys.flags.interactive or hasattr(sys, "ps1")):
        exc = getattr(sys, "last_value", None)
        if exc is not None:
            return 130 if isinstance(exc, KeyboardInterrupt) else 1
    if _last_exit and _last_exit[-1] != 0:
        return _last_exit[-1]
    return None


class _Recorded:
    """A callable that raises ``SystemExit`` (``sys.exit``, ``exit``, ``quit``), remembering its code."""

    def __init__(self, real: Callable[..., Any]):
        self.real = real

    def __call__(self, code: Any = None) -> None:
        try:
            self.real(code)
        except SystemExit as exc:
            if threading.current_thread() is threading.main_thread():
                _last_exit.append(system_exit_code(exc.code))
            raise

    def __repr__(self) -> str:
        return repr(self.real)


def install() -> None:
    """Wrap ``sys.exit``, ``exit`` and ``quit`` (once) so ``failure_code()`` sees their codes, and
    point every module global still bound to one of them at its wrapper."""
    wrapped = {}
    if not isinstance(sys.exit, _Recorded):
        wrapped[id(sys.exit)] = sys.exit = _Recorded(sys.exit)
    for name in ("exit", "quit"):
        real = getattr(builtins, name, None)  # absent under python -S
        if real is not None and not isinstance(real, _Recorded):
            wrapped[id(real)] = _Recorded(real)
            setattr(builtins, name, wrapped[id(real)])
    for module in list(sys.modules.values()):
        names = vars(module) if isinstance(module, types.ModuleType) else {}
        for key, value in list(names.items()):
            recorded = wrapped.get(id(value))
            if recorded is not None and recorded.real is value:
                names[key] = recorded
