"""Fresh virtual environments for the install tests: the project's tracked files, a wheelhouse of
its wheel and its requirements' wheels (so installs run with ``--no-index``), a stub CUDA MXNet."""

from __future__ import annotations

import base64
import hashlib
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

try:
    import tomllib
except ImportError:  # Python < 3.11
    import tomli as tomllib

from conftest import ROOT

STUB = "mxnet-cu112"  # a CUDA build of MXNet: another distribution, the same import name


def tracked_copy(dest: Path) -> Path:
    """The work tree's tracked files (setuptools reuses a work tree's build/lib, which could hold
    packages the configuration leaves out)."""
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True, timeout=60).stdout
    for name in files.decode().split("\0"):
        if name and (ROOT / name).is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, dest / name)
    return dest


def run(*argv, timeout: float = 300, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([str(a) for a in argv], capture_output=True, text=True, timeout=timeout, **kw)


def wheelhouse(src: Path, dest: Path) -> Path:
    """``dest`` holding the wheels of what ``src``'s pyproject requires (to run and to build: fetched
    from the registry) and the project's own wheel."""
    meta = tomllib.loads((src / "pyproject.toml").read_text())
    needs = meta["project"]["dependencies"] + meta["build-system"]["requires"]
    r = run(sys.executable, "-m", "pip", "download", "--quiet", "--dest", dest, *needs)
    assert r.returncode == 0, r.stderr
    r = run(sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-index", "--find-links", dest,
            "--wheel-dir", dest, src)
    assert r.returncode == 0, r.stderr
    return dest


def fresh_venv(folder: Path) -> Path:
    """A new venv (nothing of this one's site-packages); its python."""
    r = run(sys.executable, "-m", "venv", folder, timeout=120)
    assert r.returncode == 0, r.stderr
    return folder / "bin" / "python"


def pip_install(python: Path, *args, links: Path) -> subprocess.CompletedProcess:
    """``pip install`` from ``links`` only, never the registry."""
    return run(python, "-m", "pip", "install", "--quiet", "--no-index", "--find-links", links, *args)


def stub_wheel(folder: Path) -> Path:
    """A wheel of ``mxnet-cu112`` 1.9.1 whose package is ``mxnet`` (two small files, one standing for
    the CUDA library)."""
    files = {"mxnet/__init__.py": b'"""A stand-in for a CUDA build of MXNet."""\n__version__ = "1.9.1"\n',
             "mxnet/libmxnet.so": b"\x7fELF not really: the CUDA build's library\n"}
    info = "mxnet_cu112-1.9.1.dist-info"
    files[f"{info}/METADATA"] = f"Metadata-Version: 2.1\nName: {STUB}\nVersion: 1.9.1\n".encode()
    files[f"{info}/WHEEL"] = b"Wheel-Version: 1.0\nGenerator: tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    record = [f"{name},sha256={_digest(data)},{len(data)}" for name, data in files.items()] + [f"{info}/RECORD,,"]
    files[f"{info}/RECORD"] = ("\n".join(record) + "\n").encode()
    path = folder / "mxnet_cu112-1.9.1-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as zf:
        for name, data in files.items():
            zf.writestr(name, data)
    return path


def _digest(data: bytes) -> str:
    return base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def package_files(python: Path, package: str) -> dict:
    """``{relative path: sha256}`` of every file of the import package ``package`` in ``python``'s venv."""
    code = ("import hashlib, importlib.util, json, pathlib, sys; "
            "root = pathlib.Path(importlib.util.find_spec(sys.argv[1]).origin).parent; "
            "print(json.dumps({str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() "
            "for p in sorted(root.rglob('*')) if p.is_file() and '__pycache__' not in p.parts}))")
    r = run(python, "-c", code, package, timeout=60)
    assert r.returncode == 0, r.stderr
    import json

    return json.loads(r.stdout)


def distributions(python: Path) -> set:
    """The names of the distributions installed in ``python``'s venv."""
    r = run(python, "-c", "import importlib.metadata as m; print('\\n'.join(d.metadata['Name'] for d in "
                          "m.distributions()))", timeout=60)
    assert r.returncode == 0, r.stderr
    return {name.lower() for name in r.stdout.split()}
