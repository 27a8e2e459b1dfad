"""The model package format, torch-free: the export command and the service share it.

    <repo>/<name>/<version>/
        model.onnx       the full-sequence graph (optional input initial_state [B, S])
        steps.onnx       classify / regress: the output after every step
        step.onnx        language models: one step, state in and out
        vocab.txt        language models: one token per line
        reference.npz    the drift reference (``export.artifacts.loop.drift``; optional)
        golden.npz       "<graph>/<tensor>" inputs and the outputs torch computed
        manifest.json    what the package is (``Manifest`` below), with the sha256 of
                         every other file

``Manifest`` is the one schema of manifest.json: the exporter builds it, the service
reads it (``read_manifest``). ``verify_package`` checks the hashes and runs
onnxruntime on the golden inputs.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from .manifest import (
    DATATYPES,
    FORMAT,
    INITIAL_LOGITS,
    INITIAL_STATE,
    INPUT_KINDS,
    ONNX_DATATYPES,
    TASKS,
    Datatype,
    GraphIO,
    InputSpec,
    Manifest,
    OutputSpec,
    PackageError,
    TensorSpec,
    check_preprocessing,
    output_name,
    plain_file_name,
)

# the schema's names, re-exported: a package's readers import them from here
__all__ = ["DATATYPES", "FORMAT", "INITIAL_LOGITS", "INITIAL_STATE", "INPUT_KINDS",
           "ONNX_DATATYPES", "TASKS", "TOLERANCE", "Datatype", "GraphIO", "InputSpec",
           "Manifest", "OutputSpec", "PackageError", "TensorSpec", "check_hashes",
           "check_preprocessing", "golden_check", "output_name", "package_file",
           "plain_file_name", "read_manifest", "read_vocabulary", "session",
           "session_from_bytes", "sha256", "verify_package"]

if TYPE_CHECKING:
    import onnxruntime as ort

TOLERANCE = 1e-4  # the golden check: |got - expected| / (1 + |expected|)


def package_file(package: str | Path, field_name: str, name: str) -> Path:
    """The path of the package's file NAME, checked to be a plain file name whose path,
    symbolic links resolved, stays inside the package folder (PackageError otherwise)."""
    package = Path(package)
    path = package / plain_file_name(field_name, name)
    try:
        inside = path.resolve(strict=True).is_relative_to(package.resolve(strict=True))
    except (OSError, RuntimeError):  # missing, or a loop of links
        raise PackageError(f"package file {name!r} is missing") from None
    if not inside:
        raise PackageError(f"package file {name!r} ({field_name}) leads outside the "
                           "package folder")
    if path.is_symlink():
        raise PackageError(f"package file {name!r} ({field_name}) is a symbolic link; a "
                           "package's files are its own")
    if not path.is_file():
        raise PackageError(f"package file {name!r} is missing")
    return path


def sha256(path: str | Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def read_manifest(package: str | Path) -> Manifest:
    path = Path(package) / "manifest.json"
    if path.is_symlink():  # what it says about the package must be the package's own
        raise PackageError(f"{str(path)!r} is a symbolic link; a package's files are its "
                           "own")
    if not path.is_file():
        raise PackageError(f"{str(package)!r} is not a model package (no manifest.json)")
    try:
        data = json.loads(path.read_text())
    except ValueError as error:
        raise PackageError(f"{str(path)!r} is not valid JSON: {error}") from None
    try:
        return Manifest.from_dict(data)
    except PackageError as error:
        raise PackageError(f"{str(path)!r}: {error}") from None


def read_vocabulary(package: str | Path, manifest: Manifest) -> list[str] | None:
    """A language model's vocabulary (``vocab.txt``: token id -> word, one a line), or None
    for a package without one."""
    if manifest.vocabulary_file is None:
        return None
    path = package_file(package, "vocabulary_file", manifest.vocabulary_file)
    names = path.read_text(encoding="utf-8").split("\n")
    if names and names[-1] == "":
        names.pop()
    return names


def check_hashes(package: str | Path, manifest: Manifest) -> None:
    package = Path(package)
    files = manifest.files
    for name in manifest.graphs.values():
        if name not in files:
            raise PackageError(f"manifest lists no sha256 for graph {name!r}")
    vocabulary = manifest.vocabulary_file
    if vocabulary is not None and vocabulary not in files:
        raise PackageError(f"manifest lists no sha256 for vocabulary_file {vocabulary!r}")
    if manifest.reference is not None and manifest.reference not in files:
        raise PackageError(f"manifest lists no sha256 for reference {manifest.reference!r}")
    for name, expected in files.items():
        if not isinstance(name, str) or not isinstance(expected, str):
            raise PackageError("manifest field 'files' must map file names to sha256 strings")
        if Path(name).name != name:
            raise PackageError(f"package file {name!r} is missing")
        path = package_file(package, f"files.{name}", name)
        actual = sha256(path)
        if actual != expected:
            raise PackageError(f"sha256 mismatch for {name!r}: manifest {expected[:12]}..., "
                               f"file {actual[:12]}...")


def session(path: str | Path, providers: list[str] | None = None,
            threads: int | None = None) -> ort.InferenceSession:
    """An onnxruntime session of the graph file PATH, loaded from its bytes: a graph that
    keeps its weights in external data files (which the manifest does not hash) does not
    load (PackageError), so every byte a session runs is a hashed file's. The exporter
    writes self-contained graphs; a package with external data was served, and a rewrite
    of that file later still passed verify_package (issue 59, finding 10)."""
    data = Path(path).read_bytes()
    try:
        return session_from_bytes(data, providers, threads)
    except Exception as error:  # onnxruntime refuses the bytes
        if "external" in str(error).lower():
            raise PackageError(f"{Path(path).name!r} keeps data in external files; a "
                               "package's graphs must be self-contained (every byte "
                               "hashed in the manifest)") from None
        raise


def session_from_bytes(model: str | bytes, providers: list[str] | None = None,
                       threads: int | None = None) -> ort.InferenceSession:
    """An onnxruntime session of a model file path or serialized bytes."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3  # errors reach the caller as exceptions
    if threads:
        options.intra_op_num_threads = threads
    return ort.InferenceSession(model, options, providers=providers or ["CPUExecutionProvider"])


