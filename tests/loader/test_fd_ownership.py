"""Who may close a plan's shard descriptors, and when (the quick bench's S3 resume flake, "record 0
of 2024-01-01 is damaged (id is not day 19723)" on a good, freshly verified download).

A descriptor number a file let go of is free for the next open in the process, another date's
file: anything that uses a number it does not hold reads that file. Found: the recheck of a plan's
files (``loader.source.files.recheck``) used the numbers with no hold while a stream's reads let
go of files (a bounded cache closes them) and opened others: another date's file checked against
the entry (that message; its good cached copy then removed) or a closed one (EBADF); two plans
opening one kept file at once (``loader.source.shared_files``): one plan's close closed the
other's descriptor. And a guard: a read copies only from the file opened and checked."""

import os
import threading
import time

import pytest
from conftest import batch_ids, make_store
from test_s3_loader import upload_store

from loader import ShardIter
from loader.source import files as files_mod
from loader.source.opening import open_store
from loader.source.plan import make_plan
from shardgen.store.manifest import Manifest

COUNTS = {f"2024-01-{d:02d}": 40 for d in range(1, 29)}  # one size: only the records tell the dates apart


def _remote(s3, tmp_path):
    local = tmp_path / "local"
    make_store(local, COUNTS)
    manifest = Manifest.load(local / "manifest.json")
    return local, upload_store(s3, local), manifest, 6 * max(s.bytes for s in manifest.shards)


