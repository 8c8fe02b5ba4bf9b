"""The mutation ledger (issue 64): every entry of every spec in ``tests/mutations/`` still applies.

An entry whose file is gone, or whose ``find`` no longer occurs exactly ``count`` times (default 1),
mutates nothing: ``mutate.py`` reports it as an error and the logic it guarded goes unwatched. Each
such entry is repointed to the same logic where it moved, or removed with the logic."""

from __future__ import annotations

import json
import re
from pathlib import Path

from conftest import ROOT

SPECS = ROOT / "tests" / "mutations"


def stale_entries(specs: Path, root: Path) -> list[str]:
    """One line per entry of the specs under ``specs`` that does not apply to the tree at ``root``."""
    stale = []
    for spec in sorted(specs.glob("*.json")):
        try:
            entries = json.loads(spec.read_text())
        except ValueError as exc:
            stale.append(f"{spec.name}: not valid JSON ({exc})")
            continue
        for i, m in enumerate(entries):
            where = f"{spec.name}[{i}] {m.get('name')!r}"
            missing = [k for k in ("name", "file", "find", "replace", "tests") if k not in m]
            if missing:
                stale.append(f"{where}: no {', '.join(missing)}")
                continue
            path = root / m["file"]
            if not path.is_file():
                stale.append(f"{where}: {m['file']} does not exist")
                continue
            want, found = int(m.get("count", 1)), path.read_text().count(m["find"])
            if found != want:
                stale.append(f"{where}: its find occurs {found} times in {m['file']}, expected {want}")
            for test in m["tests"]:
                test_file, _, name = test.partition("::")
                if not (root / test_file).is_file():
                    stale.append(f"{where}: names test file {test}, which does not exist")
                elif name and not _defines(root / test_file, name.split("::")[0].split("[")[0]):
                    stale.append(f"{where}: names test {test}, which {test_file} does not define")
    return stale


def _defines(path: Path, name: str) -> bool:
    """Whether the test file defines the test function or class ``name`` (pytest would run nothing)."""
    pattern = rf"^(?:async )?def {re.escape(name)}\(|^class {re.escape(name)}\b"
    return re.search(pattern, path.read_text(), re.M) is not None


def test_every_mutation_entry_applies():
    stale = stale_entries(SPECS, ROOT)
    assert not stale, f"{len(stale)} mutation entries no longer apply:\n" + "\n".join(stale)


def test_a_stale_entry_is_listed(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "a.py").write_text("x = 1\nx = 1\n")
    (tmp_path / "t.py").write_text("def test_y():\n    pass\n")
    entries = [{"name": "ok", "file": "a.py", "find": "x = 1", "replace": "x = 2", "count": 2, "tests": ["t.py"]},
               {"name": "once", "file": "a.py", "find": "x = 1", "replace": "x = 2", "tests": ["t.py"]},
               {"name": "gone", "file": "b.py", "find": "x", "replace": "y", "tests": ["t.py::test_x"]},
               {"name": "no test", "file": "a.py", "find": "x = 1\nx", "replace": "y", "tests": ["u.py"]},
               {"name": "named", "file": "a.py", "find": "x = 1\nx", "replace": "y", "tests": ["t.py::test_y[1]"]},
               {"name": "unnamed", "file": "a.py", "find": "x = 1\nx", "replace": "y", "tests": ["t.py::test_x"]}]
    (tmp_path / "m" / "s.json").write_text(json.dumps(entries))
    assert stale_entries(tmp_path / "m", tmp_path) == [
        "s.json[1] 'once': its find occurs 2 times in a.py, expected 1",
        "s.json[2] 'gone': b.py does not exist",
        "s.json[3] 'no test': names test file u.py, which does not exist",
        "s.json[5] 'unnamed': names test t.py::test_x, which t.py does not define"]
