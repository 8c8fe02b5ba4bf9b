"""A second kind of object store, for tests: ``fake://bucket/prefix``, its objects the files of a
local folder (``$SHARDGEN_FAKE_OBJECTS_ROOT/bucket/prefix/name``). No server, no boto3: it shows
that a new store kind is one module (this one) and one line where stores are opened
(``SHARDGEN_OBJECT_STORES=fake=fake_objects:FakeObjects``, set by ``FakeServer``), and lets the
loader's store tests run on it unchanged.

``FakeServer`` stands in for ``s3server.S3Server``: ``stop()``/``kill()`` make every request fail
as an unreachable store does (a ``.down`` file in its root), ``start()`` brings it back.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Iterator, Optional

from shardgen.fsutil import atomic_write
from shardgen.store.objfetch import CHUNK, Downloads
from shardgen.store.objurl import ObjectInfo, ObjectMismatch, ObjectStoreError, StoreUnreachable

ROOT_ENV = "SHARDGEN_FAKE_OBJECTS_ROOT"


class FakeObjects(Downloads):
    """The objects of ``fake://bucket/prefix``: files under the folder ``$SHARDGEN_FAKE_OBJECTS_ROOT``."""

    def __init__(self, url: str):
        rest = url.removeprefix("fake://")
        self.bucket, _, prefix = rest.partition("/")
        if not self.bucket:
            raise ObjectStoreError(f"{url!r}: no bucket name (expected fake://bucket/prefix)")
        self.prefix = prefix.strip("/") + "/" if prefix.strip("/") else ""
        self.url = f"fake://{self.bucket}/{self.prefix}".rstrip("/")
        self.root = Path(os.environ[ROOT_ENV])

    def __reduce__(self):
        return (FakeObjects, (self.url,))

    @property
    def endpoint(self) -> str:
        return f"the folder {self.root}"

    @property
    def attempts(self) -> int:
        return int(os.environ.get("AWS_MAX_ATTEMPTS", "2"))

    def where(self, name: str = "") -> str:
        return f"{self.url}/{name}" if name else self.url

    def _path(self, name: str, verb: str) -> Path:
        """The file of ``name``; while the "server" is down, what S3's client says after its retries."""
        if (self.root / ".down").exists():
            times = f"{self.attempts} time" + ("s" if self.attempts != 1 else "")
            raise StoreUnreachable(f"{self.where(name)}: {verb} failed {times}; cannot reach {self.endpoint} (down)")
        return self.root / self.bucket / self.prefix / name

    def check(self) -> None:
        self._path("", "checking the bucket")
        if not (self.root / self.bucket).is_dir():
            raise ObjectStoreError(f"{self.where()}: no such bucket")

    def _info(self, path: Path) -> ObjectInfo:
        st = path.stat()
        return ObjectInfo(st.st_size, st.st_mtime, "")

    def head(self, name: str) -> Optional[ObjectInfo]:
        path = self._path(name, "HEAD")
        return self._info(path) if path.is_file() else None

    def get(self, name: str) -> Optional[bytes]:
        found = self.get_with_info(name)
        return None if found is None else found[0]

    def get_with_info(self, name: str) -> Optional[tuple[bytes, ObjectInfo]]:
        path = self._path(name, "GET")
        try:
            return path.read_bytes(), self._info(path)
        except (FileNotFoundError, IsADirectoryError):
            return None

    def put(self, name: str, data: bytes, *, verify: bool = True) -> None:
        path = self._path(name, "PUT")
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, data, fsync=False)

    def upload(self, name: str, path: Path) -> str:
        import hashlib

        data = Path(path).read_bytes()
        self.put(name, data)
        return hashlib.sha256(data).hexdigest()

    def delete(self, name: str) -> None:
        self._path(name, "DELETE").unlink(missing_ok=True)

    def list(self, under: str = "") -> dict[str, ObjectInfo]:
        base = self._path("", "LIST")
        found = {}
        for path in base.rglob("*") if base.is_dir() else ():
            name = path.relative_to(base).as_posix()
            if path.is_file() and name.startswith(under) and ".tmp-" not in name:
                found[name] = self._info(path)
        return found

    def clock(self, name: str) -> float:
        self.put(name, b"")
        return self._info(self._path(name, "HEAD")).mtime

    def chunks(self, name: str) -> Iterator[bytes]:
        try:
            fh = open(self._path(name, "GET"), "rb")
        except StoreUnreachable as exc:
            raise ConnectionError(str(exc)) from None
        except FileNotFoundError:
            raise ObjectMismatch(f"{self.where(name)}: no such object (listed in the manifest)") from None
        with fh:
            while chunk := fh.read(CHUNK):
                yield chunk


class FakeServer:
    """What the tests ask of ``s3server.S3Server``, for ``fake://`` stores (bucket ``data``)."""

    def __init__(self, root: Path, bucket: str = "data"):
        self.root, self.bucket = Path(root), bucket
        (self.root / bucket).mkdir(parents=True, exist_ok=True)

    def env(self) -> dict:
        return {ROOT_ENV: str(self.root), "SHARDGEN_OBJECT_STORES": "fake=fake_objects:FakeObjects",
                "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).parent),
                                                            os.environ.get("PYTHONPATH", "")]))}

    @property
    def endpoint(self) -> str:
        return f"the folder {self.root}"

    def url(self, prefix: str = "store") -> str:
        return f"fake://{self.bucket}/{prefix}"

    def start(self) -> FakeServer:
        (self.root / ".down").unlink(missing_ok=True)
        time.sleep(0.01)
        return self

    def stop(self) -> None:
        (self.root / ".down").touch()

    kill = stop
