"""A new store kind is one module and one line where stores are opened (issue 55): the ``fake://``
kind (``tests/fake_objects.py``, named in ``SHARDGEN_OBJECT_STORES``) is built by the real CLI from
a config whose ``store.dir`` is its URL, and read by ``ShardIter``, with no other change."""

from __future__ import annotations

import os

import pytest
from conftest import ROOT, batch_ids, write_config
from fake_objects import FakeServer
from test_s3_store import cli, s3_config

from loader import ShardIter
from shardgen.config import ConfigError, load_config
from shardgen.produce.build import build
from shardgen.store.manifest import Manifest


@pytest.fixture
def fake(tmp_path, monkeypatch):
    server = FakeServer(tmp_path / "objects").start()
    for key, value in server.env().items():
        monkeypatch.setenv(key, value)
    return server


def test_a_config_on_a_new_store_kind_builds_with_the_cli_and_is_read(fake, tmp_path):
    cfg = s3_config(tmp_path / "remote", fake.url("st"))
    assert load_config(cfg).store.dir == (tmp_path / "remote" / ".shardgen-staging" / "data" / "st").resolve()
    r = cli("build", "-c", cfg, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests")]))
    assert r.returncode == 0, r.stderr
    assert "published 4 dates" in r.stdout
    published = Manifest.load(fake.root / "data" / "st" / "manifest.json")
    assert len(published.shards) == 4

    local_cfg = tmp_path / "local"
    build(load_config(write_config(local_cfg)))
    want = Manifest.load(local_cfg / "shards" / "manifest.json")
    assert [(s.date, s.sha256) for s in published.shards] == [(s.date, s.sha256) for s in want.shards]
    with ShardIter(fake.url("st"), 8, cache_dir=tmp_path / "cache") as it:
        ids = sorted(i for b in it for i in batch_ids(b))
    with ShardIter(local_cfg / "shards", 8, cache_dir=tmp_path / "cache2") as it:
        assert ids == sorted(i for b in it for i in batch_ids(b))


def test_a_url_of_no_known_kind_is_one_config_error(tmp_path):
    path = write_config(tmp_path / "c")
    path.write_text(path.read_text().replace('dir = "shards"', 'dir = "gs://data/st"'))
    with pytest.raises(ConfigError, match=r"store\.dir: gs://data/st: no store kind for gs:// \(known: s3://"):
        load_config(path)
