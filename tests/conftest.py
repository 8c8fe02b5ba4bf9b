"""Shared helpers: a small config wired to the fake generator, and a CLI runner."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
FAKE_GEN = Path(__file__).resolve().parent / "fake_gen.py"
# tests/ holds the helpers (fake generator, S3 server, process trees); tests/<part>/ the tests of
# each part of the code (format, produce, store, watch, loader), some of which share helpers.
_HERE = Path(__file__).resolve().parent
for _folder in (_HERE, *sorted(p for p in _HERE.glob("[a-z]*") if p.is_dir())):
    sys.path.insert(0, str(_folder))

T, C = 5, 4  # small schema used throughout: 5 steps x 4 inputs, labels a(1) b(2)



def _hypothesis_profiles() -> None:
    """Property tests (hypothesis) run a bounded, derandomized number of examples in ``make test``
    (profile ``ci``); ``SHARDGEN_HYPOTHESIS=deep make test`` runs many more, with random seeds."""
    from hypothesis import HealthCheck, settings

    quiet = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.function_scoped_fixture]
    settings.register_profile("ci", max_examples=20, deadline=None, derandomize=True, database=None,
                              suppress_health_check=quiet, print_blob=True)
    settings.register_profile("deep", max_examples=400, deadline=None, database=None, suppress_health_check=quiet,
                              print_blob=True)
    settings.load_profile(os.environ.get("SHARDGEN_HYPOTHESIS", "ci"))


_hypothesis_profiles()


def pytest_collection_modifyitems(config, items) -> None:
    """``SHARDGEN_TEST_SHUFFLE=<seed> make test`` runs the tests in a random order: a test that passes
    only after (or fails only after) another one is found this way."""
    seed = os.environ.get("SHARDGEN_TEST_SHUFFLE")
    if seed:
        random.Random(seed).shuffle(items)
        print(f"tests shuffled with seed {seed}")


def write_config(folder: Path, *, modes: dict | None = None, start="2024-01-02", end="2024-01-05",
                 window=0, jobs=1, timeout=20, retries=0, backoff=0.0, extra="", rows=30,
                 process="shardgen.process:sliding_windows", stride=1, grace=3600, end_line=True) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "modes.json").write_text(json.dumps(modes or {}))
    end_text = f'end = "{end}"' if end_line and end else ""
    stride_line = f"stride = {stride}" if stride is not None else ""
    text = f"""
[generator]
command = ["{sys.executable}", "{FAKE_GEN}", "--date", "{{date}}", "--out", "{{output}}",
           "--modes", "{{config_dir}}/modes.json", "--cols", "7", "--rows", "{rows}"]
output = "raw/{{date}}.npy"
timeout_s = {timeout}
retries = {retries}
backoff_s = {backoff}

[dates]
start = "{start}"
{end_text}
calendar = "weekdays"

[schema]
time_steps = {T}
num_inputs = {C}
data_name = "seq_var"
labels = [{{name = "a", width = 1}}, {{name = "b", width = 2}}]

[process]
function = "{process}"
{stride_line}

[store]
dir = "shards"
window = {window}
grace_s = {grace}

[run]
jobs = {jobs}
backend = "loky"
{extra}
"""
    path = folder / "shardgen.toml"
    path.write_text(text)
    return path


def runs(folder: Path) -> list[str]:
    p = folder / "modes.json.runs"
    return p.read_text().split() if p.exists() else []


def shardgen_cli(*args, timeout=120, **kw) -> subprocess.CompletedProcess:
    """Run the real CLI in a subprocess."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "shardgen.cli", *map(str, args)], capture_output=True,
                          text=True, timeout=timeout, env=env, **kw)


def expected_windows(date: str, rows=30, cols=7, stride=1):
    """Windows computed independently of shardgen, with a plain loop."""
    from fake_gen import raw_for

    raw = raw_for(date, rows, cols)
    xs, payloads = [], []
    for i in range(0, rows - T + 1, stride):
        x = raw[i:i + T, :C]
        last = raw[i + T - 1]
        xs.append(x)
        payloads.append(np.concatenate([x.ravel(), last[C:C + 1], last[C + 1:C + 3]]).astype(np.float32))
    return np.array(payloads)


@pytest.fixture
def cfg_dir(tmp_path):
    return tmp_path / "proj"


def make_store(store: Path, counts: dict, *, window: int = 0, t: int = 3, c: int = 2, base_id: int = 0,
               pack: int = 1):
    """A store written directly (no generator): window k of the store has label ``a == k + base_id``
    and ``x`` filled with k, so a test can identify every window it reads. ``pack`` > 1: the
    windows layout with that many windows per record."""
    import datetime as dt

    from shardgen.format import LabelSpec, Layout, Schema
    from shardgen.produce.writer import write_store

    schema = Schema.create(time_steps=t, num_inputs=c, data_name="seq_var",
                           labels=[LabelSpec("a", 1), LabelSpec("b", 2)],
                           layout=Layout("windows", pack) if pack > 1 else Layout())

    def shards():
        next_id = base_id
        for date, n in sorted(counts.items()):
            ids = np.arange(next_id, next_id + n, dtype=np.float32)
            next_id += n
            x = np.repeat(ids, t * c).reshape(n, t, c) + np.arange(t * c, dtype=np.float32).reshape(t, c) / 100
            labels = {"a": ids, "b": np.stack([ids * 2, -ids], axis=1).astype(np.float32)}
            yield dt.date.fromisoformat(date), x, labels

    write_store(store, schema, shards(), window=window, fsync=False)
    return schema


