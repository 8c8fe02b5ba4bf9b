"""Processors turn one date's raw array into windows; this module has the default and the checks.

Contract: ``function(raw, date, *, time_steps, num_inputs, labels, **options)`` returns either

* ``RunSpec(rows, starts, labels)``: ``rows`` float32 ``(r, num_inputs)``, the processed rows;
  ``starts`` integers ``(n,)``: window ``j`` is ``rows[starts[j] : starts[j] + time_steps]``;
  ``labels`` a dict name -> float32 ``(n, width)`` (or ``(n,)``), one entry per configured label.
  Every layout can store it, and ``[store] layout = "runs"`` stores each row once;
* or ``(x, labels)``: ``x`` float32 ``(n, time_steps, num_inputs)``, the windows themselves
  (layouts ``windows`` and ``samples`` only).
"""

from __future__ import annotations

import datetime as dt
import traceback
from dataclasses import dataclass
from typing import Callable, Iterator, Mapping, Sequence, Union

import numpy as np

from shardgen.errors import ProcessorError
from shardgen.format.schema import LabelSpec, Schema

__all__ = ["RunSpec", "WindowSet", "sliding_windows", "run_processor", "Windows"]

Windows = tuple[np.ndarray, dict[str, np.ndarray]]


@dataclass(frozen=True)
class RunSpec:
    """Windows given as rows and start rows: window ``j`` is ``rows[starts[j]:starts[j]+T]``."""

    rows: np.ndarray
    starts: np.ndarray
    labels: Mapping[str, np.ndarray]
    time_steps: int | None = None  # known to the producer; lets ``x, labels = spec`` cut windows

    def as_windows(self, time_steps: int | None = None) -> Windows:
        """The same windows as ``(x, labels)``, ``x`` of shape ``(n, T, C)``."""
        t = time_steps or self.time_steps
        if not t:
            raise TypeError("RunSpec.as_windows needs time_steps")
        x = self.rows[np.asarray(self.starts)[:, None] + np.arange(t)]
        return x, dict(self.labels)

    def __iter__(self) -> Iterator:
        """``x, labels = sliding_windows(...)``: processors written for the windows form (which
        ``sliding_windows`` returned before) keep working."""
        return iter(self.as_windows())


@dataclass(frozen=True)
class WindowSet:
    """A date's checked windows, whichever form the processor returned; ``rows``/``starts`` are
    set for the run form (then ``x`` is None and windows are cut on demand)."""

    n: int
    time_steps: int
    labels: dict[str, np.ndarray]  # name -> (n, width) float32
    x: np.ndarray | None = None
    rows: np.ndarray | None = None
    starts: np.ndarray | None = None

    @property
    def is_runs(self) -> bool:
        return self.rows is not None

    def windows(self, index: np.ndarray | slice) -> np.ndarray:
        """Windows ``index`` as an ``(m, T, C)`` float32 array."""
        if self.x is not None:
            return self.x[index]
        starts = self.starts[index]
        return self.rows[starts[:, None] + np.arange(self.time_steps)]


def sliding_windows(raw: np.ndarray, date: dt.date, *, time_steps: int, num_inputs: int,
                    labels: Sequence[LabelSpec], stride: int = 1) -> RunSpec:
    """Window ``i`` is ``raw[i:i+T, :num_inputs]``; its labels are the label columns of its last row.

    ``raw`` is ``(rows, num_inputs + sum(label widths))``; ``stride`` steps ``i``. Returned as
    rows and starts (each row once), with views where possible: no Python loop over windows.
    """
    if not isinstance(stride, int) or isinstance(stride, bool) or stride < 1:
        raise ValueError(f"stride must be an integer >= 1, got {stride!r}")
    raw = _as_float32(raw, date)
    n_rows = raw.shape[0]
    starts = np.arange(0, max(0, n_rows - time_steps + 1), stride, dtype=np.int64)
    last = raw[starts + time_steps - 1]
    out, col = {}, num_inputs
    for lab in labels:
        out[lab.name] = last[:, col:col + lab.width]
        col += lab.width
    return RunSpec(raw[:, :num_inputs], starts, out, time_steps)


def _checked_labels(labs: object, n: int, user_labels: Sequence[LabelSpec], date: dt.date) -> dict:
    if not isinstance(labs, Mapping):
        raise ProcessorError(f"{date}: processor labels must be a dict name -> array, got {type(labs).__name__}")
    names = [lab.name for lab in user_labels]
    if sorted(labs) != sorted(names):
        raise ProcessorError(f"{date}: labels must be exactly {names}, got {sorted(labs)}")
    checked = {}
    for lab in user_labels:
        arr = labs[lab.name]
        if not isinstance(arr, np.ndarray):
            raise ProcessorError(f"{date}: label {lab.name!r} must be a numpy array")
        if arr.ndim == 1 and lab.width == 1:
            arr = arr[:, None]
        if arr.shape != (n, lab.width):
            raise ProcessorError(f"{date}: label {lab.name!r} must have shape ({n}, {lab.width}), got {arr.shape}")
        if arr.dtype != np.float32:
            raise ProcessorError(f"{date}: label {lab.name!r} must be float32, got {arr.dtype}")
        checked[lab.name] = arr
    return checked


def _as_float32(raw: np.ndarray, date: dt.date) -> np.ndarray:
    """``raw`` as float32; ProcessorError naming the row and column of a finite value too large for
    float32 (a cast would make it inf, then read as "non-finite")."""
    raw = np.asarray(raw)
    if raw.dtype == object:  # numbers in an object array: as float64 first, so an overflow is seen
        raw = raw.astype(np.float64)
    out = raw.astype(np.float32, copy=False)
    if raw.dtype != np.float32 and raw.ndim >= 1 and np.isinf(out).any():  # the rare case: find which
        over = np.isfinite(raw) & np.isinf(out)
        if over.any():
            row, col = (int(v[0]) for v in np.nonzero(over.reshape(len(raw), -1)))
            raise ProcessorError(f"{date}: raw value {raw.reshape(len(raw), -1)[row, col]:g} at row {row}, column "
                                 f"{col} overflows float32 (|x| <= 3.4e38): scale it in the generator")
    return out


