"""The knobs of a ``ShardIter`` (its keyword arguments), checked, with their defaults and what
they hold in memory. Defaults are the ones ``make bench`` measured best here
(docs/performance.md), or docs/internals.md says why not."""

from __future__ import annotations

import math
from typing import Optional, Sequence

import numpy as np

from loader.errors import LoaderError
from loader.pipeline.batches import StreamParams, batch_floats
from loader.pipeline.memory import BUFFERS, ONE_BLOCK_BUFFERS, check_footprint, footprint
from loader.pipeline.order import MAX_CANONICAL_PARTS
from loader.pipeline.shuffle_buffer import buffer_bytes
from loader.sizes import parse_size
from shardgen.format.check import VERIFY_MODES
from shardgen.format.schema import Schema

__all__ = ["check_arguments", "check_removed", "REMOVED", "check_label_names", "default_readers",
           "default_native_batch", "buffer_records", "block_samples", "stream_params", "sized", "check_memory",
           "BLOCK_BYTES", "SHUFFLE_BYTES", "buffers_alive"]

SHUFFLE_BYTES = 1 << 30  # what an object store's iterator's shuffle buffers hold together by default
BLOCK_BYTES = 128 << 20  # a default block: read in ~0.1-0.3 s here, a piece of every date when the part is larger
HEADROOM = 1.25  # a part chosen to be one block stays one while a rolling window grows by a quarter

# Keywords ShardIter took once and no longer does (issue 65): what replaced each. ``make bench`` measured
# neither doing anything here (ten years: readers=1 read 1.06x the defaults' samples/s, native_batch=64
# 1.11x, both within a shared 2-core machine's noise).
REMOVED = {
    "readers": "the loader reads one native read at a time, sized by bytes (tapes of up to 16 MB)",
    "native_batch": "the records of a native batch follow the layout's pack (about 2,048 windows)",
}


def check_removed(removed: dict) -> None:
    """LoaderError for a removed keyword (``REMOVED``) passed a value, saying why it went and what to
    do; None (what asked for the default) is accepted, so code that forwarded an unset option runs
    on. Any other keyword is a TypeError, as Python's own for a keyword ShardIter never took."""
    for name, value in removed.items():
        if name not in REMOVED:
            raise TypeError(f"ShardIter() got an unexpected keyword argument {name!r}")
        if value is not None:
            raise LoaderError(f"{name}={value!r}: ShardIter no longer takes {name} (removed in issue 65): "
                              f"{REMOVED[name]}, and make bench measured no effect of it. Drop the argument")


def check_arguments(*, batch_size: object, num_parts: object, part_index: object, preprocess_threads: object,
                    prefetch_buffer: object, last_batch: object, seed: object, verify: object,
                    canonical_parts: object = None, stripes: object = None) -> None:
    """LoaderError naming the first argument that is out of range."""
    for name, value, low in (("batch_size", batch_size, 1), ("num_parts", num_parts, 1),
                             ("preprocess_threads", preprocess_threads, 1),
                             ("prefetch_buffer", prefetch_buffer, 1),
                             ("canonical_parts", 1 if canonical_parts is None else canonical_parts, 1)):
        if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < low:
            raise LoaderError(f"{name} must be an integer >= {low}, got {value!r}")
    if (num_parts if canonical_parts is None else canonical_parts) > MAX_CANONICAL_PARTS:
        raise LoaderError(f"canonical_parts (default num_parts) must be <= {MAX_CANONICAL_PARTS:,}, got "
                          f"{num_parts if canonical_parts is None else canonical_parts:,}")
    if not isinstance(part_index, (int, np.integer)) or not 0 <= part_index < num_parts:
        raise LoaderError(f"part_index must be in [0, {num_parts}), got {part_index!r}")
    if stripes is not None and not isinstance(stripes, (bool, np.bool_)):
        raise LoaderError(f"stripes must be True, False or None (the store's default), got {stripes!r}")
    if last_batch not in ("pad", "discard"):
        raise LoaderError(f"last_batch must be 'pad' or 'discard', got {last_batch!r}")
    if not isinstance(seed, (int, np.integer)) or not 0 <= seed < 2**31:
        raise LoaderError(f"seed must be an integer in [0, 2^31), got {seed!r}")
    if verify not in VERIFY_MODES:
        raise LoaderError(f"verify must be one of {', '.join(VERIFY_MODES)}, got {verify!r}")


def check_label_names(label_names: object, known: Sequence[str]) -> tuple[str, ...]:
    """The labels asked for, in the order asked (``known``, the schema's, when None); LoaderError
    for a bare string, an unknown or repeated name, or none at all."""
    if label_names is None:
        return tuple(known)
    if isinstance(label_names, (str, bytes)):
        raise LoaderError(f"label_names must be a list of names, got the string {label_names!r} "
                          f"(write [{label_names!r}]); choose among {list(known)}")
    try:
        names = tuple(label_names)
    except TypeError:
        raise LoaderError(f"label_names must be a list of names, got {label_names!r}") from None
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        raise LoaderError(f"label_names {list(names)!r}: choose among {list(known)}")
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise LoaderError(f"label_names {list(names)!r}: {', '.join(map(repr, repeated))} asked more than once")
    return names


def default_readers() -> int:
    """Native reads open at once per stream: 1, not a setting (``REMOVED``: ``make bench`` measured
    1 within noise of 2 on 2 cores). The order never depends on it."""
    return 1


def default_native_batch(pack: int) -> int:
    """Records per native batch, not a setting (``REMOVED``): about 2048 samples, within [8, 256] records."""
    return max(8, min(256, math.ceil(2048 / pack)))


