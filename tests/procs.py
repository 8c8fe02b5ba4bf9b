"""Processors that misbehave, for tests."""

import numpy as np

from shardgen.process import sliding_windows


def bad_shape(raw, date, *, time_steps, num_inputs, labels):
    x, labs = sliding_windows(raw, date, time_steps=time_steps, num_inputs=num_inputs, labels=labels).as_windows(
        time_steps)
    return x[:, :-1], labs


def wrong_dtype(raw, date, *, time_steps, num_inputs, labels):
    x, labs = sliding_windows(raw, date, time_steps=time_steps, num_inputs=num_inputs, labels=labels).as_windows(
        time_steps)
    return x.astype(np.float64), labs


def missing_label(raw, date, *, time_steps, num_inputs, labels):
    x, labs = sliding_windows(raw, date, time_steps=time_steps, num_inputs=num_inputs, labels=labels).as_windows(
        time_steps)
    labs.pop("b")
    return x, labs


def raises(raw, date, **kw):
    raise RuntimeError("boom in user code")


def nan_label(raw, date, *, time_steps, num_inputs, labels):
    x, labs = sliding_windows(raw, date, time_steps=time_steps, num_inputs=num_inputs, labels=labels).as_windows(
        time_steps)
    labs = {k: np.array(v) for k, v in labs.items()}
    labs["a"][2] = np.nan
    return x, labs
