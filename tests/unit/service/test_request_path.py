"""The path of one stateless request through the service's modules, recorded with
``sys.setprofile``/``threading.setprofile`` (every Python function entered, in every thread
of the server, the product's own uvicorn server on a loopback port): the lean path into
the route's handler (``service.server.lean``, then the dispatcher), at most six module
hops from the handler to onnxruntime, and none upward through the layers import-linter
keeps (pyproject.toml): a callback that a lower layer runs into a higher one's code would
show as an upward hop."""

import itertools
import sys
import threading
import tomllib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import orthornn.service
import pytest

from ...service_helpers import LiveServer, make_repo

ROOT = Path(orthornn.service.__file__).resolve().parent.parent  # the stage folders
HANDLER = "service.http.routes"  # where a request's own path starts (its route's handler)
LEAN = ("service.server.lean", "service.http.routing")  # the modules that call it


def _layers() -> dict[str, int]:
    """Each service folder or module's rank in the layer contract, the top highest."""
    with open(ROOT / "pyproject.toml", "rb") as f:
        contracts = tomllib.load(f)["tool"]["importlinter"]["contracts"]
    (layers,) = [c["layers"] for c in contracts if c.get("containers") == ["orthornn.service"]]
    return {name.strip(): len(layers) - i for i, layer in enumerate(layers)
            for name in layer.split("|")}


LAYERS = _layers()


def rank(module: str) -> int:
    """MODULE's layer (the stages below the service, export and models: 0)."""
    parts = module.split(".")
    return LAYERS[parts[1]] if parts[0] == "service" else 0


def module_of(filename: str) -> str | None:
    """The project module a code object belongs to (None: a library's, or a test's)."""
    path = Path(filename)
    if not path.is_absolute() or ROOT not in path.parents:
        return None
    parts = path.relative_to(ROOT).with_suffix("").parts
    if parts[0] not in ("service", "export", "models") or "site-packages" in parts:
        return None
    return ".".join(parts)


class Recorder:
    """Per function entered in the server's threads: the chain of project modules on its
    stack (library frames skipped, a module calling itself counted once)."""

    def __init__(self) -> None:
        self.on = False
        self.chains: list[tuple[str, ...]] = []

    def __call__(self, frame, event, arg) -> None:
        if not self.on or event != "call":
            return
        if module_of(frame.f_code.co_filename) is None:
            return
        chain: list[str] = []
        f = frame
        while f is not None:
            module = module_of(f.f_code.co_filename)
            if module is not None and (not chain or chain[-1] != module):
                chain.append(module)
            f = f.f_back
        self.chains.append(tuple(reversed(chain)))


@contextmanager
def recording() -> Iterator[Recorder]:
    recorder = Recorder()
    threading.setprofile(recorder)  # the threads the app starts from now on
    sys.setprofile(recorder)
    try:
        yield recorder
    finally:
        sys.setprofile(None)
        threading.setprofile(None)  # type: ignore[arg-type]


def request_chains(chains: list[tuple[str, ...]]) -> list[tuple[str, ...]]:
    """The chains from the handler down, and those a thread or a callback of the event loop
    starts in a module the handler's chains entered (the batcher's inference thread):
    joined below that module, as the request's path goes on there."""
    own = [c[c.index(HANDLER):] for c in chains if HANDLER in c]
    depth: dict[str, tuple[str, ...]] = {}
    for c in own:
        for i, module in enumerate(c):
            if module not in depth or len(depth[module]) > i + 1:
                depth[module] = c[:i + 1]
    joined = [depth[c[0]] + c[1:] for c in chains if HANDLER not in c and c[0] in depth]
    return own + joined


@pytest.fixture(scope="module")
def repo(service_packages, tmp_path_factory):
    return make_repo(service_packages, tmp_path_factory.mktemp("path-repo"),
                     {"digits": [1], "words": [1]})


@pytest.mark.parametrize("route, body", [
    ("/predict", {"model": "digits", "inputs": [[0.1, 0.2, 0.3]], "top_k": 2}),
    ("/predict", {"model": "words", "text": ["the cat sat on the mat"], "top_k": 3}),
    ("/v2/models/digits/infer", {"inputs": [{"name": "x", "shape": [1, 3, 1],
                                              "datatype": "FP32", "data": [0.1, 0.2, 0.3]}]}),
])
def test_a_stateless_request_takes_at_most_six_hops_and_none_upward(repo, route, body):
    with recording() as recorder, \
            LiveServer(repo=repo, poll_interval_s=0, inference_workers=1) as live, \
            httpx.Client(base_url=live.url, timeout=30) as c:
        assert c.post(route, json=body).status_code == 200  # warm: first-call caches
        recorder.on = True
        answer = c.post(route, json=body)
        recorder.on = False
    assert answer.status_code == 200, answer.text
    # into the handler by the lean path: no other module of the project's before it
    entries = {c[:c.index(HANDLER)] for c in recorder.chains if HANDLER in c}
    assert entries == {LEAN}, entries
    chains = request_chains(recorder.chains)
    # the path to onnxruntime, module by module, all downward
    (path,) = {c[:c.index("service.registry.runtime") + 1] for c in chains
               if "service.registry.runtime" in c}
    assert path == (HANDLER, "service.dataplane.dataplane", "service.registry.catalog",
                    "service.registry.batcher", "service.registry.runtime")
    assert max(len(c) - 1 for c in chains) <= 6, max(chains, key=len)
    upward = {(a, b) for c in chains for a, b in itertools.pairwise(c)
              if rank(b) > rank(a)}
    assert not upward, upward
