"""The model package format, torch-free: the export command and the service share it.

    <repo>/<name>/<version>/
        model.onnx       the full-sequence graph
        step.onnx        language models: one step, state in and out
        vocab.txt        language models: one token per line
        golden.npz       "<graph>/<tensor>" inputs and the outputs torch computed
        manifest.json    what the package is (see export/exporter.py), with the
                         sha256 of every other file

``verify_package`` checks the hashes and runs onnxruntime on the golden inputs.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np

FORMAT = "orthornn-package/1"
TOLERANCE = 1e-4


class PackageError(ValueError):
    """A package that must not be served; the message says what is wrong."""


def sha256(path: str | Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def read_manifest(package: str | Path) -> dict:
    path = Path(package) / "manifest.json"
    if not path.is_file():
        raise PackageError(f"{str(package)!r} is not a model package (no manifest.json)")
    try:
        manifest = json.loads(path.read_text())
    except ValueError as error:
        raise PackageError(f"{str(path)!r} is not valid JSON: {error}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise PackageError(f"{str(path)!r} is not an orthornn package manifest ({FORMAT})")
    return manifest


def check_hashes(package: str | Path, manifest: dict) -> None:
    package = Path(package)
    files = manifest.get("files") or {}
    for name in manifest.get("graphs", {}).values():
        if name not in files:
            raise PackageError(f"manifest lists no sha256 for graph {name!r}")
    for name, expected in files.items():
        path = package / name
        if Path(name).name != name or not path.is_file():
            raise PackageError(f"package file {name!r} is missing")
        actual = sha256(path)
        if actual != expected:
            raise PackageError(f"sha256 mismatch for {name!r}: manifest {expected[:12]}..., "
                               f"file {actual[:12]}...")


def session(path: str | Path, providers: list[str] | None = None, threads: int | None = None):
    return session_from_bytes(str(path), providers, threads)


def session_from_bytes(model, providers: list[str] | None = None, threads: int | None = None):
    """An onnxruntime session of a model file path or serialized bytes."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3  # errors reach the caller as exceptions
    if threads:
        options.intra_op_num_threads = threads
    return ort.InferenceSession(model, options, providers=providers or ["CPUExecutionProvider"])


def golden_check(package: str | Path, manifest: dict, sessions: dict | None = None) -> float:
    """Run every graph on its golden inputs; the largest deviation, or PackageError when
    an output differs from torch's by more than TOLERANCE (absolute + relative)."""
    package = Path(package)
    with np.load(package / "golden.npz", allow_pickle=False) as data:
        golden = {k: data[k] for k in data.files}
    worst = 0.0
    for graph, filename in manifest["graphs"].items():
        sess = (sessions or {}).get(graph) or session(package / filename)
        feeds = {i.name: golden[f"{graph}/{i.name}"] for i in sess.get_inputs()}
        names = [o.name for o in sess.get_outputs()]
        for name, got in zip(names, sess.run(names, feeds), strict=True):
            expected = golden[f"{graph}/{name}"]
            if got.shape != expected.shape:
                raise PackageError(f"golden check failed: {graph}/{name} has shape {got.shape}, "
                                   f"expected {expected.shape}")
            error = float(np.max(np.abs(got - expected) / (1 + np.abs(expected)), initial=0.0))
            worst = max(worst, error)
            if not error <= TOLERANCE:
                raise PackageError(f"golden check failed: {graph}/{name} differs from the "
                                   f"exported model's outputs by {error:.3g} (> {TOLERANCE})")
    return worst


def verify_package(package: str | Path) -> dict:
    """The manifest of a package whose files match their hashes and whose graphs
    reproduce the golden outputs; PackageError otherwise."""
    manifest = read_manifest(package)
    check_hashes(package, manifest)
    try:
        golden_check(package, manifest)
    except PackageError:
        raise
    except Exception as error:  # onnxruntime cannot load or run the graph
        raise PackageError(f"golden check could not run: {error}") from None
    return manifest