@pytest.mark.parametrize("s3", ["fake"], indirect=True)
@pytest.mark.parametrize("number_taken", [True, False], ids=["number-taken-by-another-file", "number-closed"])
def test_a_file_let_go_during_the_recheck_is_still_the_one_checked(s3, tmp_path, monkeypatch, number_taken):
    """Forced interleaving: when the recheck of a file that changed since it was found good (a
    touch) looks at it, the read holding it ends (``let_go``: closed in a bounded cache) and, with
    ``number_taken``, another open in the process takes its descriptor number (another date's file).
    The recheck still checks the file of the date it names, finds it sound, and keeps its cached copy."""
    local, url, manifest, limit = _remote(s3, tmp_path)
    store = open_store(url, tmp_path / "c", limit)
    plan = make_plan(store, tmp_path / "c", manifest, manifest.shards, verify="crc", who="race")
    files = plan.files
    try:
        files.ensure([0])  # a read of 2024-01-01 holds it
        number = files.fds[0]
        cached = plan.store / manifest.shards[0].rec
        st = os.stat(cached)
        os.utime(cached, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # changed since found good: checked again
        other = []
        real = files_mod.identity

        def read_ends_meanwhile(fd, verify):
            monkeypatch.setattr(files_mod, "identity", real)  # once
            files.let_go([0])  # the read is done with it: a bounded cache closes it
            assert files.fds[0] == -1
            if number_taken:
                taken = os.open(local / manifest.shards[1].rec, os.O_RDONLY)  # another date's file
                if taken != number:
                    os.dup2(taken, number)  # the lowest free number in a process with no other thread
                    os.close(taken)
                other.append(number)
            return real(fd, verify)

        monkeypatch.setattr(files_mod, "identity", read_ends_meanwhile)
        assert files_mod.recheck(plan, manifest.schema, "crc") is True  # it changed, and it is sound
        assert other == ([number] if number_taken else [])
        assert set(files.checked) <= set(files.fds), "an identity recorded for a number the plan no longer holds"
        assert cached.exists()  # its good copy kept (the false "damaged" removed it)
        files.ensure([0])  # opened again: the file checked and read is the one of its date
        assert files.frames[0].samples == COUNTS["2024-01-01"]
        files.let_go([0])
    finally:
        for fd in other:
            os.close(fd)
        files.close()


@pytest.mark.parametrize("s3", ["fake"], indirect=True)
def test_load_state_dict_rechecks_files_while_the_epoch_being_replaced_reads_them(s3, tmp_path, monkeypatch):
    """Through ShardIter: a resume (the bench's S3 resume step: a new iterator under cache_limit,
    ``load_state_dict`` at once) rechecks the files of the epoch its construction started, whose
    feed meanwhile lets go of files and opens others. Each file's fstat in the recheck is made slow
    (20 ms, in the caller's thread) so that the feed runs during it, as under load: before the fix
    the first round failed (6 runs in 6) with the bench's message or EBADF. Every window is read once."""
    _, url, _, limit = _remote(s3, tmp_path)
    real = files_mod.identity

    def slow_in_the_callers_thread(fd, verify):
        if threading.current_thread() is threading.main_thread():
            time.sleep(0.02)
        return real(fd, verify)

    monkeypatch.setattr(files_mod, "identity", slow_in_the_callers_thread)
    total = sum(COUNTS.values())
    for rnd in range(3):
        kw = dict(cache_limit=limit, shuffle=True, seed=rnd)
        with ShardIter(url, 8, cache_dir=tmp_path / f"a{rnd}", **kw) as it:
            seen = [i for _ in range(it.batches_per_epoch * 6 // 10) for i in batch_ids(it.next())]
            state = it.state_dict()
        with ShardIter(url, 8, cache_dir=tmp_path / f"b{rnd}", **kw) as it:
            it.load_state_dict(state)
            seen += [i for b in it for i in batch_ids(b)]
        assert sorted(seen) == list(range(total)), rnd


def test_two_plans_opening_one_kept_file_at_once_each_read_their_own(tmp_path, monkeypatch):
    """Two plans of one process (two iterators on one folder store and cache_dir: train and val
    over the same dates) share a kept file (``loader.source.shared_files``). Forced interleaving:
    plan A looks for a plan holding 2024-01-01 (none), then plan B opens it and shares it, then A
    opens its own. Before the fix A's entry replaced B's, so closing B released A's hold and closed
    A's descriptor under it: its number, taken by another date's file, was what A's next read
    copied onto its tape (another date's records, unchecked), and A's close failed (KeyError).
    Each plan's reads stay its file's, and each plan closes cleanly."""
    from loader.source.plan import Read, reader_source

    make_store(tmp_path / "s", COUNTS)
    manifest = Manifest.load(tmp_path / "s" / "manifest.json")
    store = open_store(tmp_path / "s", tmp_path / "c", None)
    a, b = (make_plan(store, tmp_path / "c", manifest, manifest.shards, verify="crc", who=w) for w in "ab")
    real, taken, armed = files_mod.adopt, [], [True]

    def b_opens_meanwhile(key):
        found = real(key)  # A found no plan holding it
        if armed and armed.pop():
            b.files.ensure([0], use=False)  # B opens it, checks it, shares it
        return found

    try:
        monkeypatch.setattr(files_mod, "adopt", b_opens_meanwhile)
        a.files.ensure([0])  # a read of A holds it
        monkeypatch.setattr(files_mod, "adopt", real)
        number = a.files.fds[0]
        b.files.close()  # B is done (its iterator closed)
        try:
            os.fstat(number)
        except OSError:  # closed under A: another open takes its number
            fd = os.open(tmp_path / "s" / manifest.shards[1].rec, os.O_RDONLY)
            if fd != number:
                os.dup2(fd, number)
                os.close(fd)
            taken.append(number)
        source = reader_source(a, Read(((0, 0, COUNTS["2024-01-01"]),), 0))
        try:
            tape = os.pread(source.tape.fd, manifest.shards[0].bytes + 1, 0)
        finally:
            source.tape.close()
        assert tape == (tmp_path / "s" / manifest.shards[0].rec).read_bytes(), "A's read copied another file"
        assert not taken, "B's close closed A's file"
        a.files.let_go([0])
        a.files.close()
    finally:
        for fd in taken:
            os.close(fd)


@pytest.mark.parametrize("reused", [True, False], ids=["number-reused", "closed"])
def test_a_read_never_copies_from_a_descriptor_that_is_no_longer_its_file(tmp_path, reused):
    """The guard (``PlanFiles.read_fd``): were a shard's descriptor closed by some other path while a
    read holds it, and its number taken by another date's file, the read would copy that file's
    records onto its tape, unchecked. It raises a LoaderError naming the file instead (closed: the
    same, not an OSError)."""
    from loader import LoaderError
    from loader.source.plan import Read, reader_source

    make_store(tmp_path / "s", COUNTS)
    manifest = Manifest.load(tmp_path / "s" / "manifest.json")
    spare = [os.open(os.devnull, os.O_RDONLY)]  # below the plan's numbers: closed, it is the one the tape takes
    plan = make_plan(open_store(tmp_path / "s", tmp_path / "c", None), tmp_path / "c", manifest, manifest.shards,
                     verify="crc", who="guard")
    try:
        plan.files.ensure([0])
        number = plan.files.fds[0]
        other = os.open(tmp_path / "s" / manifest.shards[1].rec if reused else os.devnull, os.O_RDONLY)
        os.dup2(other, number)  # what a stray close and another open leave behind
        os.close(other)
        assert spare[0] < number
        os.close(spare.pop())
        if not reused:
            os.close(number)  # closed, and no open takes it (the tape takes the lower number)
        try:
            with pytest.raises(LoaderError, match=r"2024-01-01\.rec: the shard file of 2024-01-01 was closed under "
                                                  r"a read .* nothing was copied from it"):
                reader_source(plan, Read(((0, 0, COUNTS["2024-01-01"]),), 0))
        finally:
            if not reused:
                filler = os.open(os.devnull, os.O_RDONLY)
                os.dup2(filler, number)  # the plan closes it: a number of its own again
                os.close(filler)
        plan.files.let_go([0])
    finally:
        plan.files.close()
        for fd in spare:
            os.close(fd)
