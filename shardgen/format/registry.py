"""The layouts a store can use, by name. A new layout is a codec module and one line here."""

from __future__ import annotations

from shardgen.format.codec import Codec
from shardgen.format.runs import Runs
from shardgen.format.samples import Samples
from shardgen.format.windows import Windows

__all__ = ["CODECS", "KINDS", "codec_for"]

CODECS: dict[str, Codec] = {c.kind: c for c in (Samples(), Windows(), Runs())}
KINDS = tuple(CODECS)


def codec_for(kind: str) -> Codec:
    try:
        return CODECS[kind]
    except KeyError:
        raise ValueError(f"layout must be one of {', '.join(KINDS)}, got {kind!r}") from None
