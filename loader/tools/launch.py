"""Run an MXNet ``dist_*`` kvstore job on this machine: scheduler, servers and workers as local
processes with the ``DMLC_*`` environment, like MXNet's ``tools/launch.py`` local mode (which the
pip wheel does not ship).

    python -m loader.tools.launch -n 2 -s 1 -- python -m loader.tools.train --kvstore dist_sync ...

Workers run the command; the scheduler and servers run ``python -c "import mxnet"`` (importing
MXNet with ``DMLC_ROLE`` = server/scheduler runs its loop). Every line a process prints is shown
with its role; a worker's lines with its kvstore rank once the worker reported it (MXNet gives
ranks in the order workers reach the scheduler, not in launch order): ``ShardIter.for_kvstore``
reports it, a script of your own calls ``loader.lifecycle.report_rank(kv.rank)``. The launcher
prints the mapping (``launch: worker 1 is rank 0``) and names both in every message about a worker.

The first process to fail stops the job: the others are killed (whole process groups) and the exit
code is non-zero, never a hang. The launcher owns its workers, so it asks for the loader's exit
guard in them (``GUARD_ENV``: their first ``ShardIter`` calls ``loader.install_exit_guard()``), which
makes a failing worker exit at once instead of hanging in MXNet's kvstore teardown. Ctrl-C / SIGTERM do the same. On
Linux every process gets SIGKILL when the launcher dies, even by ``kill -9`` (``PR_SET_PDEATHSIG``).

The job ends when every worker has exited 0 (scheduler and servers get ``grace_s`` to follow, then
are killed). A worker still running ``--straggler-s`` seconds (default 60) after another worker
exited 0 is named, the job is killed and the exit code is 124; so is a job still running after
``--timeout`` seconds (default: none).

On several machines, start the same roles with the same variables yourself (ssh, mpirun,
Kubernetes): ``DMLC_PS_ROOT_URI``/``DMLC_PS_ROOT_PORT`` name the scheduler, ``DMLC_NUM_WORKER``
and ``DMLC_NUM_SERVER`` the job's size, ``DMLC_ROLE`` each process's role, ``DMLC_NODE_HOST`` its
own address. The shard store must be on a filesystem every worker can read.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from loader.lifecycle import GUARD_ENV, RANK_FILE

__all__ = ["main", "dmlc_env", "Job", "STRAGGLER_S", "TIMED_OUT"]

STRAGGLER_S = 60.0  # a worker still running this long after another worker exited 0 stops the job
TIMED_OUT = 124  # exit code when --timeout or --straggler-s fires (like coreutils timeout)
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def dmlc_env(role: str, *, workers: int, servers: int, host: str, port: int) -> dict:
    """The environment MXNet's parameter-server processes need."""
    return {"DMLC_ROLE": role, "DMLC_PS_ROOT_URI": host, "DMLC_PS_ROOT_PORT": str(port),
            "DMLC_NUM_WORKER": str(workers), "DMLC_NUM_SERVER": str(servers), "DMLC_NODE_HOST": host,
            "PS_VERBOSE": os.environ.get("PS_VERBOSE", "0")}


def die_with_parent() -> Optional[Callable[[], None]]:
    """A ``preexec_fn`` making the child get SIGKILL when this process dies (Linux; None elsewhere).

    The signal follows the *thread* that forked: spawn from a thread that lives as long as the job
    (the launcher spawns from its main thread). If this process died between fork and the prctl
    call, the child has a new parent already and kills itself."""
    if not sys.platform.startswith("linux"):
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up here, not in the forked child
    parent = os.getpid()

    def preexec() -> None:
        if prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0 or os.getppid() != parent:
            os.kill(os.getpid(), signal.SIGKILL)

    return preexec


@dataclass
class Member:
    name: str
    proc: subprocess.Popen
    worker: bool
    rank_file: Optional[str] = None
    rank: Optional[int] = None

    @property
    def label(self) -> str:
        """How its output lines are prefixed: ``rank 0`` once known, else ``worker 1``."""
        return self.name if self.rank is None else f"rank {self.rank}"

    @property
    def title(self) -> str:
        """How messages name it: ``worker 1 (rank 0)``."""
        return self.name if self.rank is None else f"{self.name} (rank {self.rank})"


