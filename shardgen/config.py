"""``shardgen.toml``: parsed into frozen dataclasses, every key checked, unknown keys refused.

Relative paths are relative to the config file's folder. See README "Config reference".
The ``[process]`` plug-in is ``shardgen.plugin.ProcessConfig`` and the TOML tables are read with ``toml_table``:
both sit a floor below the config, which imports nothing from ``produce/``.
"""

from __future__ import annotations

import datetime as dt
import glob
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from shardgen.errors import ConfigError
from shardgen.format.registry import KINDS, codec_for
from shardgen.format.schema import LabelSpec, Layout, Schema
from shardgen.plugin import ProcessConfig
from shardgen.toml_table import Table, integer, number, read_toml

__all__ = ["GeneratorConfig", "DatesConfig", "ProcessConfig", "StoreConfig", "RunConfig", "Config",
           "load_config", "parse_date", "date_range", "PLACEHOLDERS"]

PLACEHOLDERS = ("date", "yyyymmdd", "output", "config_dir")


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
class StoreConfig:
    dir: Path
    window: int = 0
    grace_s: float = 3600.0
    lease_ttl_s: float = 60.0
    remote: Optional[str] = None  # "s3://bucket/prefix": the store; ``dir`` is then the local staging folder
    layout_set: bool = False  # store.layout is in the config (else the default for the processor was taken)
    keep_raw: bool = False  # watch: keep the raw files of dates whose shards gc deleted

    def open(self):
        """The store (``shardgen.store.open_store`` picks its kind from ``where``); shard files are
        written in ``dir`` before they are in the store."""
        from shardgen.store import open_store  # the store is above the config: imported when opened

        return open_store(self.where, staging=self.dir)

    @property
    def where(self) -> str:
        """The store as the user named it: its folder or its URL."""
        return self.remote or str(self.dir)


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


