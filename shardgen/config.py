"""``shardgen.toml``: parsed into frozen dataclasses, every key checked, unknown keys refused.

Relative paths are relative to the config file's folder. See README "Config reference".
"""

from __future__ import annotations

import datetime as dt
import glob
import importlib
import re
import sys
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

from .errors import ConfigError
from .layout import KINDS, LabelSpec, Layout, Schema

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

__all__ = ["GeneratorConfig", "DatesConfig", "ProcessConfig", "StoreConfig", "RunConfig", "Config",
           "load_config", "parse_date", "date_range", "PLACEHOLDERS"]

PLACEHOLDERS = ("date", "yyyymmdd", "output", "config_dir")
_MISSING = object()


def parse_date(value: object, what: str) -> dt.date:
    """A strict YYYY-MM-DD date; anything else (or shell tricks) is a ConfigError."""
    if isinstance(value, dt.date) and not isinstance(value, dt.datetime):
        return value
    text = str(value)
    try:
        if len(text) != 10:
            raise ValueError
        return dt.date.fromisoformat(text)
    except ValueError:
        raise ConfigError(f"{what}: {text!r} is not a date of the form YYYY-MM-DD") from None


def date_range(start: dt.date, end: dt.date, calendar: str) -> list[dt.date]:
    """Every date from start to end inclusive on the calendar ("weekdays" or "daily")."""
    days = [start + dt.timedelta(days=i) for i in range((end - start).days + 1)]
    return [d for d in days if calendar == "daily" or d.weekday() < 5]


class _Table:
    """Reads one TOML table, remembering which keys were used so leftovers can be refused."""

    def __init__(self, data: dict, name: str):
        if not isinstance(data, dict):
            raise ConfigError(f"[{name}] must be a table")
        self.data, self.name, self.used = data, name, set()

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
        extra = sorted(set(self.data) - self.used)
        if extra:
            raise ConfigError(f"unknown key {self.name}.{extra[0]}")


@dataclass(frozen=True)
class GeneratorConfig:
    command: tuple[str, ...]
    output: str
    timeout_s: float = 300.0
    retries: int = 2
    backoff_s: float = 1.0
    settle_s: float = 2.0  # watch: a dropped raw file is read once its mtime is this old


@dataclass(frozen=True)
class DatesConfig:
    start: dt.date
    end: Optional[dt.date] = None
    calendar: str = "weekdays"


@dataclass(frozen=True)
class ProcessConfig:
    """``[process]``: the processor plug-in. ``config_dir`` (the config file's folder) is searched
    first for the module, in every process that calls ``load()`` (loky and Dask workers too)."""

    function: str = "shardgen.process:sliding_windows"
    options: tuple[tuple[str, Any], ...] = ()
    config_dir: Optional[Path] = None

    def plugin_file(self) -> Optional[Path]:
        """The module's file (or package ``__init__.py``) in the config's folder, if it is there."""
        if self.config_dir is None:
            return None
        top = self.function.partition(":")[0].split(".")[0]
        for candidate in (self.config_dir / f"{top}.py", self.config_dir / top / "__init__.py"):
            if candidate.is_file():
                return candidate
        return None

    def load(self) -> Callable:
        """Import the processor; ConfigError if it cannot be found or its module fails to import."""
        module_name, _, attr = self.function.partition(":")
        local = self.plugin_file()
        try:
            module = _import_plugin(self.function, local) if local else importlib.import_module(module_name)
            fn = getattr(module, attr)
        except SyntaxError as exc:  # the plug-in's own file: say where, not "No module named"
            raise ConfigError(f"process.function {self.function!r}: syntax error in {exc.filename}:{exc.lineno}: "
                              f"{exc.msg}") from None
        except (ImportError, AttributeError, ValueError) as exc:
            missing = getattr(exc, "name", None)
            if isinstance(exc, ImportError) and missing and not (module_name + ".").startswith(missing + "."):
                raise ConfigError(f"process.function {self.function!r}: importing it failed at "
                                  f"{_where(exc, local)}: {exc}") from None  # the plug-in imports something missing
            raise ConfigError(f"process.function {self.function!r} cannot be imported ({exc})") from None
        except ConfigError:
            raise
        except Exception as exc:  # raised by the plug-in's module code at import time
            raise ConfigError(f"process.function {self.function!r}: importing it raised {type(exc).__name__} at "
                              f"{_where(exc, local)}: {exc}") from None
        if not callable(fn):
            raise ConfigError(f"process.function {self.function!r} is not callable")
        return fn


_PLUGINS: dict[str, Path] = {}  # top-level module name -> file, of plug-ins imported from a config folder


