"""The storage interface on an S3-compatible bucket, through obstore (the Rust
object_store crate's client: 12 ms to import, one 6 MB wheel, S3's conditional writes and
GETs; docs/design.md, "Storage").

Configured as the AWS tools are, from the environment: ``AWS_ENDPOINT_URL`` (or
``AWS_ENDPOINT_URL_S3``; an http:// endpoint is allowed as given), ``AWS_REGION`` (or
``AWS_DEFAULT_REGION``; us-east-1 without either), ``AWS_ACCESS_KEY_ID`` /
``AWS_SECRET_ACCESS_KEY`` / ``AWS_SESSION_TOKEN``, or a pod's web identity
(``AWS_WEB_IDENTITY_TOKEN_FILE`` with ``AWS_ROLE_ARN``), which obstore reads itself.
"""

from __future__ import annotations

import datetime as dt
import os
import uuid
from typing import TYPE_CHECKING, Any

from .store import Blob, Changed, Exists, check_key, split_uri

if TYPE_CHECKING:
    from obstore.store import ClientConfig, RetryConfig

# a request that does not answer within these fails (and is retried by obstore up to
# MAX_RETRIES times): a stopped server costs a caller seconds, not minutes
TIMEOUT = "30s"
CONNECT_TIMEOUT = "5s"
MAX_RETRIES = 3
RETRY_TIMEOUT = dt.timedelta(seconds=20)
#: the user metadata (x-amz-meta-orthornn-write) that marks a conditional write as its own
WRITER = "orthornn-write"


def _client(bucket: str, prefix: str) -> Any:
    from obstore.store import S3Store

    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    options: ClientConfig = {"timeout": TIMEOUT, "connect_timeout": CONNECT_TIMEOUT}
    kwargs: dict[str, Any] = {}
    if endpoint:
        kwargs["endpoint"] = endpoint
        options["allow_http"] = endpoint.startswith("http://")
    region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1"
    retry: RetryConfig = {"max_retries": MAX_RETRIES, "retry_timeout": RETRY_TIMEOUT,
                          "backoff": {"init_backoff": dt.timedelta(milliseconds=100),
                                      "max_backoff": dt.timedelta(seconds=2), "base": 2}}
    return S3Store(bucket, prefix=prefix or None, region=region, client_options=options,
                   retry_config=retry, **kwargs)