def _check_finite(arr: np.ndarray, what: str, date: dt.date, axis_name: str) -> None:
    bad = ~np.isfinite(arr)
    if bad.any():
        first = int(np.flatnonzero(bad.reshape(len(arr), -1).any(axis=1))[0])
        raise ProcessorError(f"{date}: non-finite value in {what!r} at {axis_name} {first} (expected finite float32)")


def _as_run_spec(result: RunSpec, schema: Schema, date: dt.date) -> WindowSet:
    rows, starts = result.rows, result.starts
    want = schema.num_inputs
    if not isinstance(rows, np.ndarray) or rows.ndim != 2 or rows.shape[1] != want:
        shape = getattr(rows, "shape", type(rows).__name__)
        raise ProcessorError(f"{date}: RunSpec.rows must have shape (rows, {want}), got {shape}")
    if rows.dtype != np.float32:
        raise ProcessorError(f"{date}: RunSpec.rows must be float32, got {rows.dtype}")
    if not isinstance(starts, np.ndarray) or starts.ndim != 1 or starts.dtype.kind not in "iu":
        raise ProcessorError(f"{date}: RunSpec.starts must be a 1-D integer array")
    starts = starts.astype(np.int64)
    if len(starts) and (starts.min() < 0 or starts.max() + schema.time_steps > len(rows)):
        raise ProcessorError(f"{date}: RunSpec.starts must lie in [0, {len(rows) - schema.time_steps}] "
                             f"(a window is {schema.time_steps} rows of {len(rows)})")
    labels = _checked_labels(result.labels, len(starts), schema.labels[:-1], date)
    used = np.zeros(len(rows) + 1, np.int64)
    if len(starts):
        np.add.at(used, starts, 1)
        np.add.at(used, starts + schema.time_steps, -1)
        covered = np.cumsum(used)[:-1] > 0
        bad = covered & ~np.isfinite(rows).all(axis=1)
        if bad.any():
            row = int(np.flatnonzero(bad)[0])
            window = int(np.flatnonzero((starts <= row) & (row < starts + schema.time_steps))[0])
            raise ProcessorError(f"{date}: non-finite value in {schema.data_name!r} at window {window} (row {row}; "
                                 "expected finite float32)")
    for name, arr in labels.items():
        _check_finite(arr, name, date, "window")
    return WindowSet(len(starts), schema.time_steps, labels, rows=rows, starts=starts)


def _raised_at(exc: BaseException, fn: Callable) -> str:
    """``file:line (in function)`` of the frame of the processor's own file the exception came
    through last (a plug-in's call into numpy names the plug-in's line), else of its origin."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__)[1:] if not f.filename.startswith("<")]
    own = getattr(getattr(fn, "__code__", None), "co_filename", None)
    frame = ([f for f in frames if f.filename == own] or frames or [None])[-1]
    return f"{frame.filename}:{frame.lineno} (in {frame.name})" if frame is not None else "an unknown line"


def run_processor(fn: Callable, raw: np.ndarray, date: dt.date, schema: Schema,
                  options: Mapping[str, object]) -> WindowSet:
    """Call the processor and check its output: structure, shapes, dtypes and finiteness."""
    user_labels = schema.labels[:-1]
    try:
        result = fn(raw, date, time_steps=schema.time_steps, num_inputs=schema.num_inputs,
                    labels=user_labels, **options)
    except Exception as exc:  # a plug-in may raise anything; it becomes one line for this date
        raise ProcessorError(f"{date}: processor raised {type(exc).__name__} at {_raised_at(exc, fn)}: "
                             f"{exc}") from None
    if isinstance(result, RunSpec):
        return _as_run_spec(result, schema, date)
    if not (isinstance(result, tuple) and len(result) == 2):
        raise ProcessorError(f"{date}: processor must return RunSpec(rows, starts, labels) or (x, labels_dict), "
                             f"got {type(result).__name__}")
    if schema.codec.rows:
        raise ProcessorError(f"{date}: the processor returned windows (x, labels), but store.layout = "
                             f"{schema.layout.kind!r} needs RunSpec(rows, starts, labels); set store.layout = "
                             "'windows' or return a RunSpec")
    x, labs = result
    want = (schema.time_steps, schema.num_inputs)
    if not isinstance(x, np.ndarray) or x.ndim != 3 or x.shape[1:] != want:
        shape = getattr(x, "shape", type(x).__name__)
        raise ProcessorError(f"{date}: x must have shape (n, {want[0]}, {want[1]}), got {shape}")
    if x.dtype != np.float32:
        raise ProcessorError(f"{date}: x must be float32, got {x.dtype}")
    labels = _checked_labels(labs, x.shape[0], user_labels, date)
    _check_finite(x, schema.data_name, date, "window")
    for name, arr in labels.items():
        _check_finite(arr, name, date, "window")
    return WindowSet(x.shape[0], schema.time_steps, labels, x=x)


def as_window_set(x: Union[np.ndarray, RunSpec], labels: Mapping[str, np.ndarray] | None, schema: Schema,
                  date: dt.date) -> WindowSet:
    """``write_shard``'s input, checked the way a processor's output is."""
    return run_processor(lambda *a, **k: x if isinstance(x, RunSpec) else (x, dict(labels or {})),
                         np.empty((0, 0), np.float32), date, schema, {})
