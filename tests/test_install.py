"""Installing the project: a normal install holds every package the code imports and no bench code;
it never installs or replaces an MXNet already there (issue 63: a CUDA build was overwritten by the
CPU wheel, silently); without MXNet, ``import loader`` says what to install; the wheel carries the
demo (``shardgen demo DIR``), which builds what ``make shards`` builds. Real pip into fresh venvs."""

import json
import os
import re
import subprocess
import sys
import sysconfig

import numpy as np
import pytest
import venvs
from conftest import ROOT
from venvs import STUB, distributions, fresh_venv, package_files, pip_install, run, stub_wheel, tracked_copy


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return tracked_copy(tmp_path_factory.mktemp("src"))


@pytest.fixture(scope="module")
def wheels(source, tmp_path_factory):
    """The project's wheel and its requirements' (fetched once from the registry)."""
    return venvs.wheelhouse(source, tmp_path_factory.mktemp("wheels"))


def test_a_plain_install_imports_and_ships_no_benchmarks(tmp_path, source):
    target = tmp_path / "site"
    r = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(target),
                        str(source)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert not (target / "benchmarks").exists()
    # -S: no site hooks, so the editable install of the work tree cannot fill in a missing package.
    code = ("import sys; sys.path[:0] = [sys.argv[1], sys.argv[2]]; import loader, shardgen.cli, shardgen.format; "
            "from shardgen.format import unpack_samples; "
            "assert loader.__file__.startswith(sys.argv[1]), loader.__file__")
    r = subprocess.run([sys.executable, "-S", "-c", code, str(target), sysconfig.get_paths()["purelib"]],
                       capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert r.returncode == 0, r.stderr


@pytest.mark.slow
@pytest.mark.parametrize("how", ["wheel", "editable"])
def test_installing_the_project_keeps_the_cuda_mxnet_already_there(tmp_path, source, wheels, how):
    """A venv holding ``mxnet-cu112`` (a stub: same import name ``mxnet``): installing the project adds
    no ``mxnet`` distribution and leaves the CUDA build's files as they were; ``import loader`` then
    says that MXNet is not usable, and with none at all which command installs one."""
    python = fresh_venv(tmp_path / "venv")
    r = pip_install(python, "--no-deps", stub_wheel(tmp_path), links=wheels)
    assert r.returncode == 0, r.stderr
    before = package_files(python, "mxnet")
    r = pip_install(python, *(["-e", source] if how == "editable" else ["shardgen"]), links=wheels)
    assert r.returncode == 0, r.stdout + r.stderr
    installed = distributions(python)
    assert "shardgen" in installed and STUB in installed
    assert "mxnet" not in installed, "installing the project installed the CPU MXNet over the CUDA one"
    assert package_files(python, "mxnet") == before, "the CUDA build's files changed"

    r = run(python, "-c", "import loader", cwd=tmp_path, timeout=120)
    assert r.returncode == 1
    assert re.search(r"MXNetMissing: loader needs MXNet 1\.9\.1, and the mxnet package found \(.*\) has no mxnet\.io",
                     r.stderr), r.stderr
    assert run(python, "-m", "pip", "uninstall", "--quiet", "--yes", STUB).returncode == 0
    r = run(python, "-c", "import loader", cwd=tmp_path, timeout=120)
    last = r.stderr.strip().splitlines()[-1]
    assert r.returncode == 1 and "import mxnet failed (No module named 'mxnet')" in last, r.stderr
    assert 'pip install "mxnet==1.9.1"' in last and 'pip install "mxnet-cu112==1.9.1"' in last
    assert 'pip install "shardgen[cpu]"' in last


def _shards(manifest_path):
    manifest = json.loads(manifest_path.read_text())
    return manifest["schema"], [(s["date"], s["records"], s["sha256"]) for s in manifest["shards"]]


@pytest.mark.slow
def test_the_wheel_carries_the_demo_and_it_builds_what_make_shards_builds(tmp_path, wheels):
    """From the wheel in a fresh venv (no checkout, no MXNet): ``shardgen demo DIR`` writes the demo
    config and the generator, built with g++ or as its Python stand-in; ``shardgen build`` on either
    gives the shards the checkout's config and build/seqgen give (``make shards``), byte for byte."""
    python = fresh_venv(tmp_path / "venv")
    r = pip_install(python, "shardgen", links=wheels)
    assert r.returncode == 0, r.stdout + r.stderr
    shardgen = python.parent / "shardgen"
    checkout = tmp_path / "checkout"
    (checkout / "build").mkdir(parents=True)
    (checkout / "shardgen.toml").write_text((ROOT / "shardgen.toml").read_text())
    (checkout / "build" / "seqgen").symlink_to(ROOT / "build" / "seqgen")  # what make install built
    r = run(sys.executable, "-m", "shardgen.cli", "build", "-c", checkout / "shardgen.toml", "--end", "2024-01-04")
    assert r.returncode == 0, r.stderr
    expected = _shards(checkout / "shards" / "manifest.json")
    assert [date for date, _, _ in expected[1]] == ["2024-01-02", "2024-01-03", "2024-01-04"]
    for kind, flags, says in [("cpp", [], "built build/seqgen with"), ("python", ["--python"], "Python stand-in")]:
        demo = tmp_path / kind
        r = run(shardgen, "demo", demo, *flags, cwd=tmp_path)
        assert r.returncode == 0 and says in r.stdout, r.stdout + r.stderr
        assert f"shardgen build -c {demo / 'shardgen.toml'}" in r.stdout
        r = run(shardgen, "build", "-c", demo / "shardgen.toml", "--end", "2024-01-04", cwd=tmp_path)
        assert r.returncode == 0, r.stderr
        assert _shards(demo / "shards" / "manifest.json") == expected, kind
    r = run(shardgen, "demo", tmp_path / "cpp")
    assert r.returncode == 2 and "shardgen.toml exists already" in r.stderr, r.stderr


def test_the_packaged_demo_config_is_the_checkouts():
    assert (ROOT / "shardgen" / "reference" / "shardgen.toml").read_text() == (ROOT / "shardgen.toml").read_text()


def test_the_readme_says_which_pythons_and_why():
    """requires-python stops at 3.11: the README's set-up lines say so, and why (numpy<1.24)."""
    requires = venvs.tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"]
    assert requires == ">=3.9,<3.12"
    setup = (ROOT / "README.md").read_text().split("## What it is for")[0]
    assert "Python 3.9–3.11" in setup and "numpy<1.24" in setup and "3.12" in setup


@pytest.mark.parametrize("version, refused", [("1.23.5", False), ("1.24.0", True), ("2.0.1", True),
                                              ("1.16.6", False), ("1.25.0.dev0+1", True)])
def test_numpy_from_1_24_is_named_as_what_breaks_mxnet(version, refused):
    from loader.framework import numpy_problem

    problem = numpy_problem(version)
    assert (problem is not None) == refused
    if refused:
        assert f"numpy {version} is installed, and MXNet 1.9.1 needs numpy<1.24" in problem


def test_a_compiler_that_fails_leaves_the_demo_on_the_python_stand_in(tmp_path):
    """``shardgen demo`` with a compiler that fails says why and writes the stand-in's config, whose
    first date is the one build/seqgen (``make install``) writes."""
    r = run(sys.executable, "-m", "shardgen.cli", "demo", tmp_path / "demo", env={**os.environ, "CXX": "false"})
    assert r.returncode == 0, r.stderr
    assert "Python stand-in seqgen.py (same data, slower): " in r.stdout and "false failed (exit 1" in r.stdout
    assert not (tmp_path / "demo" / "build" / "seqgen").exists()
    r = run(sys.executable, "-m", "shardgen.cli", "build", "-c", tmp_path / "demo" / "shardgen.toml", "--end",
            "2024-01-02")
    assert r.returncode == 0, r.stderr
    raw = np.load(tmp_path / "demo" / "raw" / "2024-01-02.npy")
    r = run(ROOT / "build" / "seqgen", "--date", "2024-01-02", "--out", tmp_path / "c.npy", "--cols", "37",
            "--targets", "5")
    assert r.returncode == 0, r.stderr
    np.testing.assert_array_equal(raw, np.load(tmp_path / "c.npy"))
