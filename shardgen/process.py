"""Processors turn one date's raw array into windows; this module has the default and the checks.

Contract: ``function(raw, date, *, time_steps, num_inputs, labels, **options)`` returns
``(x, labels)`` with ``x`` float32 ``(n, time_steps, num_inputs)`` and ``labels`` a dict
name -> float32 ``(n, width)`` (or ``(n,)`` for width 1), one entry per configured label.
"""

from __future__ import annotations

import datetime as dt
from typing import Callable, Mapping, Sequence

import numpy as np

from .errors import ProcessorError
from .layout import LabelSpec, Schema

__all__ = ["sliding_windows", "run_processor", "Windows"]

Windows = tuple[np.ndarray, dict[str, np.ndarray]]


def sliding_windows(raw: np.ndarray, date: dt.date, *, time_steps: int, num_inputs: int,
                    labels: Sequence[LabelSpec], stride: int = 1) -> Windows:
    """Window ``i`` is ``raw[i:i+T, :num_inputs]``; its labels are the label columns of its last row.

    ``raw`` is ``(rows, num_inputs + sum(label widths))``; ``stride`` steps ``i``. Returns views
    where it can: the writer copies each value once, straight into the shard.
    """
    if not isinstance(stride, int) or stride < 1:
        raise ValueError(f"stride must be an integer >= 1, got {stride!r}")
    raw = np.asarray(raw, dtype=np.float32)
    rows = raw.shape[0]
    if rows < time_steps:
        x = np.empty((0, time_steps, num_inputs), np.float32)
        return x, {lab.name: np.empty((0, lab.width), np.float32) for lab in labels}
    feats = raw[:, :num_inputs]
    # (rows - T + 1, C, T) view -> (n, T, C): no copy, no Python loop over windows.
    x = np.lib.stride_tricks.sliding_window_view(feats, time_steps, axis=0)[::stride].transpose(0, 2, 1)
    last = raw[time_steps - 1::stride]
    out, col = {}, num_inputs
    for lab in labels:
        out[lab.name] = last[:, col:col + lab.width]
        col += lab.width
    return x, out


def run_processor(fn: Callable, raw: np.ndarray, date: dt.date, schema: Schema,
                  options: Mapping[str, object]) -> Windows:
    """Call the processor and check its output's structure, shapes and dtypes (not finiteness)."""
    user_labels = schema.labels[:-1]
    try:
        result = fn(raw, date, time_steps=schema.time_steps, num_inputs=schema.num_inputs,
                    labels=user_labels, **options)
    except Exception as exc:  # a plug-in may raise anything; it becomes one line for this date
        raise ProcessorError(f"{date}: processor raised {type(exc).__name__}: {exc}") from None
    if not (isinstance(result, tuple) and len(result) == 2 and isinstance(result[1], Mapping)):
        raise ProcessorError(f"{date}: processor must return (x, labels_dict), got {type(result).__name__}")
    x, labs = result
    want = (schema.time_steps, schema.num_inputs)
    if not isinstance(x, np.ndarray) or x.ndim != 3 or x.shape[1:] != want:
        shape = getattr(x, "shape", type(x).__name__)
        raise ProcessorError(f"{date}: x must have shape (n, {want[0]}, {want[1]}), got {shape}")
    if x.dtype != np.float32:
        raise ProcessorError(f"{date}: x must be float32, got {x.dtype}")
    n = x.shape[0]
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
    return x, checked
