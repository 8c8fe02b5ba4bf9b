"""The `shardgen` CLI as a user runs it: exit codes, one-line errors, config validation."""

import json
import re

import pytest
from conftest import ROOT, runs, shardgen_cli, write_config


def test_build_status_verify(cfg_dir):
    cfg = write_config(cfg_dir, jobs=2, modes={"2024-01-04": "fail"})
    r = shardgen_cli("build", "-c", cfg)
    assert r.returncode == 1
    assert "published 3 dates, skipped 0, empty 0, failed 1" in r.stdout
    errors = [ln for ln in r.stderr.splitlines() if "error" in ln]
    assert len(errors) == 1 and "2024-01-04: generator exited with code 3" in errors[0]
    assert "Traceback" not in r.stderr
    r = shardgen_cli("status", "-c", cfg, "--json")
    info = json.loads(r.stdout)
    # the date the build failed is listed, and status exits 1 while it fails (issue 62)
    assert r.returncode == 1 and [f["date"] for f in info["failing"]] == ["2024-01-04"]
    assert info["shards"] == 3 and info["windows"] == 3 * 26
    assert info["first_date"] == "2024-01-02" and info["last_date"] == "2024-01-05"
    r = shardgen_cli("status", "-c", cfg)
    # A slow machine publishes more than once in a build (every publish_every_s): the generation
    # is the one --json reported.
    assert info["generation"] >= 1 and f"generation {info['generation']}, 3 shards, 78 windows" in r.stdout
    r = shardgen_cli("verify", "-c", cfg)
    assert r.returncode == 0 and "verified 3 shards" in r.stdout


def test_verify_names_every_bad_shard(cfg_dir):
    cfg = write_config(cfg_dir)
    assert shardgen_cli("build", "-c", cfg).returncode == 0
    store = cfg_dir / "shards"
    data = bytearray((store / "2024-01-03.rec").read_bytes())
    data[100] ^= 0xFF
    (store / "2024-01-03.rec").write_bytes(bytes(data))
    with open(store / "2024-01-05.rec", "r+b") as fh:
        fh.truncate(50)
    r = shardgen_cli("verify", "-c", cfg)
    assert r.returncode == 1
    assert "2024-01-03:" in r.stderr and "is damaged (payload checksum differs" in r.stderr  # the record named
    assert "2024-01-05:" in r.stderr and "50 bytes, the manifest says" in r.stderr
    assert "2 bad" in r.stdout


@pytest.mark.parametrize("args", [
    ["--start", "2024-01-02; rm -rf x"],
    ["--end", "$(touch pwned)"],
    ["--start", "2024-13-01"],
    ["--start", "20240102"],
])
def test_date_injection_is_usage_error(cfg_dir, args):
    cfg = write_config(cfg_dir)
    r = shardgen_cli("build", "-c", cfg, *args, cwd=cfg_dir)
    assert r.returncode == 2 and "YYYY-MM-DD" in r.stderr
    assert runs(cfg_dir) == [] and not (cfg_dir / "pwned").exists()


@pytest.mark.parametrize("args, message", [
    (["--start", "2024-03-15", "--end", "2024-03-04"], "--end 2024-03-04 is before --start 2024-03-15"),
    (["--start", "2024-03-15"], "dates.end 2024-01-05 is before --start 2024-03-15"),
    (["--end", "2023-12-29"], "--end 2023-12-29 is before dates.start 2024-01-02"),
])
def test_a_reversed_range_is_exit_2_and_creates_nothing(cfg_dir, args, message):
    cfg = write_config(cfg_dir)
    before = sorted(p.name for p in cfg_dir.iterdir())
    r = shardgen_cli("build", "-c", cfg, *args, cwd=cfg_dir)
    assert r.returncode == 2 and r.stderr == f"shardgen: error: {message}\n" and r.stdout == ""
    assert sorted(p.name for p in cfg_dir.iterdir()) == before  # no shards/, no raw/


