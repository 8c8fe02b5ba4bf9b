"""The same seed reads the same batches, release after release: every layout, 1, 2 and 3 parts,
two epochs, shuffled (two seeds) and in order, against digests in tests/format/golden_batches.json:
the shuffled ones recorded when an epoch's blocks stopped ramping up (2026-12-06, state version 5:
equal blocks, read in store order; the order became a value earlier that day), the in-order ones
unchanged since the restructuring of 2026-12-05. A change that moves a single sample, pad or
label fails here; one that changes the order on purpose records new digests and says so."""

import hashlib
import json
from pathlib import Path

import pytest
from test_layouts import LAYOUTS, make

from loader import ShardIter

GOLDEN = json.loads((Path(__file__).parent / "golden_batches.json").read_text())


def digest(store, cache, parts, part, seed, shuffle):
    h = hashlib.sha256()
    with ShardIter(store, 8, num_parts=parts, part_index=part, seed=seed, shuffle=shuffle, cache_dir=cache) as it:
        for _ in range(2):
            for b in it:
                for a in b.data + b.label:
                    h.update(a.asnumpy().tobytes())
                h.update(str(b.pad).encode())
            it.reset()
    return h.hexdigest()[:16]


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_the_same_seed_reads_the_same_batches_as_before(tmp_path, name):
    make(tmp_path / name, LAYOUTS[name])
    got, want = {}, {}
    for parts in (1, 2, 3):
        for part in range(parts):
            for seed, shuffle in ((0, True), (7, True), (0, False)):
                key = f"{name}/{parts}/{part}/{seed}/{shuffle}"
                got[key] = digest(tmp_path / name, tmp_path / "c", parts, part, seed, shuffle)
                want[key] = GOLDEN[key]
    assert got == want
