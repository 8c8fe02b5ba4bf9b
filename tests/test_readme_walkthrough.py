"""README "Your own generator and processor", run as written: its files are extracted from
README.md and its commands run in a fresh folder, so the documentation cannot drift."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT

SECTION = "## Your own generator and processor"
FENCE = re.compile(r"^```(\w*)\n(.*?)^```\n", re.M | re.S)


def walkthrough_steps() -> list:
    """("file", name, text) for a block whose preceding line ends with `name`:, ("sh", commands),
    ("text", expected output); in README order."""
    readme = (ROOT / "README.md").read_text()
    start = readme.index(SECTION)
    end = readme.index("\n## ", start + len(SECTION))
    section = readme[start:end]
    steps = []
    for m in FENCE.finditer(section):
        lang, body = m.group(1), m.group(2)
        before = section[:m.start()].rstrip("\n").splitlines()[-1]
        named = re.search(r"`([\w.]+)`:$", before)
        if lang == "sh":
            steps.append(("sh", [ln for ln in body.splitlines() if ln.strip()]))
        elif lang == "text":
            steps.append(("text", body))
        elif named:
            steps.append(("file", named.group(1), body))
        else:
            raise AssertionError(f"README walk-through: a {lang} block after {before!r} names no file")
    return steps


@pytest.mark.slow
def test_readme_walkthrough_runs_as_written(tmp_path):
    steps = walkthrough_steps()
    files = [s[1] for s in steps if s[0] == "file"]
    assert files == ["mygen.py", "gen.json", "myproc.py", "shardgen.toml", "read.py"]
    folder = tmp_path / "myproject"
    folder.mkdir()
    env = {**os.environ, "PYTHONPATH": str(ROOT),
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    output = ""
    for step in steps:
        if step[0] == "file":
            (folder / step[1]).write_text(step[2])
        elif step[0] == "sh":
            output = ""
            for command in step[1]:
                r = subprocess.run(command, shell=True, cwd=folder, env=env, capture_output=True, text=True,
                                   timeout=180)
                assert r.returncode == 0, f"{command}: exit {r.returncode}\n{r.stdout}{r.stderr}"
                output += r.stdout
        else:  # expected output: every line's pieces around "..." appear in order on one line printed
            printed = output.splitlines()
            for expected in step[1].splitlines():
                pattern = ".*".join(re.escape(piece) for piece in expected.split("..."))
                assert any(re.fullmatch(pattern, line) for line in printed), \
                    f"README says {expected!r}; printed:\n{output}"
    assert (folder / "shards" / "manifest.json").exists()