def buffer_records(schema: Schema, shuffle_buffer: Optional[int | str], shards: tuple, canonical_parts: int,
                   stripes: bool = True) -> int:
    """The shuffle buffer's capacity in records (a block of the order): ``shuffle_buffer`` records
    (an int), a size in bytes (``"256MB"``), or by default the whole canonical part (an exact
    shuffle of it, with a quarter to spare) when it holds at most ``BLOCK_BYTES``, else blocks of
    ``BLOCK_BYTES``: read in stripes (:mod:`loader.pipeline.order`), each holds a piece of every
    date, so a batch mixes every date as an exact shuffle's would, and the first batch comes after
    the first block, not after the part (at ten years: 4.1 s for 500 dates read whole). Without
    stripes (an object store's blocks take whole files), the whole part where the buffers it takes
    fit in ``SHUFFLE_BYTES``, else as large a block as that holds with several blocks alive."""
    if shuffle_buffer is None:
        part = math.ceil(HEADROOM * sum(s.records for s in shards) / canonical_parts) + 2
        if stripes:
            return min(part, max(64, BLOCK_BYTES // buffer_bytes(schema, 1)))
        if ONE_BLOCK_BUFFERS * buffer_bytes(schema, part) <= SHUFFLE_BYTES:
            return part
        return max(64, SHUFFLE_BYTES // (BUFFERS * buffer_bytes(schema, 1)))
    if isinstance(shuffle_buffer, (int, np.integer)) and not isinstance(shuffle_buffer, (bool, np.bool_)):
        if shuffle_buffer < 1:
            raise LoaderError(f"shuffle_buffer must be >= 1 record, got {shuffle_buffer!r}")
        return int(shuffle_buffer)
    size = parse_size(shuffle_buffer, "shuffle_buffer",
                      "a record count (int) or a size with a unit such as '256MB' or '1GiB'")
    return max(1, size // buffer_bytes(schema, 1))


def stream_params(schema: Schema, shards: tuple, shuffle_buffer: Optional[int | str], label_names: tuple, *,
                  batch_size: int, shuffle: bool, seed: int, num_parts: int, part_index: int, last_batch: str,
                  preprocess_threads: int, prefetch_buffer: int, canonical_parts: Optional[int],
                  stripes: bool = True) -> StreamParams:
    """The settings of a stream reading ``shards``: the arguments (``check_arguments`` checked them),
    their defaults filled in, the shuffle buffer sized (``buffer_records``) and the block it makes."""
    canonical = int(num_parts if canonical_parts is None else canonical_parts)
    records = buffer_records(schema, shuffle_buffer, shards, canonical, stripes)
    return StreamParams(
        schema=schema, batch_size=int(batch_size), shuffle=bool(shuffle), seed=int(seed),
        num_parts=int(num_parts), part_index=int(part_index), last_batch=last_batch,
        readers=default_readers(), native_batch=default_native_batch(schema.pack), buffer_records=records,
        preprocess_threads=int(preprocess_threads), prefetch_buffer=int(prefetch_buffer),
        label_names=label_names,
        canonical_parts=canonical,
        block=block_samples(records, shards, schema), stripes=bool(stripes))


def sized(schema: Schema, shards: tuple, *, shuffle_buffer: object, label_names: tuple, knobs: dict
          ) -> tuple[StreamParams, dict]:
    """The settings a reader of ``shards`` reads with (``stream_params``) and what they hold (``check_memory``)."""
    params = stream_params(schema, shards, shuffle_buffer, label_names, **knobs)
    return params, check_memory(params, shuffle_buffer, shards)


def buffers_alive(params: StreamParams, shards: tuple) -> int:
    """Shuffle buffers alive at most (``loader.pipeline.memory``): fewer when every canonical part
    of ``shards`` is one block of the order (see ``order._block_bounds``)."""
    one_block = params.block >= -(-sum(s.samples for s in shards) // params.canonical_parts)
    return ONE_BLOCK_BUFFERS if one_block else BUFFERS


def block_samples(records: int, shards: tuple, schema: Schema) -> int:
    """Samples of a full block of the order (:mod:`loader.pipeline.order`): what ``records`` records
    of these shards hold on average. Fixed at construction and recorded in every state."""
    n_rec = sum(s.records for s in shards)
    per = sum(s.samples for s in shards) / n_rec if n_rec else schema.pack
    return max(1, int(records * per))


def block_records(block: int, shards: tuple) -> int:
    """The most records a block of ``block`` samples of ``shards`` can hold: its samples taken from
    the sparsest shards first (a store's samples per record vary: a short date, another stride),
    plus a record per shard whose records are not all full (a stripe is cut at full records' bounds)."""
    need, records = block, 2 + min(len(shards), block)  # a stripe enters each shard once, at a record's bound
    for s in sorted(shards, key=lambda s: s.samples / max(1, s.records)):
        if need <= 0:
            break
        take = min(need, s.samples)
        records += math.ceil(take * s.records / max(1, s.samples))
        need -= take
    return records


def check_memory(params: StreamParams, shuffle_buffer: object, shards: tuple) -> dict:
    """What ``params`` would hold reading ``shards`` (``loader.pipeline.memory``); LoaderError
    before anything is allocated if that is more than the machine can spare."""
    records = params.buffer_records
    held = footprint(params.schema, buffer_records=records, block_records=block_records(params.block, shards),
                     buffers=buffers_alive(params, shards),
                     native_batch=params.native_batch,
                     readers=params.readers, prefetch_buffer=params.prefetch_buffer,
                     batch_floats=batch_floats(params))
    check_footprint(held, f"shuffle_buffer={shuffle_buffer!r} ({records:,} records), "
                          f"prefetch_buffer={params.prefetch_buffer}, batch_size={params.batch_size}")
    return held