def batch_ids(batch) -> list:
    """Ids of the real (not padding) rows of a batch."""
    a = batch.label[0].asnumpy()
    return a[: len(a) - batch.pad].astype(int).tolist()


def part_sizes(n: int, parts: int) -> list:
    """The loader contract: part p of P holds samples [p*n//P, (p+1)*n//P)."""
    return [(p + 1) * n // parts - p * n // parts for p in range(parts)]


def expected_pads(n: int, parts: int, batch_size: int, part: int) -> list:
    """The exact ``pad`` of every batch of ``part`` (last_batch='pad'): every part yields
    ceil(largest / batch_size) batches; a part that runs out a batch early (the README's one
    exception) repeats one row of its last real batch, counted as real: pad = batch_size - 1."""
    sizes = part_sizes(n, parts)
    batches = -(-max(sizes) // batch_size)
    out = []
    for i in range(batches):
        valid = min(batch_size, sizes[part] - i * batch_size)
        out.append(batch_size - valid if valid > 0 else batch_size - 1)
    return out


def real_batches(batches: list, n: int, parts: int, part: int) -> list:
    """The batches that carry new samples (a repeated batch of the exception is left out, after
    checking that it repeats the previous batch's first row)."""
    bs = batches[0].data[0].shape[0] if batches else 0
    keep = -(-part_sizes(n, parts)[part] // bs) if bs else 0
    for b in batches[keep:]:
        assert b.pad == bs - 1
        np.testing.assert_array_equal(b.data[0].asnumpy()[:1], batches[keep - 1].data[0].asnumpy()[:1])
    return batches[:keep]


def consume_in_thread(it):
    """A daemon thread calling ``it.next()`` until something ends it; (thread, [what ended it])."""
    import threading

    outcome: list = []

    def consume():
        try:
            while True:
                it.next()
        except BaseException as exc:  # noqa: BLE001 - the test records what ended the loop
            outcome.append(exc)

    t = threading.Thread(target=consume, daemon=True)
    t.start()
    return t, outcome


STORE_KINDS_TESTED = ("test_s3_loader", "test_s3_limits")  # the loader's store tests: on every object store kind
# On S3 alone: what only S3 has (credentials, an endpoint URL, HTTP on the way down).
S3_MESSAGES = {
    "test_an_object_tampered_on_the_way_down_is_refused_and_never_enters_the_cache",
    "test_endpoint_down_at_construction_names_the_url", "test_wrong_credentials_say_so",
    "test_an_endpoint_url_without_a_scheme_is_one_clear_error",
}


def pytest_generate_tests(metafunc):
    """The loader's store tests run on S3 and on a second kind of object store (``fake_objects``),
    unchanged, unless marked ``s3_only`` (what only S3 has: credentials, endpoints, HTTP)."""
    if "s3" in metafunc.fixturenames and metafunc.module.__name__ in STORE_KINDS_TESTED:
        s3_only = metafunc.definition.get_closest_marker("s3_only") or metafunc.function.__name__ in S3_MESSAGES
        kinds = ["s3"] if s3_only else ["s3", "fake"]
        metafunc.parametrize("s3", kinds, indirect=True)


@pytest.fixture
def s3(request, tmp_path, monkeypatch):
    """A real S3-compatible server (rclone serve s3) on loopback, with this process's AWS environment
    pointing at it; bucket ``data``. Stopped at the end of the test. Parametrized ``fake``: a
    ``fake://`` store (``fake_objects.FakeServer``), the second kind the loader's store tests run on."""
    import gc

    from fake_objects import FakeServer
    from s3server import S3Server

    from loader.pipeline.pipeline import join_closing
    from shardgen.store import objstore

    def settle():  # dropped iterators close in threads of their own (leases in the bucket): let them end first
        gc.collect()
        join_closing(30)

    settle()
    kind = getattr(request, "param", "s3")
    server = (S3Server if kind == "s3" else FakeServer)(tmp_path / "s3root").start()
    for key, value in server.env().items():
        monkeypatch.setenv(key, value)
    objstore.forget_clients()
    try:
        yield server
    finally:
        settle()
        server.stop()
        objstore.forget_clients()


def stop_prefetching(pit) -> None:
    """Stop an ``mx.io.PrefetchingIter``'s threads. They hold the iterator (their target's argument),
    so it is never collected and ``del`` stops nothing: its ``__del__`` is MXNet's only way to stop
    them. Call it before closing the iterators it wraps."""
    pit.__del__()
