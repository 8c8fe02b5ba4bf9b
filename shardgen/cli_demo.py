"""``shardgen demo DIR [--python]``: the command line of :mod:`shardgen.demo` (parses, delegates,
prints the result), kept beside ``shardgen/cli.py`` which adds it to its subcommands."""

from __future__ import annotations

import argparse
from pathlib import Path

from shardgen.demo import write_demo

__all__ = ["add_demo_parser", "run_demo"]


def add_demo_parser(sub) -> None:
    """``shardgen demo DIR [--python]`` on the CLI's subcommands."""
    d = sub.add_parser("demo", help="write the demo (config and reference generator) into a folder",
                       description="Write the demo config and the reference generator into DIR, building the "
                                   "generator with the C++ compiler there is ($CXX, g++ or c++), else using its "
                                   "Python stand-in (same data). Then: shardgen build -c DIR/shardgen.toml")
    d.add_argument("dir", type=Path, metavar="DIR", help="folder to write into (created; must hold no shardgen.toml)")
    d.add_argument("--python", action="store_true", help="use the Python stand-in even when a compiler is there")
    d.set_defaults(verbose=0)


def run_demo(args: argparse.Namespace) -> int:
    demo = write_demo(args.dir, python=args.python)
    print(f"wrote {demo.config}; generator: {demo.how}")
    print(f"next: shardgen build -c {demo.config}")
    return 0