def golden_check(package: str | Path, manifest: Manifest, sessions: dict | None = None) -> float:
    """Run every graph on its golden inputs (each case: ``GRAPH/...`` and
    ``GRAPH@CASE/...``, e.g. ``model@continued`` with an initial state); the largest
    deviation, or PackageError when an output differs from torch's by more than TOLERANCE
    (absolute + relative)."""
    package = Path(package)
    with np.load(package / "golden.npz", allow_pickle=False) as data:
        golden = {k: data[k] for k in data.files}
    prefixes = {k.split("/", 1)[0] for k in golden}
    worst = 0.0
    for graph, filename in manifest.graphs.items():
        sess = (sessions or {}).get(graph) or session(package / filename)
        for case in sorted(p for p in prefixes if p == graph or p.startswith(graph + "@")):
            feeds = {i.name: golden[f"{case}/{i.name}"] for i in sess.get_inputs()}
            # optional inputs (the initial state) where the case holds them
            feeds.update({i.name: golden[f"{case}/{i.name}"]
                          for i in sess.get_overridable_initializers()
                          if f"{case}/{i.name}" in golden})
            names = [o.name for o in sess.get_outputs()]
            for name, got in zip(names, sess.run(names, feeds), strict=True):
                expected = golden[f"{case}/{name}"]
                if got.shape != expected.shape:
                    raise PackageError(f"golden check failed: {case}/{name} has shape "
                                       f"{got.shape}, expected {expected.shape}")
                error = float(np.max(np.abs(got - expected) / (1 + np.abs(expected)),
                                     initial=0.0))
                worst = max(worst, error)
                if not error <= TOLERANCE:
                    raise PackageError(f"golden check failed: {case}/{name} differs from the "
                                       f"exported model's outputs by {error:.3g} "
                                       f"(> {TOLERANCE})")
    return worst


def verify_package(package: str | Path) -> Manifest:
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
