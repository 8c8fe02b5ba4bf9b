"""A normal (not editable) install holds every package the code imports, and no bench code."""

import shutil
import subprocess
import sys
import sysconfig

from conftest import ROOT


def test_a_plain_install_imports_and_ships_no_benchmarks(tmp_path):
    # From the tracked files only: setuptools reuses a work tree's build/lib, which could hold
    # packages the configuration leaves out.
    src, target = tmp_path / "src", tmp_path / "site"
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True, timeout=60).stdout
    for name in files.decode().split("\0"):
        if name and (ROOT / name).is_file():
            (src / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, src / name)
    r = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(target),
                        str(src)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert not (target / "benchmarks").exists()
    # -S: no site hooks, so the editable install of the work tree cannot fill in a missing package.
    code = ("import sys; sys.path[:0] = [sys.argv[1], sys.argv[2]]; import loader, shardgen.cli, shardgen.format; "
            "from shardgen.format import unpack_samples; "
            "assert loader.__file__.startswith(sys.argv[1]), loader.__file__")
    r = subprocess.run([sys.executable, "-S", "-c", code, str(target), sysconfig.get_paths()["purelib"]],
                       capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
