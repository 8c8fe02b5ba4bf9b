"""``shardgen status`` says only what is still true (issue 62 review): a damaged build state is one
warning (status and build go on), a failed date that left the configured range is no longer counted
as failing, and a watcher's refused cycle stops counting once a later generation was published."""

from __future__ import annotations

import json

import pytest
from conftest import shardgen_cli, write_config

pytestmark = pytest.mark.slow

FMT = "shardgen-build/1"


@pytest.mark.parametrize("doc", [
    {"format": FMT, "failing": None},
    {"format": FMT, "failing": [1]},
    {"format": FMT, "failing": [{"attempts": 1}]},
    {"format": FMT, "empty": "x"},
    {"format": FMT, "empty": [{"date": 5}]},
    {"format": FMT, "failing": [{"date": "2024-01-03", "attempts": "x"}]},
    {"format": FMT, "failing": [{"date": "2024-01-03", "attempts": 1, "error": 7}]},
    {"format": FMT, "failing": [], "updated": 3},
], ids=["failing null", "failing [1]", "no date", "empty str", "empty date int", "attempts str", "error int",
        "updated int"])
def test_a_damaged_build_state_is_one_warning_and_status_and_build_go_on(tmp_path, doc):
    cfg = write_config(tmp_path / "p", start="2024-01-02", end="2024-01-03", modes={"2024-01-03": "fail"})
    assert shardgen_cli("build", "-c", cfg).returncode == 1
    state = tmp_path / "p" / "shards" / ".build-state.json"
    state.write_text(json.dumps(doc))
    s = shardgen_cli("status", "-c", cfg)
    assert "Traceback" not in s.stderr and s.returncode == 0, s.stderr
    assert f"{state}: unreadable build state" in s.stderr, s.stderr
    (tmp_path / "p" / "modes.json").write_text("{}")
    b = shardgen_cli("build", "-c", cfg)
    assert "Traceback" not in b.stderr and b.returncode == 0, b.stderr
    assert "published 1 dates" in b.stdout and f"{state}: unreadable build state" in b.stderr
    assert json.loads(state.read_text())["failing"] == []  # written anew


def test_a_failed_date_that_left_the_configured_range_is_not_counted(tmp_path):
    cfg = write_config(tmp_path / "p", start="2024-01-02", end="2024-01-03", modes={"2024-01-03": "fail"})
    assert shardgen_cli("build", "-c", cfg).returncode == 1
    cfg.write_text(cfg.read_text().replace('end = "2024-01-03"', 'end = "2024-01-02"'))
    assert shardgen_cli("build", "-c", cfg).returncode == 0
    s = shardgen_cli("status", "-c", cfg)
    assert s.returncode == 0, s.stdout
    assert "tried again by the next build" not in s.stdout
    assert "failed 2024-01-03 (build, outside the configured dates now: no build tries it again)" in s.stdout
    info = json.loads(shardgen_cli("status", "-c", cfg, "--json").stdout)
    assert info["failing"] == [] and [f["date"] for f in info["build_outside"]] == ["2024-01-03"]
    cfg.write_text(cfg.read_text().replace('end = "2024-01-02"', 'end = "2024-01-03"'))  # back in range: counted
    assert shardgen_cli("status", "-c", cfg).returncode == 1


def test_a_refused_watch_cycle_stops_counting_once_a_later_generation_is_published(tmp_path):
    cfg = write_config(tmp_path / "p", start="2024-01-02", end="2024-01-02")
    assert shardgen_cli("build", "-c", cfg).returncode == 0
    good = cfg.read_text()
    cfg.write_text(good.replace("time_steps = 5", "time_steps = 6"))
    assert shardgen_cli("watch", "-c", cfg, "--once").returncode == 2
    cfg.write_text(good)
    s = shardgen_cli("status", "-c", cfg)  # nothing published since: still the watcher's error
    assert s.returncode == 1 and "watcher: last cycle FAILED, no date was tried:" in s.stdout, s.stdout
    watch_state = json.loads((tmp_path / "p" / "shards" / ".watch-state.json").read_text())
    assert watch_state["updated"] in s.stdout  # when it failed
    assert watch_state["generation"] == 1  # the manifest it was refused against
    cfg.write_text(good.replace('end = "2024-01-02"', 'end = "2024-01-03"'))  # reverted, one more date
    assert shardgen_cli("build", "-c", cfg).returncode == 0
    s = shardgen_cli("status", "-c", cfg)
    assert s.returncode == 0, s.stdout
    assert "FAILED" not in s.stdout and "but the manifest was published since" in s.stdout, s.stdout
    info = json.loads(shardgen_cli("status", "-c", cfg, "--json").stdout)
    assert info["watch_error"] and info["watch_error_superseded"] is True
