"""A fake generator for tests: behaves per date as a JSON modes file says.

    fake_gen.py --date D --out P --modes MODES.json [--cols N] [--rows N]

Modes: ok, fail (exit 3), hang (sleeps, with a child process), garbage, truncated, empty, noout,
nan, 3d, int, few (fewer rows than any window), flaky:K (fails the first K runs), truncated:K (writes a
truncated file, exit 0, the first K runs), slow:S (sleeps S seconds first). Every run appends its date
to ``<modes>.runs`` so tests can count runs.
"""

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np


def raw_for(date: str, rows: int, cols: int) -> np.ndarray:
    seed = int(date.replace("-", ""))
    return np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--date", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--modes", required=True)
    p.add_argument("--cols", type=int, default=7)
    p.add_argument("--rows", type=int, default=30)
    a = p.parse_args()
    modes_path = Path(a.modes)
    modes = json.loads(modes_path.read_text()) if modes_path.exists() else {}
    with open(str(modes_path) + ".runs", "a") as fh:
        fh.write(a.date + "\n")
    runs = Path(str(modes_path) + ".runs").read_text().split().count(a.date)
    mode = modes.get(a.date, modes.get("*", "ok"))
    out = Path(a.out)
    if mode.startswith("slow:"):
        time.sleep(float(mode.split(":")[1]))
        mode = "ok"
    if mode.startswith("flaky:"):
        if runs <= int(mode.split(":")[1]):
            print(f"flaky failure {runs}", file=sys.stderr)
            return 4
        mode = "ok"
    if mode.startswith("truncated:"):
        mode = "truncated" if runs <= int(mode.split(":")[1]) else "ok"
    if mode == "fail":
        print("line one\nfake generator exploded for " + a.date, file=sys.stderr)
        return 3
    if mode == "hang":
        # argv names the modes file (unique to a test's folder): tests find this child by it
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)", a.modes])
        with open(str(modes_path) + ".children", "a") as fh:
            fh.write(f"{child.pid}\n")
        print("hanging", file=sys.stderr, flush=True)
        time.sleep(600)
        return 0
    if mode == "noout":
        return 0
    if mode == "garbage":
        out.write_bytes(os.urandom(500))
        return 0
    if mode == "empty":
        out.write_bytes(b"")
        return 0
    arr = raw_for(a.date, a.rows, a.cols)
    if mode == "few":
        arr = arr[:2]
    if mode == "nan":
        arr[a.rows - 3, 1] = np.nan
    if mode == "3d":
        arr = arr.reshape(a.rows, a.cols, 1)
    if mode == "int":
        arr = arr.astype(np.int32)
    tmp = out.with_suffix(f".part-{os.getpid()}.npy")  # two builds may generate one date at once
    np.save(tmp, arr)
    if mode == "truncated":
        data = tmp.read_bytes()
        tmp.write_bytes(data[: len(data) // 2])
    os.replace(tmp, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
