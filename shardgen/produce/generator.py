"""Run the user's generator for one date and load its ``.npy`` output, checked.

The command is an argv (never a shell). A run past ``timeout_s`` has its whole process group
killed. A failed run, or one whose output does not load, is retried ``retries`` times with
exponential backoff; the final error names the date, what failed and the generator's last stderr.

Stopping (``request_stop``, called by the watcher on SIGINT/SIGTERM) abandons running generators,
killing their process groups, in this process and in its worker processes (loky workers are its
children: they see a marker file named after their parent, since they cannot see its ``STOP``).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import logging
import math
import os
import signal
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable, Iterator, Optional

import numpy as np

from shardgen.backoff import retry_delay
from shardgen.config import Config
from shardgen.errors import GeneratorError, Interrupted, RawDataError
from shardgen.fsutil import HOST_TOKEN, pid_alive
from shardgen.produce.launch import exit_watch, kill_group, spawn

__all__ = ["load_raw", "run_generator", "obtain_raw", "STOP", "request_stop", "clear_stop", "stop_marker",
           "abandon_with"]

log = logging.getLogger(__name__)
_STDERR_TAIL = 5
STOP = threading.Event()  # set by request_stop: abandon running generators of this process
_LOCAL = threading.local()  # .abandon: an Event that abandons this thread's generators (see abandon_with)
_POLL_S = 0.05


def _process_key(pid: int) -> str:
    """``pid-starttime``: names one process on this host, even after its pid is reused."""
    try:
        start = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        start = "0"
    return f"{pid}-{start}"


def stop_marker(pid: int) -> Path:
    """The file whose existence tells the worker processes of process ``pid`` to stop."""
    return Path(tempfile.gettempdir()) / f"shardgen-stopping-{_process_key(pid)}"


def request_stop() -> None:
    """Abandon the generators run by this process and by its worker processes."""
    STOP.set()
    with contextlib.suppress(OSError):
        stop_marker(os.getpid()).touch()


def clear_stop() -> None:
    STOP.clear()
    with contextlib.suppress(OSError):
        stop_marker(os.getpid()).unlink()


def coordinator_gone() -> Optional[int]:
    """The pid of the build that handed this worker its date, if that process is gone (killed with
    -9, its workers live on with init as parent): such a worker must publish nothing. None while it
    lives, or in the build's own process, or when it runs on another host (``working_for``)."""
    pid = getattr(_LOCAL, "coordinator", None)
    return pid if pid is not None and not pid_alive(pid) else None


@contextlib.contextmanager
def working_for(coordinator: Optional[tuple[str, int]]) -> Iterator[None]:
    """Within the block, this thread works for the build ``coordinator`` (its host token and pid):
    checked by ``coordinator_gone`` and by the generator's stop check, on the build's own host only."""
    saved = getattr(_LOCAL, "coordinator", None)
    mine = coordinator is not None and coordinator[0] == HOST_TOKEN and coordinator[1] != os.getpid()
    _LOCAL.coordinator = coordinator[1] if mine else None
    try:
        yield
    finally:
        _LOCAL.coordinator = saved


@contextlib.contextmanager
def abandon_with(event: threading.Event) -> Iterator[None]:
    """Generators this thread runs inside the block are abandoned (killed, ``Interrupted``) once
    ``event`` is set, as after ``request_stop`` (a build running one ahead, stopped early)."""
    saved = getattr(_LOCAL, "abandon", None)
    _LOCAL.abandon = event
    try:
        yield
    finally:
        _LOCAL.abandon = saved


class _StopCheck:
    """Whether to stop: ``STOP`` here, the marker of the process that started this worker, or
    this thread's ``abandon_with`` event."""

    def __init__(self) -> None:
        self.marker = stop_marker(os.getppid())
        self.abandon = getattr(_LOCAL, "abandon", None)

    def __call__(self) -> bool:
        return (STOP.is_set() or (self.abandon is not None and self.abandon.is_set()) or self.marker.exists()
                or coordinator_gone() is not None)

    def wait(self, seconds: float) -> bool:
        """Sleep up to ``seconds``; True (at once) if a stop is requested meanwhile."""
        deadline = time.monotonic() + seconds
        while not self():
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            STOP.wait(min(left, _POLL_S))
        return True


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


def _stderr_tail(err) -> str:
    """The last lines of a generator's stderr file, reading only its last 64 KiB (a generator
    may have written gigabytes there)."""
    size = err.seek(0, os.SEEK_END)
    err.seek(max(0, size - _STDERR_READ))
    return _tail(err.read().decode(errors="replace"))


_STDERR_READ = 64 << 10


def _wait_or_stop(proc: subprocess.Popen, exited: Callable[[float], int], deadline: float, stopping: _StopCheck,
                  date: dt.date, timeout: float, err) -> int:
    """The generator's exit code; killed (and an error raised) on a stop request or at ``deadline``."""
    while True:
        try:
            return exited(min(_POLL_S, max(0.0, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            if stopping():
                kill_group(proc)
                raise Interrupted(f"{date}: generator abandoned (stopping)") from None
            if time.monotonic() >= deadline:
                kill_group(proc)
                raise GeneratorError(
                    f"{date}: generator timed out after {timeout:g}s and was killed; "
                    f"stderr: {_stderr_tail(err)}") from None


def run_generator(cfg: Config, date: dt.date) -> None:
    """One run of the generator for ``date``; GeneratorError on failure or timeout."""
    argv = cfg.argv(date)
    Path(cfg.fields(date)["output"]).parent.mkdir(parents=True, exist_ok=True)
    timeout = cfg.generator.timeout_s
    stopping = _StopCheck()
    if stopping():
        raise Interrupted(f"{date}: generator not started (stopping)")
    with tempfile.TemporaryFile() as err:
        try:
            proc = spawn(argv, cfg.config_dir, err)
        except OSError as exc:
            raise GeneratorError(f"{date}: cannot start generator {argv[0]!r} ({exc.strerror})") from None
        deadline = time.monotonic() + timeout
        try:
            with exit_watch(proc) as exited:
                code = _wait_or_stop(proc, exited, deadline, stopping, date, timeout, err)
        except BaseException:
            kill_group(proc)
            raise
        finally:
            # Anything the generator left running in its group goes with it.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
        if code != 0:
            raise GeneratorError(f"{date}: generator exited with code {code}; stderr: {_stderr_tail(err)}")


def obtain_raw(cfg: Config, date: dt.date, *, force: bool = False, generate: bool = True) -> tuple[np.ndarray, bool]:
    """The raw array for ``date`` and whether the generator made it just now: the existing output
    if it loads, else from the generator (``generate=False``: the existing output or a
    RawDataError, e.g. for dropped-in files)."""
    path = cfg.raw_path(date)
    min_cols = cfg.schema.num_inputs + sum(lab.width for lab in cfg.schema.labels[:-1])
    if not generate:
        return load_raw(path, date, min_cols), False
    if not force and path.exists():
        try:
            return load_raw(path, date, min_cols), False
        except RawDataError as exc:
            log.warning("%s; regenerating", exc)
    return _generate(cfg, date, path, min_cols), True


def _generate(cfg: Config, date: dt.date, path: Path, min_cols: int) -> np.ndarray:
    attempts = cfg.generator.retries + 1
    stopping = _StopCheck()
    for attempt in range(attempts):
        if attempt:
            delay = retry_delay(attempt, base=cfg.generator.backoff_s, cap=math.inf)
            log.info("%s: retry %d/%d in %.1fs", date, attempt, attempts - 1, delay)
            if stopping.wait(delay):
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
