"""Processes a test started, found and killed by a tag in their environment.

A launcher's members (and their children) inherit the launcher's environment, so a unique
``TEST_PROCESS_TAG`` finds every one of them through ``/proc/*/environ`` even after the launcher
died and they were reparented. ``Tagged`` kills them all when the test ends, however it ends.
"""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import threading
import time
import uuid
from pathlib import Path
from typing import Optional

TAG_VAR = "TEST_PROCESS_TAG"


def alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[-1].split()[0] != "Z"
    except OSError:
        return False


def tagged_pids(tag: str) -> list[int]:
    """Live processes whose environment holds ``TEST_PROCESS_TAG=tag``."""
    needle = f"{TAG_VAR}={tag}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            env = (entry / "environ").read_bytes()
        except OSError:  # gone, or not ours
            continue
        if needle in env.split(b"\0") and alive(int(entry.name)):
            found.append(int(entry.name))
    return found


def member_pids(stderr: str) -> dict[str, int]:
    """``{"scheduler": pid, "server 0": pid, "worker 0": pid, ...}`` from the launcher's start line."""
    line = next(ln for ln in stderr.splitlines() if ln.startswith("launch: started "))
    return {name: int(pid) for name, pid in re.findall(r"([a-z]+(?: \d+)?) \(pid (\d+)\)", line)}


class Tagged:
    """A process (a launcher) started with a fresh tag; ``close()`` SIGKILLs everything tagged.

    ``lines`` is fed by a reader thread, so waiting for a line never blocks past a deadline."""

    def __init__(self, argv: list, *, env: Optional[dict] = None, **kw):
        self.tag = uuid.uuid4().hex
        env = {**(os.environ if env is None else env), TAG_VAR: self.tag}
        self.proc = subprocess.Popen([str(a) for a in argv], env=env, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, **kw)
        self.lines: queue.Queue = queue.Queue()
        self.out: list[str] = []
        self.err: list[str] = []
        self._readers = [threading.Thread(target=self._read, args=(s, b), daemon=True)
                         for s, b in ((self.proc.stdout, self.out), (self.proc.stderr, self.err))]
        for t in self._readers:
            t.start()

    def _read(self, stream, sink: list) -> None:
        for line in stream:
            sink.append(line)
            self.lines.put(line)

    def wait_line(self, needle: str, deadline: float) -> str:
        """The first line (stdout or stderr) holding ``needle``; AssertionError at ``deadline``."""
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"no line with {needle!r} in time:\n{self.output}")
            try:
                line = self.lines.get(timeout=min(left, 0.2))
            except queue.Empty:
                if self.proc.poll() is not None and self.lines.empty() and not any(t.is_alive() for t in self._readers):
                    raise AssertionError(f"exited {self.proc.returncode} before a line with {needle!r}:\n"
                                         f"{self.output}") from None
                continue
            if needle in line:
                return line

    def wait(self, timeout: float) -> int:
        """The exit code; AssertionError (everything killed) if it runs past ``timeout`` seconds."""
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.close()
            raise AssertionError(f"still running after {timeout:g}s:\n{self.output}") from None
        for t in self._readers:
            t.join(5)
        return code

    @property
    def stdout(self) -> str:
        return "".join(self.out)

    @property
    def stderr(self) -> str:
        return "".join(self.err)

    @property
    def output(self) -> str:
        return self.stdout + self.stderr

    def close(self) -> list[int]:
        """SIGKILL the process and everything tagged; the pids that were still alive."""
        left = []
        for _ in range(3):  # a dying parent may still spawn
            pids = tagged_pids(self.tag)
            if self.proc.poll() is None:
                pids.append(self.proc.pid)
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            left += pids
            if not pids:
                break
            time.sleep(0.05)
        self.proc.wait()
        return sorted(set(left))

    def __enter__(self) -> Tagged:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def settle(tag: str, within: float = 5.0) -> set[int]:
    """The tagged processes still alive ``within`` seconds from now (those being killed get the time
    to die; returns as soon as none is left)."""
    deadline = time.monotonic() + within
    while (pids := tagged_pids(tag)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return set(pids)


def run(argv: list, *, timeout: float, **kw) -> subprocess.CompletedProcess:
    """``subprocess.run(capture_output=True, text=True)`` that kills every tagged process at the end.
    ``.alive_at_exit`` holds the tagged pids still alive after the process exited (checked before the
    cleanup, so a test can name what was left); ``.left_behind`` those the cleanup had to kill."""
    job = Tagged(argv, **kw)
    try:
        code = job.wait(timeout)
        alive_at_exit = settle(job.tag)
    finally:
        left = job.close()
    result = subprocess.CompletedProcess(argv, code, job.stdout, job.stderr)
    result.alive_at_exit = alive_at_exit
    result.left_behind = left
    return result
