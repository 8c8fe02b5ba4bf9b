"""The objects of a store on an S3-compatible object store (``s3://bucket/prefix``), through boto3.

The endpoint and credentials come the standard AWS way: ``AWS_ACCESS_KEY_ID`` /
``AWS_SECRET_ACCESS_KEY`` / ``AWS_PROFILE``, ``~/.aws/credentials`` and ``~/.aws/config``,
``AWS_ENDPOINT_URL`` (or ``AWS_ENDPOINT_URL_S3``) for S3-compatible servers, ``AWS_DEFAULT_REGION``.

What this module promises:

* ``put``/``upload`` are one ``PUT`` each (an object appears whole or not at all) sent with
  ``Content-MD5`` (the server refuses bytes that differ from what we hashed), and checked after
  upload with a ``HEAD``: size and ETag (the MD5 of a single-part upload) must match. The sha256
  rides along as metadata.
* ``download`` writes a temp file next to the target, checks size and sha256, then renames it:
  a file at the target name is always whole and verified. Bytes that differ are fetched once more,
  then refused (``ObjectMismatch``).
* Transient faults (connection refused or reset, timeouts, 5xx, throttling) are tried
  ``max_attempts`` times in all, the standard AWS setting (``AWS_MAX_ATTEMPTS``, or ``max_attempts``
  in the profile; default 4), with backoff (0.5, 1, 2, 4, then 8 s); then ``StoreUnreachable``
  names the endpoint and the object.
  Refused credentials are ``CredentialsRefused``: one line that says so.

The URL, ``ObjectInfo`` and the errors are in :mod:`shardgen.store.objurl`, the client in
:mod:`shardgen.store.s3client` (both importable from here too).
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, TypeVar, Union

from shardgen.store.objfetch import ATTEMPTS, CHUNK, Downloads, TransientFault, backoff
from shardgen.store.objurl import (
    CredentialsRefused,
    NoSuchStore,
    ObjectInfo,
    ObjectMismatch,
    ObjectStoreError,
    StoreUnreachable,
    is_remote,
    parse_url,
    store_errors_as,
)
from shardgen.store.s3client import attempts, client, endpoint, forget_clients

__all__ = ["is_remote", "parse_url", "ObjectStore", "ObjectInfo", "ObjectStoreError", "StoreUnreachable",
           "CredentialsRefused", "ObjectMismatch", "NoSuchStore", "ATTEMPTS", "store_errors_as", "forget_clients",
           "attempts"]

T = TypeVar("T")


def _missing(exc: BaseException) -> bool:
    """Whether a failed request says there is no such object."""
    from botocore.exceptions import ClientError

    return isinstance(exc, ClientError) and str(exc.response.get("Error", {}).get("Code")) in (
        "404", "NoSuchKey", "NotFound")


def _unless_missing(request: Callable[[], Any]) -> Any:
    """``request()``'s answer, or None when it says there is no such object."""
    try:
        return request()
    except Exception as exc:
        if _missing(exc):
            return None
        raise


def _md5(path_or_bytes) -> tuple[str, str, int]:
    """(base64 MD5, hex sha256, size) of bytes or of a file."""
    md5, sha = hashlib.md5(), hashlib.sha256()
    if isinstance(path_or_bytes, (bytes, bytearray, memoryview)):
        md5.update(path_or_bytes)
        sha.update(path_or_bytes)
        size = len(path_or_bytes)
    else:
        size = 0
        with open(path_or_bytes, "rb") as fh:
            while chunk := fh.read(CHUNK):
                md5.update(chunk)
                sha.update(chunk)
                size += len(chunk)
    return base64.b64encode(md5.digest()).decode(), sha.hexdigest(), size