class Job:
    """The processes of one job; ``wait()`` returns the exit code of the whole job."""

    def __init__(self, command: Sequence[str], *, workers: int, servers: int, host: str = "127.0.0.1",
                 port: Optional[int] = None, grace_s: float = 30.0, straggler_s: float = STRAGGLER_S,
                 exit_guard: bool = True):
        self.exit_guard = exit_guard  # its workers' first ShardIter installs loader.install_exit_guard()
        self.command, self.workers, self.servers, self.host = list(command), workers, servers, host
        self.port = port or free_port()
        self.grace_s = grace_s
        self.straggler_s = straggler_s
        self.members: list[Member] = []
        self._print = threading.Lock()
        self._pumps: list[threading.Thread] = []
        self._ranks = tempfile.mkdtemp(prefix="shardgen-launch-")  # workers' rank reports

    def _spawn(self, name: str, role: str, argv: list, rank: Optional[int] = None) -> None:
        env = {**os.environ, **dmlc_env(role, workers=self.workers, servers=self.servers, host=self.host,
                                         port=self.port)}
        rank_file = None
        if rank is not None:
            env["SHARDGEN_WORKER_RANK"] = str(rank)  # the launch index; MXNet assigns kv.rank itself
            env[RANK_FILE] = rank_file = os.path.join(self._ranks, f"worker-{rank}")
            env.pop(GUARD_ENV, None)
            if self.exit_guard:
                env[GUARD_ENV] = "1"
        proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True, preexec_fn=die_with_parent())
        member = Member(name, proc, role == "worker", rank_file)
        self.members.append(member)
        pump = threading.Thread(target=self._pump, args=(member,), daemon=True)
        pump.start()
        self._pumps.append(pump)

    def _pump(self, member: Member) -> None:
        for raw in iter(member.proc.stdout.readline, b""):
            line = raw.decode(errors="replace").rstrip("\n")
            if member.rank is None:
                self._learn_ranks()  # a worker reports its rank before it prints as that rank
            with self._print:  # one prefix a line: a worker that labels its own lines (train.py) keeps its own
                print(line if line.startswith(f"[{member.label}] ") else f"[{member.label}] {line}", flush=True)

    def _learn_ranks(self) -> None:
        for m in self.members:
            if m.rank_file is None or m.rank is not None:
                continue
            try:
                with open(m.rank_file) as fh:
                    rank = int(fh.read())
            except (OSError, ValueError):
                continue
            with self._print:
                if m.rank is None:
                    m.rank = rank
                    print(f"launch: {m.name} is rank {rank}", file=sys.stderr, flush=True)

    def start(self) -> None:
        boot = [sys.executable, "-c", "import mxnet"]
        self._spawn("scheduler", "scheduler", boot)
        for i in range(self.servers):
            self._spawn(f"server {i}", "server", boot)
        for i in range(self.workers):
            self._spawn(f"worker {i}", "worker", self.command, rank=i)
        self._say("launch: started " + ", ".join(f"{m.name} (pid {m.proc.pid})" for m in self.members))

    def kill(self) -> None:
        for m in self.members:
            if m.proc.poll() is None:
                try:
                    os.killpg(m.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for m in self.members:
            m.proc.wait()
        for pump in self._pumps:
            pump.join(timeout=5)
        shutil.rmtree(self._ranks, ignore_errors=True)

    def wait(self, timeout: Optional[float] = None) -> int:
        """0 when every worker exits 0; otherwise the first failure's code (all others killed), or
        ``TIMED_OUT`` after ``timeout`` seconds or when a worker straggles (see ``straggler_s``)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        finished: Optional[tuple[str, float]] = None  # the first worker to exit 0, and when
        try:
            while True:
                self._learn_ranks()
                for m in self.members:
                    code = m.proc.poll()
                    if code not in (None, 0):
                        what = f"exited with code {code}" if code > 0 else f"was killed by signal {-code}"
                        self._say(f"launch: {m.title} {what}; stopping the job")
                        self.kill()
                        return code if code > 0 else 1
                    if code == 0 and m.worker and finished is None:
                        finished = (m.title, time.monotonic())
                if not self._workers_running():
                    break
                now = time.monotonic()
                if finished is not None and now - finished[1] > self.straggler_s:
                    late = ", ".join(m.title for m in self.members if m.worker and m.proc.poll() is None)
                    self._say(f"launch: {late} still running {self.straggler_s:g}s after {finished[0]} exited 0 "
                              f"(hung at exit? see --straggler-s); stopping the job")
                    self.kill()
                    return TIMED_OUT
                if deadline is not None and now > deadline:
                    self._say(f"launch: timed out after {timeout:g}s; stopping the job")
                    self.kill()
                    return TIMED_OUT
                time.sleep(0.05)
            # Workers are done: scheduler and servers shut down on their own, or are stopped.
            end = time.monotonic() + self.grace_s
            while any(m.proc.poll() is None for m in self.members) and time.monotonic() < end:
                time.sleep(0.05)
            self.kill()
            return 0
        except BaseException:
            self.kill()
            raise

    def _workers_running(self) -> bool:
        return any(m.worker and m.proc.poll() is None for m in self.members)

    def _say(self, text: str) -> None:
        with self._print:
            print(text, file=sys.stderr, flush=True)


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" in argv:
        cut = argv.index("--")
        own, command = argv[:cut], argv[cut + 1:]
    else:
        own, command = argv, []
    p = argparse.ArgumentParser(prog="python -m loader.tools.launch",
                                usage="%(prog)s [-n N] [-s S] [--timeout S] [--straggler-s S] -- COMMAND ...",
                                description=__doc__.split("\n\n")[0],
                                epilog="Exit code: 0 when every worker exited 0; a failed process's code; 124 "
                                       "when --timeout or --straggler-s fired; 130 on Ctrl-C.")
    p.add_argument("-n", "--num-workers", type=int, default=2, metavar="N", help="workers (default 2)")
    p.add_argument("-s", "--num-servers", type=int, default=1, metavar="S", help="servers (default 1)")
    p.add_argument("--host", default="127.0.0.1", help="scheduler address (default: loopback)")
    p.add_argument("--port", type=int, help="scheduler port (default: a free one)")
    p.add_argument("--timeout", type=float,
                   help="stop the whole job (exit 124) if it is still running after this many seconds "
                        "(default: no limit)")
    p.add_argument("--straggler-s", type=float, default=STRAGGLER_S, metavar="S",
                   help="stop the job (exit 124, naming the worker) if a worker is still running S seconds "
                        f"after another worker exited 0 (default {STRAGGLER_S:g})")
    p.add_argument("--no-exit-guard", action="store_true",
                   help="leave the workers' exit as Python and MXNet make it (by default their first ShardIter "
                        "installs loader.install_exit_guard(), so a failing worker exits instead of hanging)")
    args = p.parse_args(own)
    if not command:
        p.error("give the worker command after --, e.g. -- python -m loader.tools.train --kvstore dist_sync")
    if args.num_workers < 1 or args.num_servers < 1:
        p.error("need at least one worker and one server")
    if args.straggler_s <= 0 or (args.timeout is not None and args.timeout <= 0):
        p.error("--timeout and --straggler-s must be > 0")
    job = Job(command, workers=args.num_workers, servers=args.num_servers, host=args.host, port=args.port,
              straggler_s=args.straggler_s, exit_guard=not args.no_exit_guard)

    def on_signal(signum, _frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_signal)
    try:
        job.start()
        return job.wait(args.timeout)
    except KeyboardInterrupt:
        print("launch: interrupted; all processes stopped", file=sys.stderr)
        job.kill()
        return 130


if __name__ == "__main__":
    sys.exit(main())
