"""Retry delays: exponential backoff with a cap, for any number of attempts."""

from __future__ import annotations

__all__ = ["retry_delay", "MAX_DOUBLINGS"]

MAX_DOUBLINGS = 64  # 2**64 times any sane base is past any cap; bounds the arithmetic, not the delay


def retry_delay(attempts: int, *, base: float, cap: float) -> float:
    """Seconds to wait after failure number ``attempts`` (1 = the first): ``base`` doubled for each
    earlier failure, never more than ``cap``. Safe for any count (a date failing for years)."""
    doublings = min(max(attempts - 1, 0), MAX_DOUBLINGS)
    return min(cap, base * 2.0 ** doublings)
