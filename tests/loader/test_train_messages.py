"""The training example's messages speak its own command line (issue 62, item 10)."""

import os
import subprocess
import sys

from conftest import ROOT, make_store


def test_no_writable_cache_names_the_flag_not_the_keyword(tmp_path):
    """No writable ~/.cache (HOME is not a folder, no XDG_CACHE_HOME): one line telling a CLI user
    to pass ``--cache-dir`` (the keyword ``cache_dir=`` is the library's)."""
    make_store(tmp_path / "s", {"2024-01-02": 20})
    env = {k: v for k, v in os.environ.items() if k != "XDG_CACHE_HOME"}
    env["HOME"] = "/dev/null"
    r = subprocess.run([sys.executable, "-m", "loader.tools.train", "--manifest", tmp_path / "s/manifest.json",
                        "--epochs", "1", "--batch-size", "8", "--hidden", "4", "--target", "a"],
                       capture_output=True, text=True, timeout=180, cwd=ROOT, env=env)
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr and "pass --cache-dir a writable folder" in r.stderr, r.stderr
    assert "cache_dir=" not in r.stderr, r.stderr
