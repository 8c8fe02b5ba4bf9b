"""MXNet is the user's choice, not a requirement of this project: the CPU wheel (``mxnet``) or a
CUDA one (``mxnet-cu112`` …) all install the same ``mxnet`` package, and installing ``shardgen``
must never replace the one already there (``pip install "shardgen[cpu]"`` adds the CPU wheel).

``require_mxnet()`` runs when ``loader`` is imported: without a usable MXNet 1.9.1 (with
``numpy<1.24``: newer numpy breaks ``import mxnet``) it raises ``MXNetMissing``, one message saying
what was found and which command installs MXNet. ``shardgen`` itself never imports MXNet.
"""

from __future__ import annotations

from typing import Optional

__all__ = ["MXNetMissing", "INSTALL", "numpy_problem", "require_mxnet"]

INSTALL = ('on a CPU machine: pip install "mxnet==1.9.1" (or pip install "shardgen[cpu]"); on a CUDA machine '
           'the wheel matching its CUDA, e.g. pip install "mxnet-cu112==1.9.1"; either with "numpy<1.24"')
NEEDED = ("io", "recordio", "kv", "nd")  # what the loader uses of MXNet


class MXNetMissing(ImportError):
    """No usable MXNet in this environment; the message says which command installs one."""


def numpy_problem(version: str) -> Optional[str]:
    """Why numpy ``version`` cannot run MXNet 1.9.1, or None when it can."""
    try:
        major, minor = (int(part) for part in version.split(".")[:2])
    except ValueError:
        return None  # a development build: let import mxnet say
    if (major, minor) >= (1, 24):
        return f"numpy {version} is installed, and MXNet 1.9.1 needs numpy<1.24 (it uses np.bool, removed in 1.24)"
    return None


def require_mxnet() -> None:
    """Import MXNet, or raise ``MXNetMissing`` saying what is wrong and what to install."""
    import numpy

    problem = numpy_problem(numpy.__version__)
    if problem is not None:
        raise MXNetMissing(f"loader needs MXNet 1.9.1: {problem}. Install: {INSTALL}")
    try:
        import mxnet
    except (ImportError, OSError) as exc:  # not installed; a CUDA wheel without its libraries
        raise MXNetMissing(f"loader needs MXNet 1.9.1, and import mxnet failed ({exc}). Install: {INSTALL}") from None
    missing = [name for name in NEEDED if not hasattr(mxnet, name)]
    if missing:
        where = getattr(mxnet, "__file__", None) or "a namespace package"
        raise MXNetMissing(f"loader needs MXNet 1.9.1, and the mxnet package found ({where}) has no "
                           f"mxnet.{missing[0]}: not a usable MXNet. Install: {INSTALL}")
