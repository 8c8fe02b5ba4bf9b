"""Errors the loader raises before MXNet's C++ code could crash or hang on bad input."""

from __future__ import annotations

import contextlib
from typing import Iterator

from shardgen.errors import ShardgenError
from shardgen.store.objurl import StoreUnreachable

__all__ = ["LoaderError", "IteratorClosed", "StoreUnreachableError", "mxnet_reason", "as_loader_error",
           "as_loader_errors"]


class LoaderError(Exception):
    """Bad manifest, missing or truncated shard, bad argument: the message names which."""


class IteratorClosed(LoaderError):
    """``next()`` on a closed ``ShardIter`` (or one closed while ``next()`` waited): never a silent
    end of the data (only MXNet's ``PrefetchingIter`` thread is told StopIteration: ``ShardIter.next``)."""


class StoreUnreachableError(LoaderError):
    """The store (an object store) could not be reached within its retries: at ``reset()`` the
    generation already held is read again."""


def mxnet_reason(exc: BaseException) -> str:
    """What an ``MXNetError`` says: its last line (1.9.1's text starts with the C++ frames,
    "Traceback (most recent call last):"), without the class name it repeats."""
    lines = [ln.strip() for ln in str(exc).strip().splitlines() if ln.strip()]
    last = lines[-1] if lines else type(exc).__name__
    return last.removeprefix("MXNetError:").strip() or last


def as_loader_error(exc: BaseException, plan: object) -> BaseException:
    """``exc`` as raised to the caller by a loader thread reading ``plan``: an ``MXNetError`` is
    a LoaderError naming the generation and store; no traceback kept (its frames would keep a
    native reader alive)."""
    import mxnet as mx  # loaded by then: only the loader's threads call this

    if isinstance(exc, mx.base.MXNetError):
        exc = LoaderError(f"MXNet's reader failed on generation {plan.generation} "  # type: ignore[attr-defined]
                          f"({len(plan.shards)} shards in {plan.store}): {mxnet_reason(exc)}")  # type: ignore
    return exc.with_traceback(None)


@contextlib.contextmanager
def as_loader_errors() -> Iterator[None]:
    """What a store raises (shardgen's errors: a shard, a manifest, a cache, an object store) as
    the loader's: ``StoreUnreachable`` as ``StoreUnreachableError``, the rest as ``LoaderError``."""
    try:
        yield
    except StoreUnreachable as exc:
        raise StoreUnreachableError(str(exc)) from None
    except ShardgenError as exc:
        raise LoaderError(str(exc)) from None