@pytest.mark.parametrize("command", ["status", "build"])
def test_a_reader_gone_from_stdout_is_a_quiet_exit_141(cfg_dir, command):
    """``shardgen status | head -0``: the pipe's reader closed before anything was written."""
    import os
    import subprocess
    import sys

    cfg = write_config(cfg_dir)
    assert shardgen_cli("build", "-c", cfg).returncode == 0
    for buffered in ("1", ""):  # PYTHONUNBUFFERED set (each print writes) or not (the flush at exit does)
        read_end, write_end = os.pipe()
        os.close(read_end)
        env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": buffered}
        r = subprocess.run([sys.executable, "-m", "shardgen.cli", command, "-c", str(cfg)], stdout=write_end,
                           stderr=subprocess.PIPE, text=True, env=env, timeout=120)
        os.close(write_end)
        assert (r.returncode, r.stderr) == (141, ""), buffered


BAD_CONFIGS = [
    ("[generator]\ncommand = []\n", "generator.command must be a non-empty list"),
    ("[generator]\noutput = 'x'\n", "generator.command is missing"),
    ("", "generator is missing"),
    ("this is not toml = = =", "not valid TOML"),
]


@pytest.mark.parametrize("text, match", BAD_CONFIGS)
def test_broken_config_files(tmp_path, text, match):
    path = tmp_path / "shardgen.toml"
    path.write_text(text)
    r = shardgen_cli("build", "-c", path)
    assert r.returncode == 2 and re.search(match, r.stderr), r.stderr


def _edit(text, old, new):
    assert old in text, old
    return text.replace(old, new)


@pytest.mark.parametrize("old, new, match", [
    ("timeout_s = 20", "timeout_s = 'soon'", "generator.timeout_s must be int or float"),
    ("retries = 0", "retries = -1", "generator.retries must be >= 0"),
    ("retries = 0", "retries = 0\ncolour = 'red'", "unknown key generator.colour"),
    ('output = "raw/{date}.npy"', 'output = "raw/{day}.npy"', "generator.output.*unknown placeholder"),
    ('start = "2024-01-02"', 'start = "2024-01-02; rm -rf /"', "dates.start.*YYYY-MM-DD"),
    ('calendar = "weekdays"', 'calendar = "lunar"', "dates.calendar must be"),
    ("time_steps = 5", "time_steps = 'five'", "schema.time_steps must be int"),
    ("num_inputs = 4", "", "schema.num_inputs is missing"),
    ('{name = "a", width = 1}', '{name = "a", width = 0}', r"schema.labels\[0\].*width must be"),
    ('{name = "a", width = 1}', '{name = "date", width = 1}', "added by shardgen"),
    ('function = "shardgen.process:sliding_windows"', 'function = "nope.nothing:fn"',
     "process.function 'nope.nothing:fn' cannot be imported"),
    ('function = "shardgen.process:sliding_windows"', 'function = "no_colon"', "module:function"),
    ('dir = "shards"', "dir = 3", "store.dir must be str"),
    ("jobs = 1", "jobs = 0", "run.jobs must be >= 1"),
    ("[run]", "[runn]", r"unknown table \[runn\] \(did you mean \[run\]\?\); the tables are \[dates\], "
                        r"\[generator\], \[process\], \[run\], \[schema\], \[store\]"),
    ("[generator]", "window = 3\n[generator]", "unknown key 'window' at the top level, outside any table"),
    ("retries = 0", "retries = 0\nretires = 1", r"unknown key generator.retires \(did you mean 'retries'\?\); "
                                                r"the known keys are .*command"),
])
def test_bad_config_is_exit_2_naming_the_key(cfg_dir, old, new, match):
    cfg = write_config(cfg_dir)
    cfg.write_text(_edit(cfg.read_text(), old, new))
    r = shardgen_cli("build", "-c", cfg)
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr
    assert re.search(match, r.stderr), r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_missing_config_and_manifest(tmp_path):
    r = shardgen_cli("status", "-c", tmp_path / "nope.toml")
    assert r.returncode == 2 and "config file not found" in r.stderr
    cfg = write_config(tmp_path / "p")
    r = shardgen_cli("status", "-c", cfg)
    assert r.returncode == 1 and "no manifest" in r.stderr