class S3:
    def __init__(self, uri: str, setting: str = "--repo") -> None:
        self.uri, self.setting = uri.rstrip("/"), setting
        self.bucket, self.prefix = split_uri(self.uri)
        self._store = _client(self.bucket, self.prefix)

    def _failed(self, key: str, error: BaseException) -> OSError:
        """An obstore error (not a missing key) as one OSError line naming the object: the
        store did not answer, or refused; callers treat it as any other I/O error."""
        return OSError(f"{self.uri}/{key}: {describe(error)}")

    def read(self, key: str) -> Blob:
        import obstore
        from obstore.exceptions import BaseError

        try:
            result = obstore.get(self._store, check_key(key))
            return Blob(bytes(result.bytes()), str(result.meta["e_tag"]))
        except BaseError as error:
            raise self._failed(key, error) from None

    def read_if_changed(self, key: str, etag: str) -> Blob | None:
        import obstore
        from obstore.exceptions import BaseError, NotModifiedError

        try:
            result = obstore.get(self._store, check_key(key), options={"if_none_match": etag})
            return Blob(bytes(result.bytes()), str(result.meta["e_tag"]))
        except NotModifiedError:
            return None
        except BaseError as error:
            raise self._failed(key, error) from None

    def _put(self, key: str, data: bytes, mode: Any,
             conflict: Exception | None = None) -> str:
        """PUT KEY in MODE; CONFLICT raised for S3's 412 (or a missing key under If-Match).
        A conditional PUT carries a nonce of its own (user metadata, WRITER): when its
        reply was lost (a cut connection) and obstore's retry then met a 412, or every try
        failed, the object is read back, and carrying the nonce it is this write's, done
        once (else a record's change would be applied twice, a created manifest refused)."""
        import obstore
        from obstore.exceptions import (
            AlreadyExistsError,
            BaseError,
            NotFoundError,
            PreconditionError,
        )

        nonce = None if conflict is None else uuid.uuid4().hex
        try:
            result = obstore.put(self._store, check_key(key), data, mode=mode,
                                 attributes=None if nonce is None else {WRITER: nonce})
            return str(result["e_tag"])
        except (AlreadyExistsError, PreconditionError, NotFoundError) as error:
            if conflict is None:
                raise self._failed(key, error) from None
            etag = self._written_by(key, nonce)
            if etag is None:
                raise conflict from None
            return etag
        except BaseError as error:
            etag = None if nonce is None else self._written_by(key, nonce)
            if etag is None:
                raise self._failed(key, error) from None
            return etag

    def _written_by(self, key: str, nonce: str | None) -> str | None:
        """KEY's ETag if the object there was written with NONCE, else None."""
        import obstore
        from obstore.exceptions import BaseError

        try:
            result = obstore.get(self._store, key)
        except (FileNotFoundError, BaseError):
            return None
        if result.attributes.get(WRITER) != nonce:
            return None
        return str(result.meta["e_tag"])

    def write(self, key: str, data: bytes) -> str:
        return self._put(key, data, "overwrite")

    def write_if_absent(self, key: str, data: bytes) -> str:
        return self._put(key, data, "create", Exists(key))

    def write_if_unchanged(self, key: str, data: bytes, etag: str) -> str:
        return self._put(key, data, {"e_tag": etag}, Changed(key))

    def list(self, prefix: str = "") -> list[str]:
        import obstore
        from obstore.exceptions import BaseError

        try:
            pages = obstore.list(self._store, prefix=prefix or None)
            return sorted(str(meta["path"]) for page in pages for meta in page)
        except BaseError as error:
            raise self._failed(prefix or "*", error) from None

    def delete(self, key: str) -> None:
        import obstore
        from obstore.exceptions import BaseError

        try:  # S3 answers 204 for a missing key too
            obstore.delete(self._store, check_key(key))
        except BaseError as error:
            raise self._failed(key, error) from None

    def check(self) -> None:
        """One listing request; a failure is one line naming the setting and the cause."""
        import obstore

        try:
            obstore.list(self._store, chunk_size=1).collect()
        except Exception as error:  # obstore's errors: the cause is in their text
            raise ValueError(f"{self.setting}: {self.uri} cannot be used: "
                             f"{describe(error)}") from None


def describe(error: BaseException) -> str:
    """The cause of an obstore error in one line (its text is a multi-line debug dump)."""
    text = str(error)
    # without keys obstore asks the instance metadata service (IMDS) last: its paths
    none = ("no credentials: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or give the "
            "pod a web identity (the instance metadata gave none)")
    for code, say in (("/latest/api/token", none), ("/latest/meta-data", none),
                      ("NoSuchBucket", "the bucket does not exist"),
                      ("InvalidAccessKeyId", "the access key is refused (AWS_ACCESS_KEY_ID)"),
                      ("SignatureDoesNotMatch",
                       "the secret key is refused (AWS_SECRET_ACCESS_KEY)"),
                      ("AccessDenied", "access denied to these credentials"),
                      ("403", "access denied to these credentials"),
                      ("Connection refused", "the endpoint refuses connections "
                                             "(AWS_ENDPOINT_URL)"),
                      ("error sending request", "the endpoint does not answer "
                                                "(AWS_ENDPOINT_URL)"),
                      ("timed out", "the endpoint does not answer (AWS_ENDPOINT_URL)")):
        if code in text:
            return say
    return text.splitlines()[0][:300] if text else type(error).__name__