def _import_plugin(function: str, file: Path) -> Any:
    """Import the module of ``function`` from the folder holding ``file``, which goes first on
    ``sys.path`` while importing only (a plug-in's sibling modules must be imported at its top).

    The folder wins over an installed module of the same name; another config's plug-in of that
    name is replaced. A name the process has already imported from elsewhere (``json``, ``numpy``)
    is refused: swapping it would break code that uses the real one."""
    module_name = function.partition(":")[0]
    top = module_name.split(".")[0]
    folder = file.parent if file.name != "__init__.py" else file.parent.parent
    loaded = sys.modules.get(top)
    loaded_file = getattr(loaded, "__file__", None)
    if loaded is not None and (loaded_file is None or Path(loaded_file).resolve() != file.resolve()):
        if top not in _PLUGINS:
            raise ConfigError(f"process.function {function!r}: {file} has the name of the module {top!r} "
                              f"this process already uses ({loaded_file or 'built in'}); "
                              "rename the plug-in file")
        for name in [n for n in sys.modules if n == top or n.startswith(top + ".")]:
            del sys.modules[name]
    sys.path.insert(0, str(folder))
    try:
        importlib.invalidate_caches()
        module = importlib.import_module(module_name)
    finally:
        sys.path.remove(str(folder))
    _PLUGINS[top] = file
    return module


def _where(exc: BaseException, file: Optional[Path]) -> str:
    """``file:line`` of the plug-in frame an import-time exception came through (else its origin)."""
    frames = list(traceback.extract_tb(exc.__traceback__))
    ours = [f for f in frames if file is not None and f.filename == str(file)]
    real = [f for f in frames if not f.filename.startswith("<")]
    frame = (ours or real or [None])[-1]
    return f"{frame.filename}:{frame.lineno}" if frame is not None else str(file or "?")


@dataclass(frozen=True)
class StoreConfig:
    dir: Path
    window: int = 0
    grace_s: float = 3600.0
    lease_ttl_s: float = 60.0


@dataclass(frozen=True)
class RunConfig:
    jobs: int = 1
    backend: str = "loky"
    scheduler: Optional[str] = None


@dataclass(frozen=True)
class Config:
    path: Path
    generator: GeneratorConfig
    dates: DatesConfig
    schema: Schema
    process: ProcessConfig
    store: StoreConfig
    run: RunConfig = field(default_factory=RunConfig)

    @property
    def config_dir(self) -> Path:
        return self.path.parent

    def fields(self, date: dt.date) -> dict[str, str]:
        """Values of the placeholders for one date (``output`` included)."""
        base = {"date": date.isoformat(), "yyyymmdd": date.strftime("%Y%m%d"),
                "config_dir": str(self.config_dir)}
        output = self.config_dir / self.generator.output.format(**base)
        return {**base, "output": str(output)}

    def raw_path(self, date: dt.date) -> Path:
        return Path(self.fields(date)["output"])

    def raw_files(self) -> dict[dt.date, Path]:
        """Every file present at the ``output`` location, by date (for files dropped by others)."""
        template = str(self.config_dir / self.generator.output)
        pattern = template.format(date="????-??-??", yyyymmdd="????????", config_dir=str(self.config_dir))
        found = {}
        for path in glob.glob(glob.escape(pattern).replace("[?]", "?")):
            for candidate in re.findall(r"\d{4}-\d{2}-\d{2}|\d{8}", path[len(str(self.config_dir)):]):
                try:
                    text = candidate if "-" in candidate else f"{candidate[:4]}-{candidate[4:6]}-{candidate[6:]}"
                    date = dt.date.fromisoformat(text)
                except ValueError:
                    continue
                if str(self.raw_path(date)) == path:
                    found[date] = Path(path)
                    break
        return found

    def argv(self, date: dt.date) -> list[str]:
        """The generator's argv for one date; the first item resolved against the config dir."""
        values = self.fields(date)
        argv = [arg.format(**values) for arg in self.generator.command]
        if "/" in argv[0] and not Path(argv[0]).is_absolute():
            argv[0] = str(self.config_dir / argv[0])
        return argv

    def dates_between(self, start: Optional[dt.date] = None, end: Optional[dt.date] = None,
                      today: Optional[dt.date] = None) -> list[dt.date]:
        """The configured dates, optionally narrowed; an open end means up to today."""
        start = start or self.dates.start
        end = end or self.dates.end or today or dt.date.today()
        return date_range(start, end, self.dates.calendar)


def _check_template(text: str, key: str) -> None:
    try:
        text.format(**{name: "x" for name in PLACEHOLDERS})
    except (KeyError, IndexError, ValueError) as exc:
        raise ConfigError(
            f"{key}: {text!r} uses an unknown placeholder ({exc}); known: "
            + ", ".join(f"{{{p}}}" for p in PLACEHOLDERS)
        ) from None


def _number(table: _Table, key: str, default: float, minimum: float) -> float:
    value = float(table.get(key, (int, float), default))
    if value < minimum:
        raise ConfigError(f"{table.name}.{key} must be >= {minimum}, got {value}")
    return value


