"""``[process] function``: the processor plug-in, found next to the config file first (read by config, run by produce).

``ProcessConfig.load()`` imports it in every process that calls it (loky and Dask workers too);
an import that fails is a ConfigError naming the plug-in's file and line; ``check_options``
checks the other ``[process]`` keys against its signature when the config loads.
"""

from __future__ import annotations

import importlib
import inspect
import logging
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

from shardgen.errors import ConfigError

__all__ = ["ProcessConfig"]

log = logging.getLogger(__name__)
PASSED = ("raw", "date", "time_steps", "num_inputs", "labels")  # what shardgen passes a processor itself


@dataclass(frozen=True)
class ProcessConfig:
    """``[process]``: the processor plug-in. ``config_dir`` (the config file's folder) is searched
    first for the module, in every process that calls ``load()`` (loky and Dask workers too)."""

    function: str = "shardgen.process:sliding_windows"
    options: tuple[tuple[str, Any], ...] = ()
    config_dir: Optional[Path] = None

    def plugin_file(self) -> Optional[Path]:
        """The module's file (or package ``__init__.py``) in the config's folder, if it is there."""
        if self.config_dir is None:
            return None
        top = self.function.partition(":")[0].split(".")[0]
        for candidate in (self.config_dir / f"{top}.py", self.config_dir / top / "__init__.py"):
            if candidate.is_file():
                return candidate
        return None

    def load(self) -> Callable:
        """Import the processor; ConfigError if it cannot be found or its module fails to import."""
        module_name, _, attr = self.function.partition(":")
        local = self.plugin_file()
        try:
            module = _import_plugin(self.function, local) if local else importlib.import_module(module_name)
            fn = getattr(module, attr)
        except SyntaxError as exc:  # the plug-in's own file: say where, not "No module named"
            raise ConfigError(f"process.function {self.function!r}: syntax error in {exc.filename}:{exc.lineno}: "
                              f"{exc.msg}") from None
        except (ImportError, AttributeError, ValueError) as exc:
            missing = getattr(exc, "name", None)
            if isinstance(exc, ImportError) and missing and not (module_name + ".").startswith(missing + "."):
                raise ConfigError(f"process.function {self.function!r}: importing it failed at "
                                  f"{_where(exc, local)}: {exc}") from None  # the plug-in imports something missing
            raise ConfigError(f"process.function {self.function!r} cannot be imported ({exc})") from None
        except ConfigError:
            raise
        except Exception as exc:  # raised by the plug-in's module code at import time
            raise ConfigError(f"process.function {self.function!r}: importing it raised {type(exc).__name__} at "
                              f"{_where(exc, local)}: {exc}") from None
        if not callable(fn):
            raise ConfigError(f"process.function {self.function!r} is not callable")
        return fn

    def check_options(self, fn: Callable) -> None:
        """The ``[process]`` keys against ``fn``'s signature, before any date runs: a key it cannot
        take, or a call that cannot bind, is a ConfigError naming the key; keys that only a
        ``**options`` takes are warned about (a typo such as ``strid`` would pass silently)."""
        try:
            signature = inspect.signature(fn)
        except (TypeError, ValueError):  # no signature to read (a builtin): the first date will say
            return
        options = dict(self.options)
        for key in options:
            if key in PASSED:
                raise ConfigError(f"process.{key}: shardgen passes {key} to the processor itself; remove the key")
        params = signature.parameters.values()
        named = [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name not in PASSED]
        unknown = [key for key in options if key not in named]
        takes = f"its options: {', '.join(named)}" if named else "it names no options"
        if unknown and not any(p.kind is p.VAR_KEYWORD for p in params):
            raise ConfigError(f"process.{unknown[0]}: {self.function!r} takes no option {unknown[0]!r} ({takes})")
        if unknown:
            log.warning("process.%s: not named by %r, only passed in its **options (%s); a typo?",
                        ", process.".join(unknown), self.function, takes)
        try:
            signature.bind(None, None, **dict.fromkeys(PASSED[2:]), **options)
        except TypeError as exc:
            raise ConfigError(f"process.function {self.function!r} cannot be called as shardgen calls it "
                              f"(raw, date, time_steps=, num_inputs=, labels=, the [process] keys): {exc}") from None


_PLUGINS: dict[str, Path] = {}  # top-level module name -> file, of plug-ins imported from a config folder


def _import_plugin(function: str, file: Path) -> Any:
    """Import the module of ``function`` from the folder holding ``file``, which goes first on
    ``sys.path`` while importing only (a plug-in's sibling modules must be imported at its top).

    The folder wins over an installed module of the same name; another config's plug-in of that
    name is replaced. A name the process has already imported from elsewhere (``json``, ``numpy``)
    is refused: swapping it would break code that uses the real one."""
    module_name = function.partition(":")[0]
    top = module_name.split(".")[0]
    folder = file.parent if file.name != "__init__.py" else file.parent.parent
    loaded = sys.modules.get(top)
    loaded_file = getattr(loaded, "__file__", None)
    if loaded is not None and (loaded_file is None or Path(loaded_file).resolve() != file.resolve()):
        if top not in _PLUGINS:
            raise ConfigError(f"process.function {function!r}: {file} has the name of the module {top!r} "
                              f"this process already uses ({loaded_file or 'built in'}); "
                              "rename the plug-in file")
        for name in [n for n in sys.modules if n == top or n.startswith(top + ".")]:
            del sys.modules[name]
    sys.path.insert(0, str(folder))
    try:
        importlib.invalidate_caches()
        module = importlib.import_module(module_name)
    finally:
        sys.path.remove(str(folder))
    _PLUGINS[top] = file
    return module


def _where(exc: BaseException, file: Optional[Path]) -> str:
    """``file:line`` of the plug-in frame an import-time exception came through (else its origin)."""
    frames = list(traceback.extract_tb(exc.__traceback__))
    ours = [f for f in frames if file is not None and f.filename == str(file)]
    real = [f for f in frames if not f.filename.startswith("<")]
    frame = (ours or real or [None])[-1]
    return f"{frame.filename}:{frame.lineno}" if frame is not None else str(file or "?")
