"""UTC time stamps as every file of a store writes them: ``YYYY-MM-DDTHH:MM:SSZ``.

The manifest's ``updated`` and ``retired_at``, the watcher state's ``updated`` and ``next_retry``
all use this one format (whole seconds, always UTC).
"""

from __future__ import annotations

import datetime as dt

__all__ = ["STAMP", "utc_datetime", "utc_now", "utc_stamp", "parse_utc", "seconds_since"]

STAMP = "%Y-%m-%dT%H:%M:%SZ"


def utc_datetime() -> dt.datetime:
    """Now, as an aware UTC datetime."""
    return dt.datetime.now(dt.timezone.utc)


def utc_now() -> str:
    """Now, as a stamp."""
    return utc_datetime().strftime(STAMP)


def utc_stamp(ts: float) -> str:
    """A Unix time as a stamp (its fraction of a second dropped)."""
    return dt.datetime.fromtimestamp(int(ts), dt.timezone.utc).strftime(STAMP)


def parse_utc(stamp: str) -> dt.datetime:
    """A stamp back as an aware datetime; ValueError if it is not one."""
    return dt.datetime.strptime(stamp, STAMP).replace(tzinfo=dt.timezone.utc)


def seconds_since(stamp: str, now: dt.datetime) -> float:
    """How long before ``now`` (an aware datetime) the stamp was written."""
    return (now - parse_utc(stamp)).total_seconds()
