"""``shardgen verify`` and ``shardgen status`` over damaged published files (issue 54, items 8 and
12b), through the real CLI in subprocesses: every file the store publishes is checked (the
manifest, the kept snapshots, each shard's .rec, .idx and sidecar), each damage named with its
file and what is wrong, exit 1; ``status`` exits 1 when the newest snapshot is damaged."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from conftest import C, T, make_store, shardgen_cli, write_config

from shardgen.store.manifest import Manifest

SNAP2 = "generations/2.json"  # the newest snapshot: generation 2 (the manifest's)
SNAP1 = "generations/1.json"


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    """A project whose store has 2 generations: 2024-01-02 and 03 in the first, 04 added in the
    second (shards of several records, so an .idx has several lines)."""
    folder = tmp_path_factory.mktemp("verify") / "p"
    write_config(folder)
    store = folder / "shards"
    make_store(store, {"2024-01-02": 5, "2024-01-03": 7}, t=T, c=C)
    make_store(store, {"2024-01-04": 6}, t=T, c=C, base_id=12)
    assert json.loads((store / "manifest.json").read_text())["generation"] == 2
    return folder


@pytest.fixture
def project(pristine, tmp_path) -> Path:
    copy = tmp_path / "p"
    shutil.copytree(pristine, copy)
    return copy


def _edit(name: str, change):
    def damage(store: Path) -> None:
        path = store / name
        path.write_bytes(change(path.read_bytes()))
    return damage


def _flip_sha_char(data: bytes) -> bytes:
    at = data.index(b'"sha256": "') + len(b'"sha256": "')
    return data[:at] + (b"0" if data[at:at + 1] != b"0" else b"1") + data[at + 1:]


def _json_edit(name: str, change):
    def edit(data: bytes) -> bytes:
        obj = json.loads(data)
        change(obj)
        return json.dumps(obj, sort_keys=True).encode()
    return _edit(name, edit)


def _remove(name: str):
    return lambda store: (store / name).unlink()


SNAPSHOT_DAMAGE = [  # (id, damage, the file named, what is said)
    ("newest-snapshot-sha-char-flipped", _edit(SNAP2, _flip_sha_char), SNAP2,
     "differs from manifest.json, which is a copy of it (the shards of 2024-01-02)"),
    ("newest-snapshot-brace-flipped", _edit(SNAP2, lambda d: b"[" + d[1:]), SNAP2, "not valid JSON"),
    ("newest-snapshot-truncated", _edit(SNAP2, lambda d: d[:len(d) // 2]), SNAP2, "not valid JSON"),
    ("newest-snapshot-other-generation", _edit(SNAP2, lambda d: d.replace(b'"generation": 2', b'"generation": 3')),
     SNAP2, "holds generation 3, expected 2"),
    ("newest-snapshot-removed", _remove(SNAP2), SNAP2, "missing, though manifest.json names generation 2"),
]
OLDER_SNAPSHOT_DAMAGE = [
    ("older-snapshot-truncated", _edit(SNAP1, lambda d: d[:100]), SNAP1, "not valid JSON"),
    ("older-snapshot-other-generation", _edit(SNAP1, lambda d: d.replace(b'"generation": 1', b'"generation": 7')),
     SNAP1, "holds generation 7, expected 1"),
]
IDX = "2024-01-03.idx"
SIDECAR = "2024-01-03.json"
SHARD_DAMAGE = [
    ("idx-key-changed", _edit(IDX, lambda d: d.replace(b"\n1\t", b"\n9\t", 1)), IDX,
     "changed since publication (2024-01-03): line 2 is '9\\t"),
    ("idx-tabs-to-cr", _edit(IDX, lambda d: d.replace(b"\t", b"\r")), IDX, "line 1 is '0\\r0', expected '0\\t0'"),
    ("idx-tabs-to-vt", _edit(IDX, lambda d: d.replace(b"\t", b"\v")), IDX, "line 1 is '0\\x0b0', expected '0\\t0'"),
    ("idx-line-added", _edit(IDX, lambda d: d + b"\n"), IDX, "line 8 is '', expected the end of the file"),
    ("idx-zero-padded", _edit(IDX, lambda d: d.replace(b"\n1\t", b"\n01\t", 1)), IDX, "line 2 is '01\\t"),
    ("idx-removed", _remove(IDX), IDX, "cannot read the index of 2024-01-03"),
    ("sidecar-checksum-crc30", _json_edit(SIDECAR, lambda o: o.update(checksum="crc30")), SIDECAR,
     "malformed sidecar (sidecar 2024-01-03: checksum 'crc30'"),
    ("sidecar-checksum-removed", _json_edit(SIDECAR, lambda o: o.pop("checksum")), SIDECAR,
     "changed since publication (checksum '', the manifest says 'crc32')"),
    ("sidecar-windows-removed", _json_edit(SIDECAR, lambda o: o.pop("windows")), SIDECAR,
     "windows 0, the manifest says 7"),
    ("sidecar-sha256-removed", _json_edit(SIDECAR, lambda o: o.pop("sha256")), SIDECAR, "malformed sidecar"),
    ("sidecar-records-a-string", _json_edit(SIDECAR, lambda o: o.update(records="7")), SIDECAR,
     "records '7' is not Integral"),
    ("sidecar-fingerprint-changed", _json_edit(SIDECAR, lambda o: o.update(fingerprint="0" * 16)), SIDECAR,
     "fingerprint '0000000000000000', the manifest's schema has"),
    ("sidecar-idx-bytes-changed", _json_edit(SIDECAR, lambda o: o.update(idx_bytes=o["idx_bytes"] + 1)), SIDECAR,
     "idx_bytes"),
    ("sidecar-removed", _remove(SIDECAR), SIDECAR, "missing (every shard is published with its sidecar"),
]


def _verify(project: Path):
    return shardgen_cli("verify", "-c", project / "shardgen.toml")


def test_a_sound_store_verifies_and_its_status_is_0(project):
    r = _verify(project)
    assert r.returncode == 0 and "verified 3 shards of generation 2: 0 bad" in r.stdout, r.stderr
    r = shardgen_cli("status", "-c", project / "shardgen.toml", "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["snapshot_problem"] is None, r.stderr


@pytest.mark.parametrize("damage, named, said",
                         [row[1:] for row in SNAPSHOT_DAMAGE + OLDER_SNAPSHOT_DAMAGE + SHARD_DAMAGE],
                         ids=[row[0] for row in SNAPSHOT_DAMAGE + OLDER_SNAPSHOT_DAMAGE + SHARD_DAMAGE])
def test_verify_names_each_damaged_published_file(project, damage, named, said):
    """One damage, one line naming the file and what is wrong, exit 1 ("some checks failed")."""
    damage(project / "shards")
    r = _verify(project)
    assert r.returncode == 1, (r.stdout, r.stderr)
    assert "Traceback" not in r.stderr
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("shardgen: error: ")]
    assert len(errors) == 1, r.stderr
    assert str(project / "shards" / named) in errors[0] and said in errors[0], errors[0]
    assert "1 bad" in r.stdout


@pytest.mark.parametrize("damage, named, said", [row[1:] for row in SNAPSHOT_DAMAGE],
                         ids=[row[0] for row in SNAPSHOT_DAMAGE])
def test_status_is_1_when_the_newest_snapshot_is_damaged(project, damage, named, said):
    """A reader pinned to the manifest's generation (or a for_kvstore job) opens its snapshot:
    status does not say all is well when it is damaged."""
    damage(project / "shards")
    cfg = project / "shardgen.toml"
    r = shardgen_cli("status", "-c", cfg)
    assert r.returncode == 1 and "Traceback" not in r.stderr, (r.stdout, r.stderr)
    assert f"shardgen: error: {project / 'shards' / named}" in r.stderr and said in r.stderr, r.stderr
    assert "generation 2, 3 shards" in r.stdout  # the summary is still printed
    r = shardgen_cli("status", "-c", cfg, "--json")
    assert r.returncode == 1 and said in json.loads(r.stdout)["snapshot_problem"]


@pytest.mark.parametrize("damage", [row[1] for row in OLDER_SNAPSHOT_DAMAGE],
                         ids=[row[0] for row in OLDER_SNAPSHOT_DAMAGE])
def test_status_checks_the_newest_snapshot_only(project, damage):
    """An older kept snapshot is verify's (status reads two files, as a cron monitor's probe)."""
    damage(project / "shards")
    r = shardgen_cli("status", "-c", project / "shardgen.toml")
    assert r.returncode == 0, r.stderr


def test_a_snapshot_never_published_is_not_checked(project):
    """A writer killed between the snapshot and manifest.json leaves generation 3's snapshot: never
    published, skipped over by the next publish; not a damaged file."""
    (project / "shards" / "generations" / "3.json").write_text("{half written")
    assert _verify(project).returncode == 0


def test_a_manifest_whose_entry_changed_is_named_with_its_snapshot(project):
    """manifest.json damaged (a sha256 character): the shard's check says the manifest's sha256 is
    wrong, and the newest snapshot no longer matches it."""
    _edit("manifest.json", _flip_sha_char)(project / "shards")
    r = _verify(project)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert "2024-01-02: " in r.stderr and "sha256 differs from the manifest" in r.stderr
    assert f"{project / 'shards' / SNAP2}: differs from manifest.json" in r.stderr


def test_a_manifest_entry_with_an_unknown_checksum_is_refused(project):
    """An unknown ``checksum`` would read as "no record checksums" (checked by frame only): the
    manifest is refused, naming the shard, by verify as by every reader."""
    _json_edit("manifest.json", lambda o: o["shards"][1].update(checksum="crc30"))(project / "shards")
    r = _verify(project)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert (f"{project / 'shards' / 'manifest.json'}: refused: shard 2024-01-03: checksum 'crc30', expected "
            "'crc32' or none") in r.stderr, r.stderr


def test_status_says_in_words_when_there_is_no_raw_file_or_no_date(project):
    """Item 12b: no 'None' in the summary."""
    cfg = project / "shardgen.toml"
    r = shardgen_cli("status", "-c", cfg)
    assert r.returncode == 0, r.stderr
    assert "no raw file" in r.stdout and "None" not in r.stdout, r.stdout
    store = project / "shards"
    empty = Manifest(schema=Manifest.load(store / "manifest.json").schema, window=0, generation=3,
                     updated="2026-01-01T00:00:00Z")
    (store / "generations" / "3.json").write_bytes(empty.dumps())
    (store / "manifest.json").write_bytes(empty.dumps())
    r = shardgen_cli("status", "-c", cfg)
    assert r.returncode == 0, r.stderr
    assert "generation 3, 0 shards" in r.stdout and "no dates" in r.stdout and "None" not in r.stdout, r.stdout