class ObjectStore(Downloads):
    """The store folder ``url`` (``s3://bucket/prefix``): objects by their plain file names."""

    def __init__(self, url: str):
        self.bucket, self.prefix = parse_url(url)
        self.url = f"s3://{self.bucket}/{self.prefix}".rstrip("/")

    def __repr__(self) -> str:
        return f"ObjectStore({self.url!r})"

    def __reduce__(self):  # joblib/dask workers rebuild it (and their own client)
        return (ObjectStore, (self.url,))

    @property
    def endpoint(self) -> str:
        return endpoint()

    @property
    def attempts(self) -> int:
        return attempts()

    def key(self, name: str) -> str:
        return self.prefix + name

    def where(self, name: str = "") -> str:
        return f"{self.url}/{name}" if name else self.url

    # -- requests, with bounded retries and one clear error ------------------------------------------

    def _error(self, exc: BaseException, what: str, name: str) -> Optional[ObjectStoreError]:
        """The clear error for a failed request, or None if it is worth trying again."""
        from botocore.exceptions import ClientError, NoCredentialsError

        if isinstance(exc, NoCredentialsError):
            return CredentialsRefused(f"{self.where(name)}: no AWS credentials found (set AWS_ACCESS_KEY_ID "
                                      "and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE)")
        if not isinstance(exc, ClientError):
            return None
        code = str(exc.response.get("Error", {}).get("Code", ""))
        status = int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
        if code in ("SignatureDoesNotMatch", "InvalidAccessKeyId", "AccessDenied", "403", "InvalidToken",
                    "ExpiredToken"):
            return CredentialsRefused(f"{self.where(name)}: {endpoint()} refused our credentials ({code}); "
                                      "check AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY or AWS_PROFILE")
        if code == "NoSuchBucket" or (code == "404" and not name):  # HEAD of the bucket has no error body
            return NoSuchStore(f"{self.where()}: bucket {self.bucket!r} does not exist at {endpoint()}")
        if code == "BadDigest":
            return ObjectMismatch(f"{self.where(name)}: the server received other bytes than were sent "
                                  "(Content-MD5 mismatch)")
        if status >= 500 or code in ("SlowDown", "RequestTimeout", "Throttling"):
            return None
        message = exc.response.get("Error", {}).get("Message", "")
        return ObjectStoreError(f"{self.where(name)}: {what} failed ({code or status}: {message})")

    def _call(self, what: str, name: str, fn: Callable[[], T]) -> T:
        from botocore.exceptions import BotoCoreError, ClientError

        last, tries = None, self.attempts
        for attempt in range(1, tries + 1):
            try:
                return fn()
            except (ClientError, BotoCoreError, ConnectionError, OSError) as exc:
                error = self._error(exc, what, name)
                if error is not None:
                    raise error from None
                last = f"{type(exc).__name__}: {exc}"
            if attempt < tries:
                time.sleep(backoff(attempt))
        times = f"{tries} time" + ("s" if tries != 1 else "")
        raise StoreUnreachable(f"{self.where(name)}: {what} failed {times}; cannot reach {endpoint()} ({last})")

    def check(self) -> None:
        """Raise a clear error unless the bucket is reachable with our credentials."""
        self._call("checking the bucket", "", lambda: client().head_bucket(Bucket=self.bucket))

    def head(self, name: str) -> Optional[ObjectInfo]:
        def go():
            r = _unless_missing(lambda: client().head_object(Bucket=self.bucket, Key=self.key(name)))
            if r is None:
                return None
            return ObjectInfo(int(r["ContentLength"]), r["LastModified"].timestamp(), r.get("ETag", "").strip('"'))

        return self._call("HEAD", name, go)

    def get(self, name: str) -> Optional[bytes]:
        """The object's bytes, or None if there is no such object."""
        found = self.get_with_info(name)
        return None if found is None else found[0]

    def get_with_info(self, name: str) -> Optional[tuple[bytes, ObjectInfo]]:
        """The object's bytes and its size, mtime and ETag (one request), or None."""
        def go():
            r = _unless_missing(lambda: client().get_object(Bucket=self.bucket, Key=self.key(name)))
            if r is None:
                return None
            body = r["Body"].read()
            if len(body) != int(r["ContentLength"]):
                raise ConnectionError(f"short read: {len(body)} of {r['ContentLength']} bytes")
            return body, ObjectInfo(len(body), r["LastModified"].timestamp(), r.get("ETag", "").strip('"'))

        return self._call("GET", name, go)

    def put(self, name: str, data: bytes, *, verify: bool = True) -> None:
        """Write one object whole (one PUT with Content-MD5); with ``verify``, HEAD it after."""
        self._put(name, data, verify=verify)

    def upload(self, name: str, path: Path) -> str:
        """Upload a local file as one object, checked after upload; its sha256."""
        return self._put(name, Path(path), verify=True)

    def _put(self, name: str, source: Union[bytes, Path], *, verify: bool) -> str:
        md5, sha, size = _md5(source)

        def go():
            with contextlib.ExitStack() as stack:
                body = source if isinstance(source, bytes) else stack.enter_context(open(source, "rb"))
                client().put_object(Bucket=self.bucket, Key=self.key(name), Body=body, ContentMD5=md5,
                                     ContentLength=size, Metadata={"sha256": sha})

        self._call("PUT", name, go)
        if verify:
            self._check_uploaded(name, size, md5)
        return sha

    def _check_uploaded(self, name: str, size: int, md5_b64: str) -> None:
        info = self.head(name)
        want = base64.b64decode(md5_b64).hex()
        if info is None:
            raise ObjectMismatch(f"{self.where(name)}: missing right after its upload")
        if info.size != size:
            raise ObjectMismatch(f"{self.where(name)}: {info.size} bytes after upload, expected {size}")
        if info.etag and "-" not in info.etag and info.etag != want:
            raise ObjectMismatch(f"{self.where(name)}: ETag {info.etag} after upload, expected MD5 {want}")

    def delete(self, name: str) -> None:
        self._call("DELETE", name, lambda: client().delete_object(Bucket=self.bucket, Key=self.key(name)))

    def list(self, under: str = "") -> dict[str, ObjectInfo]:
        """Objects whose name starts with ``under``: name (relative to the store) -> info."""

        def go():
            found = {}
            pages = client().get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=self.key(under))
            for page in pages:
                for o in page.get("Contents", []):
                    found[o["Key"][len(self.prefix):]] = ObjectInfo(int(o["Size"]), o["LastModified"].timestamp(),
                                                                     o.get("ETag", "").strip('"'))
            return found

        return self._call("LIST", under, go)

    def clock(self, name: str) -> float:
        """"Now" by the store's own clock: the mtime of an object we just wrote (``name``)."""
        self.put(name, b"", verify=False)
        info = self.head(name)
        return info.mtime if info is not None else time.time()

    def chunks(self, name: str) -> Iterator[bytes]:
        """The object's bytes, in chunks; ObjectMismatch if there is no such object, a clear error
        if the request is refused, TransientFault if trying again may help."""
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            r = client().get_object(Bucket=self.bucket, Key=self.key(name))
            yield from r["Body"].iter_chunks(CHUNK)
        except ClientError as exc:
            if _missing(exc):
                raise ObjectMismatch(f"{self.where(name)}: no such object (listed in the manifest)") from None
            raise self._error(exc, "GET", name) or TransientFault(str(exc)) from None
        except BotoCoreError as exc:
            raise self._error(exc, "GET", name) or TransientFault(f"{type(exc).__name__}: {exc}") from None
