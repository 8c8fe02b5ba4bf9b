"""seqgen.py: the Python stand-in for the reference generator ``seqgen.cpp``, for a machine with no
C++ compiler (``shardgen demo DIR`` picks it then). Same arguments, same exit codes, and the same
numbers: a line-by-line port (splitmix64, Box-Muller, the same recurrences in double precision, one
cast to float32), so a date gives the array ``seqgen.cpp`` gives, only slower (pure Python).

    python seqgen.py --date YYYY-MM-DD --out PATH [--rows N] [--cols N] [--targets K] [--seed N] [--work-ms MS]
"""

import datetime as dt
import math
import os
import sys
import time

import numpy as np

MASK = (1 << 64) - 1


def splitmix(state):
    """(new state, output) of splitmix64."""
    state = (state + 0x9E3779B97F4A7C15) & MASK
    z = state
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
    return state, z ^ (z >> 31)


class Rng:
    def __init__(self, state):
        self.state, self.spare = state, None

    def uniform(self):
        self.state, z = splitmix(self.state)
        return ((z >> 11) + 0.5) * (1.0 / 9007199254740992.0)

    def normal(self):
        if self.spare is not None:
            spare, self.spare = self.spare, None
            return spare
        u, v = self.uniform(), self.uniform()
        r = math.sqrt(-2.0 * math.log(u))
        self.spare = r * math.sin(2 * math.pi * v)
        return r * math.cos(2 * math.pi * v)


def usage(msg):
    sys.stderr.write(f"seqgen: {msg}\nusage: seqgen --date YYYY-MM-DD --out PATH [--rows N] [--cols N] "
                     "[--targets K] [--seed N] [--work-ms MS]\n")
    sys.exit(2)


def parse_int(flag, text, lo, hi):
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or not lo <= value <= hi:
        usage(f"{flag} expects an integer in [{lo}, {hi}], got '{text}'")
    return value


def generate(y, m, d, rows, cols, targets, seed):
    s = (seed * 1000003 + y * 10000 + m * 100 + d) & MASK
    s, first = splitmix(s)
    rng = Rng(first)
    if rows < 0:
        s, z = splitmix(s)
        rows = 1600 + z % 800  # varies by date
    features = cols - targets
    assets = max(1, (features + 3) // 4)
    base = [1, 5, 10, 20, 60]
    horizons = [base[k] if k < 5 else 60 + 20 * (k - 4) for k in range(targets)]
    steps = rows + horizons[-1]
    beta = [0.5 + rng.uniform() for _ in range(assets)]
    vol, logp = [0.01] * assets, [0.0] * assets
    ret, price, volume, ewv = ([0.0] * (steps * assets) for _ in range(4))
    regime = 0.008 + 0.006 * rng.uniform()  # a calmer or busier day
    for t in range(steps):
        mkt = rng.normal()
        for a in range(assets):
            r = regime * (beta[a] * mkt + rng.normal()) / math.sqrt(1 + beta[a] * beta[a])
            logp[a] += r
            vol[a] = math.sqrt(0.94 * vol[a] * vol[a] + 0.06 * r * r)
            i = t * assets + a
            ret[i] = r * 100
            price[i] = logp[a] * 100
            volume[i] = 8 + 40 * abs(r) + 0.3 * rng.normal()
            ewv[i] = vol[a] * 100
    kinds = (ret, price, volume, ewv)
    data = np.empty((rows, cols), np.float64)
    for t in range(rows):
        row = data[t]
        for f in range(features):
            row[f] = kinds[(f // assets) % 4][t * assets + f % assets]
        for k in range(targets):
            row[features + k] = price[(t + horizons[k]) * assets] - price[t * assets]
    return data.astype(np.float32)  # each double rounded once, as the C++ static_cast<float>


def main(argv):
    opts = {"--date": "", "--out": "", "--rows": -1, "--cols": 37, "--targets": 5, "--seed": 0, "--work-ms": 0}
    limits = {"--rows": (1, 10000000), "--cols": (2, 100000), "--targets": (1, 1000), "--seed": (0, 1 << 40),
              "--work-ms": (0, 3600 * 1000)}
    i = 0
    while i < len(argv):
        a = argv[i]
        if a in ("-h", "--help"):
            usage("reference generator for shardgen")
        if i + 1 >= len(argv):
            usage(f"missing value for {a}")
        if a not in opts:
            usage(f"unknown argument {a}")
        opts[a] = parse_int(a, argv[i + 1], *limits[a]) if a in limits else argv[i + 1]
        i += 2
    date, out = opts["--date"], opts["--out"]
    try:
        day = dt.date(int(date[0:4]), int(date[5:7]), int(date[8:10]))
        valid = len(date) == 10 and date[4] == date[7] == "-" and date.replace("-", "").isdigit()
    except ValueError:
        valid = False
    if not valid:
        usage(f"--date expects a valid YYYY-MM-DD, got '{date}'")
    if not out:
        usage("--out is required")
    if opts["--targets"] >= opts["--cols"]:
        usage("--targets must be smaller than --cols")
    data = generate(day.year, day.month, day.day, opts["--rows"], opts["--cols"], opts["--targets"], opts["--seed"])
    until = time.monotonic() + opts["--work-ms"] / 1000  # a generator that costs real CPU time per date
    while time.monotonic() < until:
        sum(math.sqrt(k) for k in range(10000))
    tmp = f"{out}.tmp.{os.getpid()}"
    try:
        with open(tmp, "wb") as fh:
            np.save(fh, data)
        os.replace(tmp, out)
    except OSError as exc:
        if os.path.exists(tmp):
            os.remove(tmp)
        sys.stderr.write(f"seqgen: {date}: cannot write {out} ({exc.strerror})\n")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
