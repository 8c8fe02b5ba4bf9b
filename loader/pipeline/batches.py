"""How rows become the caller's batches: the settings a stream reads with (``StreamParams``), the
layout of a batch's one buffer (x, then each label asked for) and filling it from the shuffle
buffer's rows."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from shardgen.format.schema import Schema

__all__ = ["StreamParams", "batch_floats", "batch_views", "fill_batch"]


@dataclass(frozen=True)
class StreamParams:
    """Everything about reading that does not change between epochs."""

    schema: Schema
    batch_size: int
    shuffle: bool
    seed: int
    num_parts: int
    part_index: int
    last_batch: str
    readers: int  # native reads at a time: ``settings.default_readers``, not a setting (issue 65)
    native_batch: int  # records per native batch: ``settings.default_native_batch``, not a setting
    buffer_records: int  # records of a full block's shuffle buffer
    preprocess_threads: int
    prefetch_buffer: int
    label_names: tuple[str, ...]
    canonical_parts: int = 1  # the order's (``loader.pipeline.order``): recorded in every state
    block: int = 1  # samples of a full block of the order (the shuffle window)
    stripes: bool = True  # the order's (``OrderSpec.stripes``): recorded in every state


def batch_floats(p: StreamParams) -> int:
    """Floats in one caller batch: x and the labels asked for (one buffer, see ``Arena``)."""
    return p.batch_size * (p.schema.x_floats + sum(lab.width for lab in asked_labels(p)))


def asked_labels(p: StreamParams) -> list:
    """The schema's ``LabelSpec`` of each label asked for, in the order ``label_names`` asks."""
    by_name = {lab.name: lab for lab in p.schema.labels}
    return [by_name[name] for name in p.label_names]


def batch_views(p: StreamParams) -> list[tuple[int, int, tuple]]:
    """``(start, stop, shape)`` of each array in a batch's one buffer: x, then each label asked for."""
    s, b = p.schema, p.batch_size
    x_shape = (b, s.time_steps, s.num_inputs)
    pos = int(np.prod(x_shape))
    views = [(0, pos, x_shape)]
    for lab in asked_labels(p):
        views.append((pos, pos + b * lab.width, (b,) if lab.width == 1 else (b, lab.width)))
        pos += b * lab.width
    return views


def fill_batch(p: StreamParams, views: list, flat: np.ndarray, x: np.ndarray, labels: np.ndarray,
               days: np.ndarray) -> None:
    """Write the labels (and dates) of ``len(labels)`` samples, whose x is already in ``x``, into
    the batch buffer ``flat``. A short batch is filled with its own rows (MXNet would leave
    uninitialised memory there, and padding must always be valid data)."""
    s = p.schema
    b, n = p.batch_size, len(labels)
    if n < b:
        fill = np.arange(b) % n
        x[n:] = x[fill[n:]]
        labels, days = labels[fill], days[fill]
    column, col = {}, 0  # each user label's first column in ``labels`` (the schema's order; "date" is last)
    for lab in s.labels[:-1]:
        column[lab.name], col = col, col + lab.width
    for (a, z, _shape), lab in zip(views[1:], asked_labels(p)):
        if lab.name == "date":
            flat[a:z] = days
        else:
            flat[a:z].reshape(b, lab.width)[...] = labels[:, column[lab.name]:column[lab.name] + lab.width]