def test_schema_change_on_existing_store_is_refused(cfg_dir):
    cfg = write_config(cfg_dir)
    assert shardgen_cli("build", "-c", cfg, "--end", "2024-01-02").returncode == 0
    cfg.write_text(cfg.read_text().replace("time_steps = 5", "time_steps = 6"))
    r = shardgen_cli("build", "-c", cfg)
    assert r.returncode == 2 and "use a new store.dir" in r.stderr


def test_help_describes_commands():
    r = shardgen_cli("--help")
    assert r.returncode == 0 and "build" in r.stdout and "Exit codes" in r.stdout
    said = " ".join(r.stdout.split())
    for code in ("0 success", "1 some dates or shards failed", "2 usage or config error", "3 the environment failed"):
        assert code in said, (code, said)  # docs/config.md's table (issue 54: 3 was missing)
    r = shardgen_cli("build", "--help")
    assert "--force" in r.stdout and "--jobs" in r.stdout


def test_demo_config_is_valid():
    from shardgen.config import load_config

    cfg = load_config(ROOT / "shardgen.toml")
    assert cfg.schema.layout.kind == "runs" and cfg.schema.pack == 512 and cfg.schema.layout.run_rows == 60 + 511
    assert cfg.schema.record_floats == 4 + 512 * (1 + 1 + 4) + 571 * 32 == 21348
    assert cfg.argv(cfg.dates.start)[:3] == [str(ROOT / "build/seqgen"), "--date", "2024-01-02"]


def test_a_progress_bar_on_a_terminal_and_none_in_a_pipe(cfg_dir):
    """On a terminal (a pty as stderr) build shows tqdm's bar; piped, none (and tqdm is never imported)."""
    import fcntl
    import os
    import pty
    import struct
    import subprocess
    import sys
    import termios

    cfg = write_config(cfg_dir)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))  # a sized terminal: tqdm draws
    try:
        proc = subprocess.Popen([sys.executable, "-m", "shardgen.cli", "build", "-c", str(cfg)], stdout=subprocess.PIPE,
                                stderr=slave, env=env)
        os.close(slave)
        chunks = []
        while True:  # read while it runs: a full pty buffer would block the build
            try:
                data = os.read(master, 65536)
            except OSError:  # EIO: the child side is closed
                break
            if not data:
                break
            chunks.append(data)
        proc.communicate(timeout=120)
    finally:
        os.close(master)
    shown = b"".join(chunks).decode(errors="replace")
    assert proc.returncode == 0, shown
    assert re.search(r"build: 100%.*4/4", shown), shown
    piped = shardgen_cli("build", "-c", cfg, "--force")
    assert piped.returncode == 0 and "build:" not in piped.stderr and "%|" not in piped.stderr
    probe = ("import sys, runpy; sys.argv = ['shardgen', 'build', '-c', sys.argv[1], '--force']\n"
             "try:\n    runpy.run_module('shardgen.cli', run_name='__main__')\nexcept SystemExit:\n    pass\n"
             "print('tqdm' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", probe, str(cfg)], capture_output=True, text=True, env=env, timeout=120)
    assert r.stdout.strip().splitlines()[-1] == "False", r.stdout + r.stderr


@pytest.mark.slow
def test_a_local_dask_cluster_is_quiet_without_v(cfg_dir):
    """Dask sets its own loggers to INFO (45 lines of them on stderr, a jupyter-server-proxy hint
    among them): shown with -v only. Also with Dask's default dashboard port taken (a notebook's
    dashboard, another build): the local cluster binds no fixed port."""
    import contextlib
    import socket

    cfg = write_config(cfg_dir)
    cfg.write_text(cfg.read_text().replace('backend = "loky"', 'backend = "dask"\nscheduler = "local"'))
    taken = socket.socket()
    with contextlib.suppress(OSError):  # (already held by someone else: as good)
        taken.bind(("0.0.0.0", 8787))
        taken.listen()
    with taken:
        r = shardgen_cli("build", "-c", cfg)
    assert r.returncode == 0 and "published 4 dates" in r.stdout
    assert r.stderr == ""
    r = shardgen_cli("build", "-c", cfg, "--force", "-v")
    assert r.returncode == 0 and "shardgen: info: dask: local with 1 workers" in r.stderr
    assert "Scheduler at:" in r.stderr  # Dask's own INFO lines, asked for


