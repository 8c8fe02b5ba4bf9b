"""One measurement in a fresh interpreter: nothing else of the bench in its memory or threads."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

__all__ = ["json_from_subprocess"]


def json_from_subprocess(code: str, what: str, timeout: float = 3600) -> dict:
    """Run ``code`` (Python that prints one JSON line last) in a fresh interpreter at the repo root."""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout,
                       cwd=Path(__file__).resolve().parent.parent)
    if r.returncode != 0:
        raise RuntimeError(f"{what} failed ({r.returncode}): {r.stderr.strip()[-2000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])
