"""``shardgen demo DIR``: the checkout's demo (``make shards``) from an installed package.

The wheel carries ``shardgen/reference/``: the demo config (``shardgen.toml``, the checkout's own),
the reference generator's source (``seqgen.cpp``) and its Python stand-in (``seqgen.py``, a port that
writes the same arrays). ``write_demo`` copies them into a folder and builds the generator with the
C++ compiler there is (``$CXX``, else ``g++``, else ``c++``, with the Makefile's flags); with none,
or when asked, the config runs the stand-in with this Python instead. ``shardgen build -c
DIR/shardgen.toml`` then gives what ``make shards`` gives: the same dates, windows and schema.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from shardgen.errors import ConfigError

__all__ = ["REFERENCE", "Demo", "compiler", "write_demo"]

REFERENCE = Path(__file__).resolve().parent / "reference"
CONFIG = "shardgen.toml"
CXXFLAGS = ["-O2", "-std=c++17", "-Wall"]  # the Makefile's
_CPP_COMMAND = 'command = ["build/seqgen", '  # the config's generator line, as the checkout has it


@dataclass(frozen=True)
class Demo:
    """What ``write_demo`` made: the config, and the generator it runs (``how`` says which and why)."""

    config: Path
    generator: Path
    how: str


def compiler() -> Optional[str]:
    """The C++ compiler to build the reference generator with, or None."""
    return shutil.which(os.environ.get("CXX") or "g++") or shutil.which("c++")


def write_demo(folder: Path, *, python: bool = False) -> Demo:
    """The demo in ``folder``: config and generator (built with the compiler there is, else the Python
    stand-in; ``python=True`` takes the stand-in always). An existing config there is refused."""
    folder = Path(folder)
    config = folder / CONFIG
    if config.exists():
        raise ConfigError(f"{config} exists already: give an empty or new folder (nothing was written)")
    folder.mkdir(parents=True, exist_ok=True)
    text = (REFERENCE / CONFIG).read_text()
    if _CPP_COMMAND not in text:  # the package's own file: a build of the package changed it
        raise ConfigError(f"{REFERENCE / CONFIG}: no generator line starting {_CPP_COMMAND!r}")
    shutil.copyfile(REFERENCE / "seqgen.cpp", folder / "seqgen.cpp")
    cxx = None if python else compiler()
    why = "asked for the Python stand-in" if python else "no C++ compiler found (set CXX, or install g++)"
    if cxx is not None:
        built = _build(cxx, folder)
        if built is None:
            config.write_text(text)
            return Demo(config, folder / "build" / "seqgen", f"built build/seqgen with {cxx}")
        why = built
    shutil.copyfile(REFERENCE / "seqgen.py", folder / "seqgen.py")
    config.write_text(text.replace(_CPP_COMMAND, f'command = [{json.dumps(sys.executable)}, "seqgen.py", '))
    return Demo(config, folder / "seqgen.py", f"the Python stand-in seqgen.py (same data, slower): {why}")


def _build(cxx: str, folder: Path) -> Optional[str]:
    """Compile ``seqgen.cpp`` into ``build/seqgen``: None when it worked, else why not."""
    (folder / "build").mkdir(exist_ok=True)
    out = folder / "build" / "seqgen"
    try:
        r = subprocess.run([cxx, *CXXFLAGS, "-o", f"{out}.tmp", str(folder / "seqgen.cpp")], capture_output=True,
                           text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"{cxx} could not run ({exc})"
    if r.returncode != 0:
        last = (r.stderr.strip().splitlines() or ["no message"])[-1]
        return f"{cxx} failed (exit {r.returncode}: {last})"
    os.replace(f"{out}.tmp", out)
    return None
