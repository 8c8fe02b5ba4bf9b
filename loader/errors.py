"""Errors the loader raises before MXNet's C++ code could crash or hang on bad input."""

__all__ = ["LoaderError"]


class LoaderError(Exception):
    """Bad manifest, missing or truncated shard, bad argument: the message names which."""
