"""Old import path of publish and verify (``benchmarks/`` imports ``shardgen.store.publish``).

Publishing is in ``shardgen.publish``, verification in ``shardgen.verify``, the summary
``shardgen status`` prints in ``shardgen.status``; import from those.
"""

from __future__ import annotations

from .publish import check_sidecar, next_version, open_manifest, publish
from .verify import verify_shard, verify_store

__all__ = ["open_manifest", "publish", "verify_shard", "verify_store", "check_sidecar", "next_version"]
