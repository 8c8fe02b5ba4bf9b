"""Waiting out a store outage mid-epoch (``wait_out``): a fetch that cannot reach the store is
tried again every ``OUTAGE_RETRY_S``, for up to ``SHARDGEN_OUTAGE_WAIT_S`` seconds (default 10
minutes; ``outage_wait_s``), while the reader goes on."""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Callable, Optional

from shardgen.errors import ConfigError
from shardgen.store.objurl import StoreUnreachable

__all__ = ["outage_wait_s", "wait_out", "OUTAGE_WAIT_S", "OUTAGE_RETRY_S"]

log = logging.getLogger(__name__)
OUTAGE_WAIT_S = 600.0  # default budget for waiting out a store outage mid-epoch (SHARDGEN_OUTAGE_WAIT_S)
OUTAGE_RETRY_S = 5.0  # between two tries while waiting


def outage_wait_s() -> float:
    """Seconds a mid-epoch fetch waits for a store that cannot be reached: ``SHARDGEN_OUTAGE_WAIT_S``
    (0: fail at once, after the store's own retries), else 10 minutes."""
    text = os.environ.get("SHARDGEN_OUTAGE_WAIT_S", "")
    try:
        value = float(text) if text.strip() else OUTAGE_WAIT_S
    except ValueError:
        value = -1.0
    if not 0 <= value <= 7 * 86400:  # nan, inf and negatives too
        raise ConfigError(f"SHARDGEN_OUTAGE_WAIT_S must be a number of seconds in [0, 604800] (a week), got "
                          f"{text!r}")
    return value


def wait_out(fetch: Callable[[], None], halt: Optional[threading.Event], url: str) -> None:
    """``fetch()``, tried again while the store ``url`` cannot be reached, until the budget is spent
    or ``halt`` is set (then the last StoreUnreachable is raised); no ``halt``: never tried again."""
    waited_since = None
    while True:
        try:
            fetch()
            break
        except StoreUnreachable as exc:
            # At reset() (no ``halt``) the loader reads the generation it holds again instead.
            budget, now = outage_wait_s(), time.monotonic()
            if halt is None or budget == 0:
                raise
            if waited_since is None:
                waited_since = now
                log.warning("%s; waiting up to %.0f s for the store (SHARDGEN_OUTAGE_WAIT_S) before the epoch "
                            "fails; it goes on where it was", exc, budget)
            elif now - waited_since >= budget:
                raise StoreUnreachable(f"{exc}; still after waiting {now - waited_since:.0f} s "
                                       f"(SHARDGEN_OUTAGE_WAIT_S={budget:g})") from None
            if halt.wait(min(OUTAGE_RETRY_S, budget - (now - waited_since))):
                raise
    if waited_since is not None:
        log.warning("%s: reachable again after %.0f s", url, time.monotonic() - waited_since)
