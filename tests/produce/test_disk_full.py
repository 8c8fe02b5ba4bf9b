"""Issue 54 item 10: a full store disk. ``fsync`` (or a write) failing with ENOSPC names no file;
it is injected here in-process for one file (as a full disk or an NFS server's quota answers a
delayed write) and the build must name the path, publish what was finished, or say why not."""

import datetime as dt
import errno
import os
import re

import pytest
from conftest import write_config

import shardgen.fsutil as fsutil
from shardgen.config import load_config
from shardgen.errors import is_environment
from shardgen.produce.build import build
from shardgen.store.manifest import Manifest


def full_for(monkeypatch, fragment: str) -> None:
    """``os.fsync`` in shardgen.fsutil fails with ENOSPC (no file named) for files whose path holds
    ``fragment``, as the kernel says it."""
    real = os.fsync

    def fsync(fd):
        if fragment in os.readlink(f"/proc/self/fd/{fd}"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(fd)

    monkeypatch.setattr(fsutil.os, "fsync", fsync)


def test_a_full_disk_names_the_file_and_the_finished_shards_are_published(cfg_dir, monkeypatch):
    cfg = load_config(write_config(cfg_dir, end="2024-01-05"))
    full_for(monkeypatch, "2024-01-04.rec")
    report = build(cfg)
    store = cfg.store.dir
    assert [(d.isoformat(), m) for d, m in report.failed] == [
        ("2024-01-04", f"2024-01-04: {store / '2024-01-04.rec'}: No space left on device")]
    assert report.environment  # exit 3
    m = Manifest.load(store / "manifest.json")
    assert [s.date for s in m.shards] == ["2024-01-02", "2024-01-03", "2024-01-05"]  # what finished
    assert not [p for p in store.iterdir() if ".tmp-" in p.name]


def test_a_manifest_that_cannot_be_written_says_why_and_the_next_build_adopts(cfg_dir, monkeypatch):
    cfg = load_config(write_config(cfg_dir, end="2024-01-05"))
    full_for(monkeypatch, "generations")
    snapshot = cfg.store.dir / "generations" / "1.json"
    with pytest.raises(OSError, match=re.escape("No space left on device; 4 finished shards (2024-01-02, "
                                                "2024-01-03, 2024-01-04, ...) are complete in the store but not "
                                                "in the manifest: the next build adopts them")) as caught:
        build(cfg, publish_every_s=3600)
    assert caught.value.filename == str(snapshot) and is_environment(caught.value)
    assert not (cfg.store.dir / "manifest.json").exists()
    monkeypatch.undo()  # room again
    report = build(cfg)
    assert not report.failed and len(report.published) == 4
    assert [s.date for s in Manifest.load(cfg.store.dir / "manifest.json").shards] == [
        d.isoformat() for d in (dt.date(2024, 1, 2), dt.date(2024, 1, 3), dt.date(2024, 1, 4), dt.date(2024, 1, 5))]
