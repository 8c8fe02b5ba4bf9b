"""Run the user's generator for one date and load its ``.npy`` output, checked.

The command is an argv (never a shell). A run past ``timeout_s`` has its whole process group
killed. A failed run, or one whose output does not load, is retried ``retries`` times with
exponential backoff; the final error names the date, what failed and the generator's last stderr.
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime as dt
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from .config import Config
from .errors import GeneratorError, Interrupted, RawDataError

__all__ = ["load_raw", "run_generator", "obtain_raw", "STOP"]

log = logging.getLogger(__name__)
_STDERR_TAIL = 5
STOP = threading.Event()  # set (by the watcher's signal handler) to abandon running generators
_POLL_S = 0.05


def _new_session_dying_with_parent() -> None:
    """In the child: own process group, and SIGKILL if the worker that started it dies."""
    os.setsid()
    if sys.platform.startswith("linux"):
        with contextlib.suppress(Exception):
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def load_raw(path: Path, date: dt.date, min_cols: int) -> np.ndarray:
    """Load a generator's output: a real 2-D float ``.npy`` with at least ``min_cols`` columns."""
    where = f"{date}: {path}"
    try:
        arr = np.load(path, allow_pickle=False)
    except FileNotFoundError:
        raise RawDataError(f"{where}: the generator wrote no output file") from None
    except (ValueError, OSError, EOFError) as exc:
        raise RawDataError(f"{where}: not a readable .npy array ({exc})") from None
    if not isinstance(arr, np.ndarray):
        raise RawDataError(f"{where}: expected one array, found {type(arr).__name__}")
    if arr.ndim != 2:
        raise RawDataError(f"{where}: expected a 2-D array (rows, columns), got shape {arr.shape}")
    if arr.dtype.kind != "f":
        raise RawDataError(f"{where}: expected float32/float64 values, got dtype {arr.dtype}")
    if arr.shape[1] < min_cols:
        raise RawDataError(f"{where}: expected at least {min_cols} columns, got {arr.shape[1]}")
    return arr


def _tail(text: str) -> str:
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    return " | ".join(lines[-_STDERR_TAIL:]) or "(no stderr)"


def _kill_group(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def run_generator(cfg: Config, date: dt.date) -> None:
    """One run of the generator for ``date``; GeneratorError on failure or timeout."""
    argv = cfg.argv(date)
    Path(cfg.fields(date)["output"]).parent.mkdir(parents=True, exist_ok=True)
    timeout = cfg.generator.timeout_s
    with tempfile.TemporaryFile() as err:
        try:
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                    stderr=err, cwd=cfg.config_dir,
                                    preexec_fn=_new_session_dying_with_parent)
        except OSError as exc:
            raise GeneratorError(f"{date}: cannot start generator {argv[0]!r} ({exc.strerror})") from None
        deadline = time.monotonic() + timeout
        try:
            while True:
                try:
                    code = proc.wait(timeout=min(_POLL_S, max(0.0, deadline - time.monotonic())))
                    break
                except subprocess.TimeoutExpired:
                    if STOP.is_set():
                        _kill_group(proc)
                        raise Interrupted(f"{date}: generator abandoned (stopping)") from None
                    if time.monotonic() >= deadline:
                        _kill_group(proc)
                        err.seek(0)
                        raise GeneratorError(
                            f"{date}: generator timed out after {timeout:g}s and was killed; "
                            f"stderr: {_tail(err.read().decode(errors='replace'))}") from None
        except BaseException:
            _kill_group(proc)
            raise
        finally:
            # Anything the generator left running in its group goes with it.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
        if code != 0:
            err.seek(0)
            raise GeneratorError(f"{date}: generator exited with code {code}; "
                                 f"stderr: {_tail(err.read().decode(errors='replace'))}")


def obtain_raw(cfg: Config, date: dt.date, *, force: bool = False, generate: bool = True) -> np.ndarray:
    """The raw array for ``date``: the existing output if it loads, else from the generator
    (``generate=False``: the existing output or a RawDataError, e.g. for dropped-in files)."""
    path = cfg.raw_path(date)
    min_cols = cfg.schema.num_inputs + sum(lab.width for lab in cfg.schema.labels[:-1])
    if not generate:
        return load_raw(path, date, min_cols)
    if not force and path.exists():
        try:
            return load_raw(path, date, min_cols)
        except RawDataError as exc:
            log.warning("%s; regenerating", exc)
    attempts = cfg.generator.retries + 1
    for attempt in range(attempts):
        if attempt:
            delay = cfg.generator.backoff_s * 2 ** (attempt - 1)
            log.info("%s: retry %d/%d in %.1fs", date, attempt, attempts - 1, delay)
            if STOP.wait(delay):
                raise Interrupted(f"{date}: abandoned before retry (stopping)")
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        try:
            run_generator(cfg, date)
            return load_raw(path, date, min_cols)
        except (GeneratorError, RawDataError) as exc:
            last = exc
            log.debug("%s: attempt %d failed: %s", date, attempt + 1, exc)
    suffix = f" (after {attempts} attempts)" if attempts > 1 else ""
    raise type(last)(f"{last}{suffix}")