def _layout(sto: Table, process: ProcessConfig, time_steps: object) -> Layout:
    """``[store] layout``, ``pack``, ``run_rows``. The default layout is ``runs`` for the default
    processor and ``windows`` for a plug-in (which may return windows; a build says when one returned
    a ``RunSpec``). A ``runs`` record holds the rows of ``Runs.default_pack`` windows at stride 1 by default."""
    default = "runs" if process.function == ProcessConfig.function else "windows"
    kind = sto.get("layout", str, default)
    if kind not in KINDS:
        raise ConfigError(f"store.layout must be one of {', '.join(repr(k) for k in KINDS)}, got {kind!r}")
    codec = codec_for(kind)
    stride = dict(process.options).get("stride", 1)
    stride = stride if isinstance(stride, int) and stride >= 1 else 1
    pack = integer(sto, "pack", -(-codec.default_pack // stride) if codec.rows else codec.default_pack, 1)
    run_rows = 0
    if codec.rows:  # a run of rows: by default room for ``pack`` windows at the processor's stride
        run_rows = integer(sto, "run_rows", int(time_steps) + (pack - 1) * stride, 1)
    elif "run_rows" in sto.data:
        raise ConfigError(f"store.run_rows is only used with store.layout = 'runs', not {kind!r}")
    try:
        return Layout(kind, pack, run_rows)
    except ValueError as exc:
        raise ConfigError(f"store: {exc}") from None


def _generator(top: Table) -> GeneratorConfig:
    gen = Table(top.get("generator", dict), "generator")
    command = gen.get("command", list)
    if not command or not all(isinstance(a, str) for a in command):
        raise ConfigError("generator.command must be a non-empty list of strings (an argv, no shell)")
    for arg in command:
        _check_template(arg, "generator.command")
    output = gen.get("output", str)
    _check_template(output, "generator.output")
    generator = GeneratorConfig(tuple(command), output, number(gen, "timeout_s", 300.0, 0.001),
                                integer(gen, "retries", 2, 0), number(gen, "backoff_s", 1.0, 0.0),
                                number(gen, "settle_s", 2.0, 0.0))
    gen.done()
    return generator


def _dates(top: Table) -> DatesConfig:
    dat = Table(top.get("dates", dict), "dates")
    start = parse_date(dat.get("start", (str, dt.date)), "dates.start")
    end_raw = dat.get("end", (str, dt.date), None)
    end = parse_date(end_raw, "dates.end") if end_raw is not None else None
    calendar = dat.get("calendar", str, "weekdays")
    if calendar not in ("weekdays", "daily"):
        raise ConfigError(f"dates.calendar must be 'weekdays' or 'daily', got {calendar!r}")
    if end is not None and end < start:
        raise ConfigError(f"dates.end {end} is before dates.start {start}")
    dat.done()
    return DatesConfig(start, end, calendar)


def _schema_args(top: Table) -> dict:
    """``[schema]`` as keyword arguments of ``Schema.create`` (the layout comes from ``[store]``)."""
    sch = Table(top.get("schema", dict), "schema")
    labels = []
    for i, lab in enumerate(sch.get("labels", list)):
        lt = Table(lab, f"schema.labels[{i}]")
        try:
            labels.append(LabelSpec(lt.get("name", str), lt.get("width", int, 1)))
        except ValueError as exc:
            raise ConfigError(f"schema.labels[{i}]: {exc}") from None
        lt.done()
    schema_args = dict(time_steps=sch.get("time_steps", int), num_inputs=sch.get("num_inputs", int),
                       data_name=sch.get("data_name", str, "seq_var"), labels=labels)
    sch.done()
    return schema_args


def _process(top: Table, config_dir: Path) -> ProcessConfig:
    """``[process]``; the plug-in is imported now and its keys checked against its signature, so a
    config naming a broken one, or a key it cannot take, is refused."""
    pro = Table(top.get("process", dict, {}), "process")
    function = pro.get("function", str, "shardgen.process:sliding_windows")
    if ":" not in function:
        raise ConfigError(f"process.function must be 'module:function', got {function!r}")
    process = ProcessConfig(function, tuple(sorted(pro.rest().items())), config_dir)
    process.check_options(process.load())
    return process


def _store_and_schema(top: Table, config_dir: Path, process: ProcessConfig,
                      schema_args: dict) -> tuple[StoreConfig, Schema]:
    sto = Table(top.get("store", dict), "store")
    folder = sto.get("dir", str)
    remote, staging = None, sto.get("staging", str, None)
    if "://" in folder:  # an object store: its kind says whether the URL is one
        from shardgen.store import object_client
        from shardgen.store.objurl import ObjectStoreError, default_staging

        try:
            objects = object_client(folder)
        except (ObjectStoreError, ValueError) as exc:
            raise ConfigError(f"store.dir: {exc}") from None
        if objects is None:
            raise ConfigError(f"store.dir = {folder!r}: a folder, or an object store's URL such as s3://bucket/prefix")
        remote = objects.url
        folder = staging or str(default_staging(objects.bucket, objects.prefix, config_dir))
    elif staging is not None:
        raise ConfigError("store.staging is only used when store.dir is an object store's URL (s3://...)")
    store = StoreConfig((config_dir / folder).resolve(), integer(sto, "window", 0, 0),
                        number(sto, "grace_s", 3600.0, 0.0), number(sto, "lease_ttl_s", 60.0, 30.0), remote,
                        layout_set="layout" in sto.data, keep_raw=sto.get("keep_raw", bool, False))
    layout = _layout(sto, process, schema_args["time_steps"])
    sto.done()
    try:
        return store, Schema.create(**schema_args, layout=layout)
    except ValueError as exc:
        raise ConfigError(f"schema: {exc}") from None


def _run(top: Table) -> RunConfig:
    run_t = Table(top.get("run", dict, {}), "run")
    run = RunConfig(integer(run_t, "jobs", 1, 1), run_t.get("backend", str, "loky"),
                    run_t.get("scheduler", str, None))
    if run.scheduler is not None and run.backend != "dask":
        raise ConfigError("run.scheduler is only used with run.backend = 'dask'")
    run_t.done()
    return run


def load_config(path: Path) -> Config:
    """Read and validate a config file; every problem is a ConfigError naming the key."""
    path = Path(path).resolve()
    top = Table(read_toml(path), "config", top=True)
    try:
        generator = _generator(top)
        dates = _dates(top)
        schema_args = _schema_args(top)
        process = _process(top, path.parent)
        store, schema = _store_and_schema(top, path.parent, process, schema_args)
        run = _run(top)
        top.done()
    except ConfigError as exc:
        if str(path) in str(exc):
            raise
        raise ConfigError(f"{path}: {exc}") from None  # which file, when several configs are about
    return Config(path, generator, dates, schema, process, store, run)