@pytest.mark.parametrize("keep_raw", [False, True])
def test_gc_from_cron_removes_the_raw_files_the_watcher_would(cfg_dir, keep_raw):
    """``shardgen build`` + ``shardgen gc`` from cron, no watcher (issue 44): with store.window = 3,
    gc removes the raw files of the dates that left the window (their shards deleted), as the
    watcher does; store.keep_raw = true keeps them; a date the manifest lists keeps its file."""
    cfg = write_config(cfg_dir, start="2024-01-02", end="2024-01-15", window=3, grace=0)
    if keep_raw:
        cfg.write_text(cfg.read_text().replace("grace_s = 0", "grace_s = 0\nkeep_raw = true"))
    raw, said = cfg_dir / "raw", ""
    for end in ("2024-01-05", "2024-01-10", "2024-01-15"):  # three cron cycles, the calendar moving on
        text = re.sub(r'end = "[^"]*"', f'end = "{end}"', cfg.read_text())
        cfg.write_text(text)
        assert shardgen_cli("build", "-c", cfg).returncode == 0
        r = shardgen_cli("gc", "-c", cfg)
        assert r.returncode == 0, r.stderr
        said += r.stdout
    listed = {s["date"] for s in json.loads((cfg_dir / "shards" / "manifest.json").read_text())["shards"]}
    left = {p.stem for p in raw.glob("*.npy")}
    assert len(listed) == 3
    if keep_raw:
        assert len(left) > 3 and listed <= left
    else:
        assert left == listed, "gc removed the raw files of every date that left the window, and only those"
        assert "raw files of dates that left the window" in said


def test_exit_codes_follow_the_table(s3, tmp_path, monkeypatch):
    """docs/config.md's table, for every command (issue 44): 3 when the environment fails (the store
    cannot be reached, its bucket does not exist, or it refuses the credentials), 2 for a config
    error, 1 for failed dates."""
    cfg = write_config(tmp_path / "p")
    cfg.write_text(cfg.read_text().replace('dir = "shards"', 'dir = "s3://data/store"'))
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    assert shardgen_cli("build", "-c", cfg).returncode == 0
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong")
    for command in ("build", "status", "gc", "verify"):
        r = shardgen_cli(command, "-c", cfg, "--force" if command == "build" else "-v")
        assert r.returncode == 3, (command, r.stderr[-800:])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3.env()["AWS_SECRET_ACCESS_KEY"])
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:1")  # nothing listens there
    for command in ("build", "status", "gc", "verify"):
        r = shardgen_cli(command, "-c", cfg)
        assert r.returncode == 3, (command, r.stderr[-800:])
        assert "cannot reach" in r.stderr
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3.env()["AWS_ENDPOINT_URL"])
    cfg.write_text(cfg.read_text().replace("s3://data/store", "s3://nosuchbucket/store"))
    for command in ("build", "status", "gc", "verify"):  # issue 54: a missing bucket was 1 for build and status
        r = shardgen_cli(command, "-c", cfg)
        assert r.returncode == 3, (command, r.stdout, r.stderr[-800:])
        assert "bucket 'nosuchbucket' does not exist" in r.stderr and "Traceback" not in r.stderr, (command, r.stderr)
    cfg.write_text(cfg.read_text().replace("jobs = 1", 'jobs = "2"'))
    assert shardgen_cli("status", "-c", cfg).returncode == 2


def test_a_build_whose_dates_fail_for_the_environment_exits_3(cfg_dir, monkeypatch, capsys):
    """The store goes away once the build has its lock: every date fails for the environment,
    not for its data: exit 3, not 1 (jobs=1 runs the dates in this process)."""
    from shardgen.cli import main
    from shardgen.store.folder import FolderStore
    from shardgen.store.objurl import StoreUnreachable

    def unreachable(self, sidecar, name):
        raise StoreUnreachable(f"{self.where(name)}: PUT failed 4 times; cannot reach http://127.0.0.1:1 (refused)")

    cfg = write_config(cfg_dir)
    monkeypatch.setattr(FolderStore, "put_shard", unreachable)
    assert main(["build", "-c", str(cfg)]) == 3
    assert "cannot reach" in capsys.readouterr().err
