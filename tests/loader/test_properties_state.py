"""Properties of a saved state (issue 56): for ANY edit of any field of a state (re-signed, so the
field checks are reached, or not), ``load_state_dict`` either continues exactly what the edited
state describes or raises one LoaderError before the epoch in progress is let go: never another
exception, never a hang, never memory without bound.

The iterator lives in a child process whose address space is capped (``RLIMIT_AS``: what it holds
after its first epoch plus 1.5 GB), so an edit that makes the loader allocate without bound fails
one example in seconds instead of exhausting the machine; every answer is waited for at most
``ANSWER_S``. What the child reads is compared with the order computed here from the edited state
alone (``loader.pipeline.order``): the same rows, pads and repeated batch."""

from __future__ import annotations

import json
import math
import os
import re
import select
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import ROOT, make_store
from hypothesis import event, example, given
from hypothesis import strategies as st

from loader.checkpoint import _digest
from loader.pipeline.order import EpochOrder, OrderSpec, Phase, count, remainder, slice_of

COUNTS = {f"2024-06-{d:02d}": 9 + 7 * (d % 3) for d in range(1, 8)}  # 7 dates, 112 windows
TOTAL = sum(COUNTS.values())
OFFSET = dict(zip(sorted(COUNTS), np.cumsum([0] + [COUNTS[d] for d in sorted(COUNTS)]).tolist()))
B, PARTS, PART = 5, 2, 1
KW = dict(seed=3, shuffle_buffer=8)  # blocks of 32 windows: two blocks a part
AT = 4  # batches read before the state is saved
ANSWER_S = 30  # the longest a load (and reading the rest of the epoch) may take in the child
STORE_IDS: list = []  # the id of each window, in store order (read in order by the fixture)
CAP = 1536 << 20  # the child's address space beyond what it holds after its first epoch

WORKER = r"""
import json, resource, sys, traceback
from loader import LoaderError, ShardIter

job = json.loads(sys.stdin.readline())
it = ShardIter(job["store"], job["batch"], num_parts=job["parts"], part_index=job["part"], cache_dir=job["cache"],
               **job["kw"])

def rows(b):
    return [b.label[0].asnumpy().tolist(), b.pad]

want = [rows(b) for b in it]
it.load_state_dict(job["start"])  # epoch 0 from the start again
for _ in range(job["at"]):
    it.next()
saved = it.state_dict()
vm = int(open("/proc/self/status").read().split("VmSize:")[1].split()[0]) * 1024
resource.setrlimit(resource.RLIMIT_AS, (vm + job["cap"], resource.getrlimit(resource.RLIMIT_AS)[1]))
print(json.dumps({"want": want, "saved": saved}), flush=True)
for line in sys.stdin:
    state = json.loads(line)
    try:
        try:
            it.load_state_dict(state)
        except LoaderError as exc:
            answer = {"refused": str(exc), "next": rows(it.next()), "epoch": it.epoch}
        else:
            answer = {"loaded": [rows(b) for b in it], "epoch": it.epoch}
        it.load_state_dict(saved)  # back where it was for the next edit
    except BaseException:  # noqa: BLE001 - any other exception (or MemoryError) is what the test refuses
        answer = {"crash": traceback.format_exc()[-3000:]}
        try:
            it.load_state_dict(saved)
        except BaseException:  # noqa: BLE001 - the iterator is gone: the next question finds the child ended
            print(json.dumps(answer), flush=True)
            break
    print(json.dumps(answer), flush=True)
"""


