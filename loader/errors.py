"""Errors the loader raises before MXNet's C++ code could crash or hang on bad input."""

__all__ = ["LoaderError", "StoreUnreachableError", "mxnet_reason"]


class LoaderError(Exception):
    """Bad manifest, missing or truncated shard, bad argument: the message names which."""


class StoreUnreachableError(LoaderError):
    """The store (an object store) could not be reached within its retries: at ``reset()`` the
    generation already held is read again."""


def mxnet_reason(exc: BaseException) -> str:
    """What an ``MXNetError`` says: its last line (1.9.1's text starts with the C++ frames,
    "Traceback (most recent call last):"), without the class name it repeats."""
    lines = [ln.strip() for ln in str(exc).strip().splitlines() if ln.strip()]
    last = lines[-1] if lines else type(exc).__name__
    return last.removeprefix("MXNetError:").strip() or last
