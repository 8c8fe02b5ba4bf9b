"""Adoption: complete shards of this schema that other producers wrote into the store, checked as
``shardgen verify`` checks a published shard before they join the manifest. A bad one is reported
once per version of its sidecar (its where, mtime and size)."""

from __future__ import annotations

import logging

from shardgen.errors import ShardError
from shardgen.format.schema import Schema
from shardgen.produce.build import wanted
from shardgen.store import Store
from shardgen.store.manifest import Manifest, ShardEntry
from shardgen.store.verify import verify_shard

__all__ = ["adoptable"]

log = logging.getLogger(__name__)


def adoptable(store: Store, manifest: Manifest, schema: Schema, bad: set) -> list[ShardEntry]:
    """The entries of the good shards in ``store`` that ``manifest`` still wants; the version of
    each bad sidecar found joins ``bad`` (those already there are skipped)."""
    candidates = store.dated_sidecars()
    todo = set(wanted(manifest, [date for date, _, _ in candidates]))
    entries = []
    for date, name, version in candidates:
        if date not in todo or version in bad:
            continue
        problem = None
        try:
            sidecar = store.read_sidecar(name)
        except ShardError as exc:
            sidecar, problem = None, str(exc)
        if sidecar is None and problem is None:
            continue  # gone meanwhile
        if sidecar is not None and sidecar.records == 0:
            continue  # an empty-date marker
        if sidecar is not None:
            problem = (store.sidecar_problem(sidecar, schema.fingerprint)
                       or verify_shard(store, sidecar.entry(), schema, source="its sidecar"))
        if problem:
            bad.add(version)
            log.warning("%s: not adopting the shard in the store: %s", date, problem)
            continue
        log.info("adopted %s (%d records, written by another producer)", date, sidecar.records)
        entries.append(sidecar.entry())
    return entries