def _integer(table: _Table, key: str, default: int, minimum: int) -> int:
    value = table.get(key, int, default)
    if value < minimum:
        raise ConfigError(f"{table.name}.{key} must be >= {minimum}, got {value}")
    return value


DEFAULT_PACK = {"samples": 1, "windows": 8, "runs": 64}


def _layout(sto: _Table, process: ProcessConfig, time_steps: object) -> Layout:
    """``[store] layout``, ``pack``, ``run_rows``. The default layout is ``runs`` for the default
    processor (each row stored once) and ``windows`` for a plug-in (which may return windows)."""
    default = "runs" if process.function == ProcessConfig.function else "windows"
    kind = sto.get("layout", str, default)
    if kind not in KINDS:
        raise ConfigError(f"store.layout must be one of {', '.join(repr(k) for k in KINDS)}, got {kind!r}")
    pack = _integer(sto, "pack", DEFAULT_PACK[kind], 1)
    stride = dict(process.options).get("stride", 1)
    stride = stride if isinstance(stride, int) and stride >= 1 else 1
    run_rows = 0
    if kind == "runs":
        run_rows = _integer(sto, "run_rows", int(time_steps) + (pack - 1) * stride, 1)
    elif "run_rows" in sto.data:
        raise ConfigError("store.run_rows is only used with store.layout = 'runs'")
    try:
        return Layout(kind, pack, run_rows)
    except ValueError as exc:
        raise ConfigError(f"store: {exc}") from None


def load_config(path: Path) -> Config:
    """Read and validate a config file; every problem is a ConfigError naming the key."""
    path = Path(path).resolve()
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path}: config file not found") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: cannot read ({exc})") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML ({exc})") from None

    top = _Table(data, "config")
    gen = _Table(top.get("generator", dict), "generator")
    command = gen.get("command", list)
    if not command or not all(isinstance(a, str) for a in command):
        raise ConfigError("generator.command must be a non-empty list of strings (an argv, no shell)")
    for arg in command:
        _check_template(arg, "generator.command")
    output = gen.get("output", str)
    _check_template(output, "generator.output")
    generator = GeneratorConfig(tuple(command), output, _number(gen, "timeout_s", 300.0, 0.001),
                                _integer(gen, "retries", 2, 0), _number(gen, "backoff_s", 1.0, 0.0),
                                _number(gen, "settle_s", 2.0, 0.0))
    gen.done()

    dat = _Table(top.get("dates", dict), "dates")
    start = parse_date(dat.get("start", (str, dt.date)), "dates.start")
    end_raw = dat.get("end", (str, dt.date), None)
    end = parse_date(end_raw, "dates.end") if end_raw is not None else None
    calendar = dat.get("calendar", str, "weekdays")
    if calendar not in ("weekdays", "daily"):
        raise ConfigError(f"dates.calendar must be 'weekdays' or 'daily', got {calendar!r}")
    if end is not None and end < start:
        raise ConfigError(f"dates.end {end} is before dates.start {start}")
    dat.done()

    sch = _Table(top.get("schema", dict), "schema")
    labels = []
    for i, lab in enumerate(sch.get("labels", list)):
        lt = _Table(lab, f"schema.labels[{i}]")
        try:
            labels.append(LabelSpec(lt.get("name", str), lt.get("width", int, 1)))
        except ValueError as exc:
            raise ConfigError(f"schema.labels[{i}]: {exc}") from None
        lt.done()
    schema_args = dict(time_steps=sch.get("time_steps", int), num_inputs=sch.get("num_inputs", int),
                       data_name=sch.get("data_name", str, "seq_var"), labels=labels)
    sch.done()

    pro = _Table(top.get("process", dict, {}), "process")
    function = pro.get("function", str, "shardgen.process:sliding_windows")
    if ":" not in function:
        raise ConfigError(f"process.function must be 'module:function', got {function!r}")
    process = ProcessConfig(function, tuple(sorted(pro.rest().items())), path.parent)
    process.load()

    sto = _Table(top.get("store", dict), "store")
    store = StoreConfig((path.parent / sto.get("dir", str)).resolve(), _integer(sto, "window", 0, 0),
                        _number(sto, "grace_s", 3600.0, 0.0), _number(sto, "lease_ttl_s", 60.0, 30.0))
    layout = _layout(sto, process, schema_args["time_steps"])
    sto.done()
    try:
        schema = Schema.create(**schema_args, layout=layout)
    except ValueError as exc:
        raise ConfigError(f"schema: {exc}") from None

    run_t = _Table(top.get("run", dict, {}), "run")
    run = RunConfig(_integer(run_t, "jobs", 1, 1), run_t.get("backend", str, "loky"),
                    run_t.get("scheduler", str, None))
    if run.scheduler is not None and run.backend != "dask":
        raise ConfigError("run.scheduler is only used with run.backend = 'dask'")
    run_t.done()
    top.done()
    return Config(path, generator, DatesConfig(start, end, calendar), schema, process, store, run)
