"""The exit-code table of docs/config.md, one row per failure class it lists (issue 56): every
command ends through ``shardgen.cli.main``, so the table is checked there, for each command, with
the failure raised where the command's work would raise it."""

from __future__ import annotations

import errno

import pytest
from conftest import write_config

from shardgen import cli
from shardgen.errors import ConfigError, GeneratorError, LockError, ManifestError, ShardError
from shardgen.store.objurl import CredentialsRefused, NoSuchStore, ObjectMismatch, StoreUnreachable

TABLE = [
    # (what failed, the exception, the exit code the table gives)
    ("a config error", ConfigError("shardgen.toml: [run] jobs: expected an integer"), 2),
    ("the store has another writer", LockError(".writer.lock: build refused: the store has another writer"), 2),
    ("a damaged manifest", ManifestError("manifest.json: not valid JSON"), 1),
    ("a date's generator", GeneratorError("2024-01-02: generator exited with code 3"), 1),
    ("a damaged shard", ShardError("2024-01-02.rec: record 3 is damaged"), 1),
    ("an object that differs from its manifest", ObjectMismatch("s3://b/p/x.rec: sha256 differs"), 1),
    ("the store cannot be reached", StoreUnreachable("s3://b/p: cannot reach http://127.0.0.1:1"), 3),
    ("the store refuses the credentials", CredentialsRefused("s3://b/p: credentials refused"), 3),
    ("the bucket does not exist", NoSuchStore("s3://nosuchbucket/p: bucket 'nosuchbucket' does not exist"), 3),
    ("the disk is full", OSError(errno.ENOSPC, "No space left on device", "shards/2024-01-02.rec"), 3),
    # the errno decides, not the words (a host that set LC_MESSAGES gets them in its language)
    ("the disk quota is exceeded", OSError(errno.EDQUOT, "Kontingent überschritten", "shards/2024-01-02.rec"), 3),
    ("a shard error saying the disk is full", ShardError("2024-01-02: the disk is full writing x.rec"), 3),
    ("a permission", PermissionError(errno.EACCES, "Permission denied", "shards/manifest.json"), 1),
    ("Ctrl-C", KeyboardInterrupt(), 130),
    ("SIGTERM", cli.Terminated(), 143),
]


@pytest.fixture(autouse=True)
def _logging_as_it_was():
    """``main`` sets up the process's logging as a command does (``watch``: INFO on the root logger):
    put back as it was, for the tests that run after these in this process."""
    import logging

    root = logging.getLogger()
    level, handlers = root.level, root.handlers[:]
    chatty = {name: logging.getLogger(name).level for name in ("botocore", "boto3", "urllib3", "s3transfer")}
    yield
    root.setLevel(level)
    root.handlers[:] = handlers
    for name, was in chatty.items():
        logging.getLogger(name).setLevel(was)


@pytest.mark.parametrize("command", sorted(cli.COMMANDS))
@pytest.mark.parametrize("what, exc, code", TABLE, ids=[row[0] for row in TABLE])
def test_every_failure_class_of_the_table_exits_with_its_code(tmp_path, monkeypatch, capsys, command, what, exc,
                                                             code):
    def fails(args):
        raise exc

    monkeypatch.setitem(cli.COMMANDS, command, fails)
    if command == "watch" and isinstance(exc, KeyboardInterrupt):
        code = 0  # a watcher stopped by a signal, however sent (issue 62)
    where = [str(tmp_path / "demo")] if command == "demo" else ["-c", str(write_config(tmp_path / "p"))]
    assert cli.main([command, *where]) == code, what
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err  # one line
    if isinstance(exc, OSError) and exc.filename:
        assert exc.filename in err  # the path named



def _raised(outer: Exception, inner: BaseException, *, cause: bool) -> Exception:
    """``outer`` as raised while handling ``inner``: ``from inner`` (cause) or ``from None``."""
    try:
        try:
            raise inner
        except BaseException as exc:
            if cause:
                raise outer from exc
            raise outer from None
    except Exception as caught:
        return caught


GERMAN_ENOSPC = OSError(errno.ENOSPC, "Kein Speicherplatz mehr auf dem Gerät", "shards/2024-01-02.rec")
WRAPPED = [
    ("a shard error from a full disk", lambda: _raised(
        ShardError("2024-01-02: cannot write shards/2024-01-02.rec (Kein Speicherplatz mehr auf dem Gerät)"),
        GERMAN_ENOSPC, cause=True)),
    ("a manifest error from a full disk, from None", lambda: _raised(
        ManifestError("shards/manifest.json: cannot write (Kontingent überschritten)"),
        OSError(errno.EDQUOT, "Kontingent überschritten"), cause=False)),
    ("a generator error wrapping a shard error wrapping a full disk", lambda: _raised(
        GeneratorError("2024-01-02: cannot keep the output"),
        _raised(ShardError("2024-01-02: kaputt"), GERMAN_ENOSPC, cause=False), cause=True)),
]


@pytest.mark.parametrize("command", ["build", "verify"])
@pytest.mark.parametrize("what, make", WRAPPED, ids=[row[0] for row in WRAPPED])
def test_a_full_disk_wrapped_in_a_shardgen_error_exits_as_the_environment(tmp_path, monkeypatch, capsys, command,
                                                                          what, make):
    """Issue 64 contract 10: the errno of the OSError a ShardgenError wraps decides (3), in any language;
    a data error wrapping another data error stays 1."""
    exc = make()

    def fails(args):
        raise exc

    monkeypatch.setitem(cli.COMMANDS, command, fails)
    assert cli.main([command, "-c", str(write_config(tmp_path / "p"))]) == 3, what
    assert "Traceback" not in capsys.readouterr().err
    plain = _raised(ShardError("2024-01-02: record 3 is damaged"), ValueError("bad magic"), cause=True)
    monkeypatch.setitem(cli.COMMANDS, command, lambda args: (_ for _ in ()).throw(plain))
    assert cli.main([command, "-c", str(write_config(tmp_path / "p"))]) == 1


PROCESSOR_ON_A_FULL_DISK = '''
import errno

from shardgen.process import sliding_windows


def windows(raw, date, **kw):
    if str(date) == "2024-01-03":  # the processor's own scratch file meets a full disk
        raise OSError(errno.ENOSPC, "Kein Speicherplatz mehr auf dem Gerät", "/scratch/2024-01-03.tmp")
    return sliding_windows(raw, date, **kw)
'''


def test_a_build_whose_processor_meets_a_full_disk_exits_3(tmp_path):
    """Through the real CLI: the processor's ENOSPC reaches main wrapped in a ProcessorError (its
    message in the host's language); the other dates are published and the exit code is 3."""
    from conftest import shardgen_cli

    cfg = write_config(tmp_path / "p", process="fullproc:windows")
    (tmp_path / "p" / "fullproc.py").write_text(PROCESSOR_ON_A_FULL_DISK)
    r = shardgen_cli("build", "-c", cfg)
    assert r.returncode == 3, r.stderr
    assert "2024-01-03" in r.stderr and "Kein Speicherplatz" in r.stderr and "Traceback" not in r.stderr
