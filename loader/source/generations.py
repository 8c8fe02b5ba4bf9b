"""Which manifest generation an iterator reads: the newest, one pinned by hand, or the one all
workers of a kvstore agree on.

The rule for ``ShardIter.for_kvstore``: at the first batch (or the first ``reset()``) and at every
``reset()``, each worker proposes the generation it holds (at the first batch: the newest it saw
at construction) or the newest it sees in ``manifest.json``; rank 0's proposal wins. It reaches
every worker through the kvstore itself: ``kv.broadcast`` (``init`` + ``pull``: in ``dist_sync``
rank 0 alone pushes the initial value, then every worker passes a barrier) of a 2-float NDArray
under a fresh reserved key per agreement: an integer (``AGREE_KEY_BASE`` and up), or a string
(``__shardgen_generation_<n>``) when the kvstore already holds string keys (MXNet refuses both
kinds in one kvstore: Gluon's ``Trainer`` uses integers, ``Module`` strings). Nothing goes through
the kvstore at construction, so the model's keys come first whatever the order the script creates
the iterator and the model in. Every worker then opens exactly that generation, from its
immutable snapshot ``generations/<N>.json``: the same shards, the same record count, so equal
batches and every record once. No clock, no side channel. A kvstore with one worker (``local``,
``device``) is not used at all.

Each agreement is a collective call: every worker must construct and reset its iterators in the
same order (which a ``dist_sync`` training loop does anyway).

*The store out of reach at ``reset()``* (an object store down for a while, ``StoreUnreachableError``
after its retries): the iterator goes on with the generation it holds, with one warning, and the
next ``reset()`` asks again. Under a kvstore, such a worker proposes the generation it holds, and
still takes part in the agreement: every worker reads rank 0's choice. When rank 0 saw the store
down too, that is the generation all of them hold; when it is a newer one, a worker that cannot
reach the store reads it from its cache (fetched ahead half way through the epoch: snapshot and
shards), or fails with a LoaderError saying what it could not fetch. A pinned generation whose
snapshot is cached needs no request.
"""

from __future__ import annotations

import itertools
import logging
import weakref
from typing import Any, Optional

import mxnet as mx

from loader.errors import LoaderError, StoreUnreachableError, as_loader_errors, mxnet_reason
from loader.source.selection import load_manifest
from shardgen.errors import ShardgenError
from shardgen.store import Store
from shardgen.store.manifest import Manifest
from shardgen.store.objurl import StoreUnreachable

__all__ = ["AGREE_KEY_BASE", "Choice", "agree", "newest", "generation_of", "held_again"]

log = logging.getLogger(__name__)
AGREE_KEY_BASE = 1 << 30  # integer kvstore keys from here on are the loader's (Gluon uses 0, 1, ...)
_MAX_GENERATION = 1 << 40  # sent as two float32 values of 20 bits each (exact)
_ROUNDS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # kv -> its agreement counter
_STR_KEYS: weakref.WeakSet = weakref.WeakSet()  # kvstores found to use string keys


def _check_generation(generation: object) -> int:
    if not isinstance(generation, int) or isinstance(generation, bool) or not 1 <= generation < _MAX_GENERATION:
        raise LoaderError(f"generation must be an integer >= 1, got {generation!r}")
    return generation


def agree(kv: Any, proposal: int) -> int:
    """Rank 0's ``proposal``, on every worker of ``kv`` (a collective call)."""
    if kv.num_workers <= 1:
        return proposal
    rounds = _ROUNDS.setdefault(kv, itertools.count())
    n = next(rounds)
    value = mx.nd.array([proposal >> 20, proposal & 0xFFFFF]) if kv.rank == 0 else mx.nd.zeros(2)
    out = mx.nd.zeros(2)
    key: Any = AGREE_KEY_BASE + n
    if kv in _STR_KEYS:
        key = f"__shardgen_generation_{n}"
    try:
        kv.broadcast(key, value, out=out)
    except mx.base.MXNetError as exc:
        if "Mixed key types" not in str(exc) or isinstance(key, str):
            raise LoaderError(f"workers could not agree on a generation through the kvstore: "
                              f"{mxnet_reason(exc)}") from None
        _STR_KEYS.add(kv)  # the model's keys are strings (Module): use string keys too
        kv.broadcast(f"__shardgen_generation_{n}", value, out=out)
    hi, lo = (int(v) for v in out.asnumpy())
    return (hi << 20) + lo


class Choice:
    """How an iterator picks each epoch's generation: ``pin`` (always that one), ``kv`` (rank
    0's newest, agreed through the kvstore), or neither (this process's newest)."""

    def __init__(self, *, pin: Optional[int] = None, kv: Any = None):
        self.pin = None if pin is None else _check_generation(pin)
        self.kv = kv

    @staticmethod
    def propose(store: Store, held: Optional[Manifest] = None) -> Manifest:
        """The newest generation this process sees; ``held`` (with a warning) when the store
        cannot be reached."""
        try:
            return newest(store)
        except StoreUnreachableError as exc:
            if held is None:
                raise
            return held_again(exc, held)

    def manifest(self, store: Store, held: Optional[Manifest] = None) -> Manifest:
        """The manifest of the generation to read next (a collective call with a kvstore);
        ``held``: the one read now."""
        if self.pin is not None:
            return generation_of(store, self.pin)
        found = self.propose(store, held)
        if self.kv is None:
            return found
        agreed = agree(self.kv, found.generation)
        return found if agreed == found.generation else generation_of(store, agreed)


def newest(store: Store) -> Manifest:
    """The newest manifest of ``store`` (an object store's: fetched into its cache)."""
    with as_loader_errors():
        return load_manifest(store.newest_manifest_file())


def generation_of(store: Store, generation: int) -> Manifest:
    """Generation ``generation`` exactly; LoaderError naming it when it is gone."""
    try:
        return store.load_generation(generation)
    except StoreUnreachable as exc:
        raise StoreUnreachableError(str(exc)) from None
    except ShardgenError as exc:
        raise LoaderError(f"cannot open generation {generation} of {store.where()}: {exc}") from None


def held_again(exc: BaseException, held: Manifest) -> Manifest:
    """The store could not be reached: ``held``, the generation read now, is read again."""
    log.warning("%s; reading generation %d again (the next reset() asks the store again)", exc, held.generation)
    return held