class Worker:
    """The child process holding the iterator; ``ask(state)`` its answer (bounded in time)."""

    def __init__(self, store, cache, start: dict):
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        self.log = Path(cache).with_suffix(".stderr")  # a file: a full stderr pipe would stop the child
        self.dead = ""  # why the child can answer no more (every later question fails at once)
        with open(self.log, "w") as err:
            self.proc = subprocess.Popen([sys.executable, "-c", WORKER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         stderr=err, text=True, cwd=ROOT, env=env)
        job = dict(store=str(store), cache=str(cache), batch=B, parts=PARTS, part=PART, kw=KW, at=AT, cap=CAP,
                   start=start)
        first = self._send(job)
        self.want, self.saved, self.store = first["want"], first["saved"], store

    def _send(self, obj: dict) -> dict:
        if self.dead or self.proc.poll() is not None:
            pytest.fail(f"the child can answer no more: {self.dead or 'it ended'}: {self.log.read_text()[-3000:]}")
        self.proc.stdin.write(json.dumps(obj) + "\n")
        self.proc.stdin.flush()
        ready, _, _ = select.select([self.proc.stdout], [], [], ANSWER_S)
        if not ready:
            self.proc.kill()
            self.dead = f"no answer in {ANSWER_S} s (a hang, or memory without bound)"
            pytest.fail(self.dead)
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait(10)
            self.dead = f"the child died (exit {self.proc.returncode})"
            pytest.fail(f"{self.dead}: {self.log.read_text()[-3000:]}")
        return json.loads(line)

    def ask(self, state: dict) -> dict:
        answer = self._send(state)
        if "crash" in answer:  # the child is stopped: shrinking would make it exhaust its memory again and again
            self.dead = f"an earlier example crashed it:\n{answer['crash']}"
            self.proc.kill()
            pytest.fail(f"load_state_dict raised something else than a LoaderError:\n{answer['crash']}")
        return answer

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    root = tmp_path_factory.mktemp("props-state")
    make_store(root / "s", COUNTS, pack=4)
    from loader import ShardIter

    with ShardIter(root / "s", B, num_parts=PARTS, part_index=PART, cache_dir=root / "c0", **KW) as it:
        start = it.state_dict()  # epoch 0, nothing read
    with ShardIter(root / "s", TOTAL, shuffle=False, cache_dir=root / "c0") as it:
        STORE_IDS[:] = it.next().label[0].asnumpy().astype(int).tolist()  # the writer mixes a shard's windows
    w = Worker(root / "s", root / "c", start)
    try:
        yield w
    finally:
        w.close()


def expected(state: dict) -> list:
    """The batches ``[labels a, pad]`` of part ``PART`` of ``PARTS`` (batch ``B``, last_batch='pad') that
    the order defines for ``state`` from where it is on: computed from the state's fields alone."""
    from shardgen.store.manifest import ShardEntry

    shards = [ShardEntry.from_json(s) for s in state["shards"]]
    phases = [Phase(*ph) for ph in state["phases"]]
    skip = 0
    if phases and phases[-1][:2] == (PARTS, B):
        phases, skip = phases[:-1], phases[-1].batches
    spec = OrderSpec(state["seed"], state["shuffle"], state["canonical_parts"], state["block"], 4,
                     state.get("stripes") is True)  # the state's
    # own, and the store's pack (its schema's fingerprint is in the state)
    order = EpochOrder([s.samples for s in shards], spec, state["epoch"])
    rest = remainder(order.total, phases)
    sizes = [count(slice_of(rest, PARTS, q)) for q in range(PARTS)]
    ids = []
    for v in order.visits(slice_of(rest, PARTS, PART)):
        block = order.block(v.c, v.b)
        seq = [STORE_IDS[OFFSET[shards[k].date] + s] for k, lo, hi in block.pieces for s in range(lo, hi)]
        ids += [seq[int(block.perm[u])] if block.perm is not None else seq[u] for u in range(v.u0, v.u1)]
    out, last = [], None
    for i in range(math.ceil(max(sizes) / B)):
        valid = min(B, len(ids) - i * B)
        if valid <= 0:  # this part ran out a batch early: its last real batch again
            out.append([last, B - 1])
            continue
        real = ids[i * B:i * B + valid]
        last = [float(real[j % valid]) for j in range(B)]
        out.append([last, B - valid])
    return out[skip:]


def _check(worker: Worker, state: dict, signed: bool) -> dict:
    answer = worker.ask(state)
    event("loaded" if "loaded" in answer else f"refused: {answer['refused'][:40]}")
    if "refused" in answer:
        assert answer["next"] == worker.want[AT], "the epoch in progress went on after the refusal"
        assert answer["epoch"] == 0
        assert signed or re.search("its 'sha256' does not match|state_dict version", answer["refused"])
        return answer
    assert signed or state == worker.saved, "an edit that was not re-signed was loaded"  # (== ignores key order)
    assert answer["epoch"] == state["epoch"]
    from shardgen.store.manifest import ShardEntry

    store = {e.rec: e for e in map(ShardEntry.from_json, worker.saved["shards"])}
    for e in map(ShardEntry.from_json, state["shards"]):  # (and the order below is never built on a wrong count)
        assert store.get(e.rec) == e, f"loaded an entry the store does not have: {e}"
    assert answer["loaded"] == expected(state), "loaded, but not what the state describes"
    return answer


NUMBERS = st.one_of(st.integers(-3, 70), st.sampled_from([2**31 - 1, 2**31, 2**63, -2**63, 65_536, 65_537, 10**12]))
VALUES = st.one_of(NUMBERS, st.none(), st.booleans(), st.sampled_from(["", "5", "x", "2024-06-03", 1.5, -0.5]),
                   st.lists(NUMBERS, max_size=3), st.dictionaries(st.sampled_from(["a", "date"]), NUMBERS, max_size=2))


def _edited(state: dict, path: tuple, value, delete: bool) -> dict:
    out = json.loads(json.dumps(state))
    *where, key = path
    node = out
    for k in where:
        node = node[k]
    if delete:
        node.pop(key, None) if isinstance(node, dict) else node.pop(key)
    else:
        node[key] = value
    return out


def _sign(state: dict) -> dict:
    """``state`` with its sha256 made again (in its own key order: the digest sorts keys)."""
    try:
        digest = _digest(state)
    except (TypeError, ValueError):
        return state
    return {k: digest if k == "sha256" else v for k, v in {**state, "sha256": None}.items()}


FIELDS = sorted(["version", "generation", "fingerprint", "shards", "dates", "epoch", "seed", "shuffle",
                 "canonical_parts", "block", "stripes", "phases", "pinned"])  # what state_dict() writes (checked)
SHARD_FIELDS = sorted(["date", "rec", "idx", "records", "bytes", "sha256", "windows", "distinct", "checksum"])


@given(key=st.sampled_from(FIELDS), inner=st.sampled_from([None, *SHARD_FIELDS, 0, 1, 2]), at=st.integers(0, 6),
       value=VALUES, delete=st.sampled_from([False, False, True]), signed=st.sampled_from([True, True, True, False]),
       order=st.permutations(FIELDS + ["sha256"]))
@example(key="shuffle", inner=None, at=0, value=False, delete=False, signed=True, order=FIELDS + ["sha256"])
@example(key="epoch", inner=None, at=0, value=0, delete=False, signed=True, order=["sha256", *reversed(FIELDS)])
def test_any_edit_of_a_field_of_a_state_continues_exactly_or_is_one_loader_error(worker, key, inner, at, value,
                                                                                  delete, signed, order):
    """Any field (a shard's or a phase's too: ``inner``) set to any JSON value or deleted, the
    state's keys stored in any order (a checkpoint library may sort them: an edit that changes
    nothing must load)."""
    saved = worker.saved
    assert sorted(saved) == sorted(FIELDS + ["sha256"])
    path: tuple = (key,)
    if key == "shards" and isinstance(inner, str):
        path = ("shards", at % len(saved["shards"]), inner)
    elif key == "phases" and isinstance(inner, int):
        path = ("phases", 0, inner)
    state = _edited(saved, path, value, delete)
    state = _sign(state) if signed else state
    answer = _check(worker, {k: state[k] for k in order if k in state}, signed)
    if state == saved:
        assert "loaded" in answer, f"the saved state itself (keys in another order) was refused: {answer}"


PHASE = st.tuples(st.integers(-2, 5), st.integers(-1, 12), st.integers(-2, 30)).map(list)


@example(phases=[[PARTS, 0, 1]], epoch=0, canonical_parts=2, block=32)  # a batch of 0
@example(phases=[[PARTS, B, -1]], epoch=0, canonical_parts=2, block=32)  # batches before the start
@example(phases=[[1, -B, 2]], epoch=0, canonical_parts=2, block=32)
@example(phases=[[-1, B, 2]], epoch=0, canonical_parts=2, block=32)
@given(phases=st.lists(st.one_of(PHASE, st.sampled_from([[PARTS, B, AT], [1, B, 0], [PARTS, B, 12],
                                                           [1, 1, TOTAL], [3, 7, 6]]).map(list)), max_size=3),
       epoch=st.integers(0, 3), canonical_parts=st.sampled_from([1, 2, 3, 7, 65_536]),
       block=st.sampled_from([1, 5, 32, 33, 200]))
def test_any_phases_and_order_settings_of_a_signed_state_continue_exactly_or_are_refused(worker, phases, epoch,
                                                                                        canonical_parts, block):
    """The fields that say where the epoch is (what a resumed job on other parts or batch sizes
    writes), signed: a negative count, a batch of 0, more batches than a slice holds, an empty part,
    or a state that continues, exactly as the order says."""
    state = {**worker.saved, "phases": phases, "epoch": epoch, "canonical_parts": canonical_parts, "block": block}
    _check(worker, _sign({k: v for k, v in state.items() if k != "sha256"}), True)


UNCHECKED = r"""
import json, resource, sys
import loader.checkpoint
from loader import LoaderError, ShardIter

job = json.loads(sys.stdin.read())
loader.checkpoint._check_fields = lambda state: None  # what a check that lets a count through would load
with ShardIter(job["store"], job["batch"], num_parts=job["parts"], part_index=job["part"], cache_dir=job["cache"],
               **job["kw"]) as it:
    state = {**it.state_dict(), "phases": job["phases"]}
    state["sha256"] = loader.checkpoint._digest(state)
    vm = int(open("/proc/self/status").read().split("VmSize:")[1].split()[0]) * 1024
    resource.setrlimit(resource.RLIMIT_AS, (vm + job["cap"], resource.getrlimit(resource.RLIMIT_AS)[1]))
    it.load_state_dict(state)
    try:
        got = len(list(it))
    except LoaderError as exc:
        print(json.dumps({"refused": str(exc)}))
    else:
        print(json.dumps({"read": got}))
"""


def test_a_stream_asked_for_samples_past_its_part_is_one_loader_error_not_memory_without_bound(worker, tmp_path):
    """Below the state's check: a stream whose counts go wrong (here a negative batch count let
    through) asks for samples past its part's last one. It stops with a LoaderError naming the batch;
    it used to loop, growing a list without bound (24 GB, OOM-killed). In a capped child, bounded."""
    job = dict(store=str(worker.store), cache=str(tmp_path / "c"), batch=B, parts=PARTS, part=PART, kw=KW, cap=CAP,
               phases=[[PARTS, B, -3]])
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", UNCHECKED], input=json.dumps(job), capture_output=True, text=True,
                          cwd=ROOT, env=env, timeout=ANSWER_S)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "lost count of its batches" in json.loads(done.stdout)["refused"]
