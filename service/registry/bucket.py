"""A repository in a bucket (``--repo s3://BUCKET/PREFIX``), served from a local mirror:
before each scan of the repository, the bucket's models are copied into the folder the
service serves (``settings.repo``, the repository cache), so that the loader, the catalog
and the policy read a folder as they always have.

One listing of the bucket's prefix a poll (a request per 1,000 keys), a download only
for a version not mirrored yet (each by one rename; the loader verifies its hashes and
golden outputs as for any version), a conditional GET for each record (an unchanged
promotion.json costs a 304). A model gone from the bucket goes from the mirror. A failure
(the store down, credentials refused) is counted (``orthornn_repository_errors_total``)
and logged once; what is loaded keeps serving, and the next poll catches up.
"""

from __future__ import annotations

import logging
import shutil
import threading
from pathlib import Path

from orthornn.export.artifacts import remote
from orthornn.export.artifacts.repository import NAME
from orthornn.export.artifacts.storage import Store, open_store
from orthornn.export.artifacts.storage.store import join

from ..metrics import Metrics

log = logging.getLogger("orthornn.repository")


class BucketMirror:
    def __init__(self, uri: str, folder: Path, metrics: Metrics) -> None:
        self.uri, self.folder, self.metrics = uri, folder, metrics
        self.store = open_store(uri, "repo")
        self._stores: dict[str, Store] = {}  # one client a model, rooted at it
        self._etags: dict[str, dict[str, str]] = {}  # a model's records' ETags
        self._failing: str | None = None
        # the poller and the repository API's rollback both sync: one at a time, so that
        # neither replaces a version folder the other has just renamed into place
        self._lock = threading.Lock()

    def location(self, name: str) -> str:
        """The model's URI in the bucket (what the rollback writes)."""
        return join(self.uri, name)

    def sync(self, only: str | None = None) -> bool:
        """Mirror every model of the bucket (or ONLY); False when the store failed."""
        with self._lock:
            return self._sync(only)

    def _sync(self, only: str | None) -> bool:
        try:
            by_model: dict[str, list[str]] = {}
            for key in self.store.list(f"{only}/" if only else ""):
                name, _, rest = key.partition("/")
                if rest and NAME.match(name):
                    by_model.setdefault(name, []).append(rest)
            for name, keys in sorted(by_model.items()):
                store = self._stores.get(name) or self._stores.setdefault(
                    name, open_store(self.location(name), "repo"))
                remote.mirror(store, self.folder / name, keys=keys,
                              etags=self._etags.setdefault(name, {}))
            if only is None:
                for old in self.folder.iterdir():
                    if old.is_dir() and NAME.match(old.name) and old.name not in by_model:
                        shutil.rmtree(old, ignore_errors=True)  # gone from the bucket
        except Exception as error:  # the store's errors: the loaded versions keep serving
            self.metrics.repository_errors.inc()
            if self._failing is None:
                log.error("the model repository %s cannot be read (%s); the loaded versions "
                          "keep serving", self.uri, str(error).splitlines()[0][:300])
            self._failing = str(error)
            return False
        if self._failing is not None:
            log.info("the model repository %s can be read again", self.uri)
            self._failing = None
        return True
