"""``shardgen status`` as a cron monitor of builds and of a refused watcher (issue 62, items 5-7):
the dates a build failed or found empty are listed (exit 1 while one fails), an empty date's message
says what brings it back, and a schema change is refused naming each field that differs."""

from __future__ import annotations

import json

import pytest
from conftest import shardgen_cli, write_config

pytestmark = pytest.mark.slow


def _status(cfg):
    text = shardgen_cli("status", "-c", cfg)
    js = shardgen_cli("status", "-c", cfg, "--json")
    return text, json.loads(js.stdout), js.returncode


def test_status_lists_the_dates_a_build_failed_or_found_empty_until_they_are_published(tmp_path):
    cfg = write_config(tmp_path / "p", start="2024-01-02", end="2024-01-05",
                       modes={"2024-01-03": "fail", "2024-01-04": "few"})
    r = shardgen_cli("build", "-c", cfg)
    assert r.returncode == 1, r.stderr
    text, info, code = _status(cfg)
    assert text.returncode == 1 and code == 1, text.stdout + text.stderr
    assert "failing 2024-01-03 (build, 1 attempt, tried again by the next build): 2024-01-03: generator exited" \
        in text.stdout, text.stdout
    assert "empty 2024-01-04: 2024-01-04: 2 rows, fewer than time_steps=5: no windows" in text.stdout, text.stdout
    assert [(f["date"], f["kind"], f["attempts"]) for f in info["failing"]] == [("2024-01-03", "build", 1)]
    assert [e["date"] for e in info["empty"]] == ["2024-01-04"]

    assert shardgen_cli("build", "-c", cfg).returncode == 1  # fails again: counted
    _, info, _ = _status(cfg)
    assert [(f["date"], f["attempts"]) for f in info["failing"]] == [("2024-01-03", 2)]

    (tmp_path / "p" / "modes.json").write_text(json.dumps({"2024-01-04": "few"}))  # the generator mended
    assert shardgen_cli("build", "-c", cfg).returncode == 0
    text, info, code = _status(cfg)
    assert text.returncode == 0 and code == 0, text.stdout
    assert info["failing"] == [] and [e["date"] for e in info["empty"]] == ["2024-01-04"]
    assert "failing 2024" not in text.stdout and "empty 2024-01-04" in text.stdout
    state = json.loads((tmp_path / "p" / "shards" / ".build-state.json").read_text())
    assert state["failing"] == []  # gone for good: not back once the date leaves the manifest


def test_a_date_a_build_failed_and_a_watcher_published_is_no_longer_listed(tmp_path):
    cfg = write_config(tmp_path / "p", start="2024-01-02", end="2024-01-03", modes={"2024-01-03": "fail"})
    assert shardgen_cli("build", "-c", cfg).returncode == 1
    assert _status(cfg)[2] == 1
    (tmp_path / "p" / "modes.json").write_text("{}")
    r = shardgen_cli("watch", "-c", cfg, "--once")
    assert r.returncode == 0, r.stderr
    text, info, code = _status(cfg)
    assert code == 0 and info["failing"] == [] and info["shards"] == 2, text.stdout


def test_an_empty_date_says_what_brings_it_back_and_that_does(tmp_path):
    cfg = write_config(tmp_path / "p", start="2024-01-02", end="2024-01-03", modes={"2024-01-03": "few"})
    assert shardgen_cli("build", "-c", cfg).returncode == 0
    (tmp_path / "p" / "modes.json").write_text("{}")  # its data arrived
    (tmp_path / "p" / "raw" / "2024-01-03.npy").unlink()
    r = shardgen_cli("build", "-c", cfg)
    hint = "shardgen build --force --start 2024-01-03 --end 2024-01-03"
    assert r.returncode == 0 and "empty 1" in r.stdout and hint in r.stderr, r.stdout + r.stderr
    _, info, _ = _status(cfg)
    assert hint in info["empty"][0]["error"]
    r = shardgen_cli("build", "-c", cfg, "--force", "--start", "2024-01-03", "--end", "2024-01-03")
    assert r.returncode == 0 and "published 1 dates" in r.stdout, r.stdout + r.stderr
    text, info, code = _status(cfg)
    assert info["shards"] == 2 and info["empty"] == [] and code == 0 and "empty 2024" not in text.stdout


@pytest.mark.parametrize("old, new, says", [
    ("time_steps = 5", "time_steps = 6", "schema.time_steps 5 -> 6"),
    ('{name = "b", width = 2}]', '{name = "b", width = 2}, {name = "c", width = 1}]',
     "schema.labels [a:1, b:2] -> [a:1, b:2, c:1]"),
    ("stride = 1", "stride = 2", "store.pack 512 -> 256; store.run_rows (time_steps + (pack - 1) * [process] stride) "
     "516 -> 515"),
    ("[store]", '[store]\nlayout = "windows"', "store.layout runs -> windows"),
], ids=["time_steps", "a label", "stride", "layout"])
def test_a_schema_change_is_refused_naming_each_field_and_status_says_so_after_watch(tmp_path, old, new, says):
    cfg = write_config(tmp_path / "p", start="2024-01-02", end="2024-01-02")
    assert shardgen_cli("build", "-c", cfg).returncode == 0
    assert old in cfg.read_text()
    cfg.write_text(cfg.read_text().replace(old, new))
    r = shardgen_cli("build", "-c", cfg)
    assert r.returncode == 2 and says in r.stderr and "use a new store.dir" in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    keeps = "or set store.pack = 512 and store.run_rows = 516 under [store] to go on writing this one"
    assert (keeps in r.stderr) == (old == "stride = 1"), r.stderr  # only the knobs of runs' size differ
    if old != "time_steps = 5":
        return
    r = shardgen_cli("watch", "-c", cfg, "--once")
    assert r.returncode == 2 and says in r.stderr, r.stderr
    text, info, code = _status(cfg)
    assert text.returncode == 1 and code == 1, text.stdout
    assert says in info["watch_error"]
    assert f"watcher: last cycle FAILED, no date was tried: {tmp_path / 'p' / 'shards' / 'manifest.json'}" \
        in text.stdout and says in text.stdout, text.stdout
