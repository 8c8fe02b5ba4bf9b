"""Store locks: never opened through a planted symlink."""

import pytest
from conftest import make_store, shardgen_cli, write_config

from shardgen.errors import LockError
from shardgen.store.lock import MANIFEST_LOCK, WATCH_LOCK, StoreLock


@pytest.mark.parametrize("name", [MANIFEST_LOCK, WATCH_LOCK])
def test_a_symlinked_lock_file_is_refused_and_its_target_kept(tmp_path, name):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    (tmp_path / name).symlink_to(victim)
    with pytest.raises(LockError, match=f"{name}: .* lock file is a symlink"):
        StoreLock(tmp_path / name).acquire()
    assert victim.read_text() == "precious\n"


def test_cli_with_a_planted_manifest_lock_symlink_says_so_in_one_line(tmp_path):
    cfg = write_config(tmp_path / "proj", end="2024-01-02")
    store = tmp_path / "proj" / "shards"
    make_store(store, {"2024-01-02": 10})
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    (store / MANIFEST_LOCK).unlink()
    (store / MANIFEST_LOCK).symlink_to(victim)
    r = shardgen_cli("gc", "-c", cfg)
    assert r.returncode == 2
    assert r.stderr.count("\n") == 1 and "lock file is a symlink" in r.stderr and "Traceback" not in r.stderr
    assert victim.read_text() == "precious\n"
