"""Epoch boundaries (issue 37): what ``reset()`` does in the caller's thread at each epoch's end, and
that doing less of it keeps every epoch exact and every changed file checked."""

import os

import pytest
from conftest import make_store

import loader.source.files as plan_mod
from loader import ShardIter
from shardgen.store.manifest import Manifest
from shardgen.store.naming import MANIFEST_NAME

DATES = {f"2024-01-{d:02d}": 12 for d in range(2, 12)}


@pytest.fixture
def checks(monkeypatch):
    """The shard files ``check_shard`` reads (each a full check, or its cache's lookup), in order."""
    seen, real = [], plan_mod.check_shard

    def counting(fd, rec_path, *args, **kw):
        seen.append(os.path.basename(rec_path))
        return real(fd, rec_path, *args, **kw)

    monkeypatch.setattr(plan_mod, "check_shard", counting)
    return seen


def test_reset_checks_only_the_files_that_changed_also_the_first_time(tmp_path, checks):
    """The plan records each file as it was checked: the first reset() costs one fstat per unchanged
    file, like every later one (it checked all 400 again at 400 shards: 15 ms), and a file whose
    mtime moved is checked again."""
    make_store(tmp_path / "s", DATES)
    m = Manifest.load(tmp_path / "s" / MANIFEST_NAME)
    with ShardIter(tmp_path / "s", 8, cache_dir=tmp_path / "c") as it:
        assert len(checks) == len(DATES)  # the plan checked each file once
        checks.clear()
        assert sum(8 - b.pad for b in it) == m.samples
        it.reset()
        assert checks == []
        rec = tmp_path / "s" / m.shards[3].rec
        st = rec.stat()
        os.utime(rec, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
        assert sum(8 - b.pad for b in it) == m.samples
        it.reset()
        assert checks == [os.path.basename(m.shards[3].rec)]
        assert sum(8 - b.pad for b in it) == m.samples
