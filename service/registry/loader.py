"""Loading one version: verified with ``export.artifacts.package`` (sha256 of every file,
then the golden outputs on the very inference sessions that will serve), warmed up, and
handed to the app's ``on_load`` hook, which attaches its batchers (``registry.batching``).

A version that fails verification is never served: the refusal is logged and counted
once, recorded with the signature of its files, and not retried until they change (or
the repository API's load asks for it: ``forget``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path

from orthornn.export.artifacts.package import (
    PackageError,
    check_hashes,
    golden_check,
    read_manifest,
)

from ..metrics import Metrics
from ..settings import Settings
from .catalog import ModelVersion
from .runtime import Runtime
from .spec import ModelSpec

log = logging.getLogger("orthornn.service")

LoadHook = Callable[[ModelVersion], None]


def signature(path: Path) -> tuple:
    """Changes when any file of a version directory changes (a half-written version that
    is completed later is tried again)."""
    try:
        entries = sorted((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in path.iterdir())
    except OSError:
        return ()
    return (path.stat().st_mtime_ns, *entries)


class Loader:
    def __init__(self, settings: Settings, metrics: Metrics, providers: list[str],
                 on_load: LoadHook):
        self.settings = settings
        self.metrics = metrics
        self.providers = providers
        self.on_load = on_load
        self.repo = Path(settings.repo)
        self.lock = threading.Lock()  # one loader at a time (poller, API or a session)
        # (name, version) -> (signature of its files, why it was refused)
        self._refused: dict[tuple[str, int], tuple[tuple, str]] = {}

    def refused(self, name: str, version: int) -> str | None:
        """Why VERSION of NAME was refused, the last time it was tried; None if it was not."""
        refusal = self._refused.get((name, version))
        return None if refusal is None else refusal[1]

    def forget(self, name: str) -> None:
        """(Under the lock.) Try NAME's refused versions again at their next load."""
        for key in [k for k in self._refused if k[0] == name]:
            del self._refused[key]

    def load(self, name: str, version: int, purpose: str = "") -> ModelVersion | str:
        """(Under the lock.) VERSION of NAME verified, loaded and warmed, or why it is
        refused: a refusal is logged and counted once, then answered from the record
        until the version's files change. PURPOSE: words for the log (" for sessions")."""
        key = (name, version)
        sig = signature(self.repo / name / str(version))
        refusal = self._refused.get(key)
        if refusal is not None and refusal[0] == sig:
            return refusal[1]
        start = time.perf_counter()
        try:
            mv = self.load_version(name, version)
        except (PackageError, OSError) as error:
            self._refused[key] = (sig, str(error))
            self.metrics.load_failures.labels(name).inc()
            log.error("refused %s version %d%s: %s", name, version, purpose, error)
            return str(error)
        self._refused.pop(key, None)
        log.info("loaded %s version %d (%s, %s)%s in %.2f s", name, version,
                 mv.manifest.arch, mv.manifest.mode, purpose, time.perf_counter() - start)
        return mv

    def load_version(self, name: str, version: int) -> ModelVersion:
        """Verify, load and warm one version, then attach its batchers (the on_load
        hook); PackageError when it must not be served."""
        path = self.repo / name / str(version)
        manifest = read_manifest(path)
        if manifest.name != name or manifest.version != version:
            raise PackageError(f"manifest says {manifest.name!r} version "
                               f"{manifest.version!r}, directory is {name}/{version}")
        check_hashes(path, manifest)
        spec = ModelSpec.from_manifest(manifest, path, self.settings.max_token_length)
        runtime = Runtime(path, manifest, self.providers, self.settings.inference_threads)
        try:  # the golden check runs on the inference sessions that will serve
            golden_check(path, manifest, sessions=runtime.inference_sessions)
            runtime.warm_up(spec, min(self.settings.max_batch_size, 4))
        except PackageError:
            raise
        except Exception as error:
            raise PackageError(f"golden check could not run: {error}") from None
        mv = ModelVersion(name, version, path, manifest, spec, runtime)
        self.on_load(mv)
        return mv
