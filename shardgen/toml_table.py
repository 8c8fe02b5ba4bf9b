"""Reading ``shardgen.toml``: the file, and tables whose every key is checked (unknown keys refused)."""

from __future__ import annotations

import difflib
import sys
from pathlib import Path
from typing import Any

from shardgen.errors import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

__all__ = ["Table", "number", "integer", "read_toml"]

_MISSING = object()


def read_toml(path: Path) -> dict:
    """The parsed file; ConfigError if it is missing, unreadable or not TOML."""
    try:
        return tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path}: config file not found") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: cannot read ({exc})") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML ({exc})") from None


class Table:
    """Reads one TOML table, remembering which keys were used so leftovers can be refused."""

    def __init__(self, data: dict, name: str, *, top: bool = False):
        if not isinstance(data, dict):
            raise ConfigError(f"[{name}] must be a table")
        self.data, self.name, self.used, self.top = data, name, set(), top

    def get(self, key: str, kind: Any, default: Any = _MISSING) -> Any:
        self.used.add(key)
        if key not in self.data:
            if default is _MISSING:
                raise ConfigError(f"{self.name}.{key} is missing")
            return default
        value = self.data[key]
        kinds = kind if isinstance(kind, tuple) else (kind,)
        if isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds):
            names = " or ".join(k.__name__ for k in kinds)
            raise ConfigError(f"{self.name}.{key} must be {names}, got {value!r}")
        return value

    def rest(self) -> dict:
        return {k: v for k, v in self.data.items() if k not in self.used}

    def done(self) -> None:
        """ConfigError naming the first key no ``get`` asked for, and the known ones."""
        extra = sorted(set(self.data) - self.used)
        if not extra:
            return
        key, known = extra[0], sorted(self.used)
        close = difflib.get_close_matches(key, known, n=1)
        if self.top:
            tables = ", ".join(f"[{k}]" for k in known)
            if isinstance(self.data[key], dict):
                hint = f" (did you mean [{close[0]}]?)" if close else ""
                raise ConfigError(f"unknown table [{key}]{hint}; the tables are {tables}")
            raise ConfigError(f"unknown key {key!r} at the top level, outside any table; the tables are {tables}")
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ConfigError(f"unknown key {self.name}.{key}{hint}; the known keys are {', '.join(known)}")


def number(table: Table, key: str, default: float, minimum: float) -> float:
    value = float(table.get(key, (int, float), default))
    if value < minimum:
        raise ConfigError(f"{table.name}.{key} must be >= {minimum}, got {value}")
    return value


def integer(table: Table, key: str, default: int, minimum: int) -> int:
    value = table.get(key, int, default)
    if value < minimum:
        raise ConfigError(f"{table.name}.{key} must be >= {minimum}, got {value}")
    return value
