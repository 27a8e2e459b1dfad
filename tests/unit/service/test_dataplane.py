"""The dataplane without HTTP: typed requests in (``dataplane.messages``), typed results
out, on a registry of real packages; every answer checked against onnxruntime run directly
on the package (tests/service_helpers.reference) and numpy's own softmax."""

import asyncio
from collections.abc import AsyncIterator, Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from typing import Any

import numpy as np
import pytest
from orthornn.service import request
from orthornn.service.dataplane.dataplane import DataPlane
from orthornn.service.dataplane.messages import Inference, InputTensor, Prediction
from orthornn.service.dataplane.schemas import RequestOutput
from orthornn.service.errors import ClientError, NotFound
from orthornn.service.metrics import Metrics
from orthornn.service.registry.batching import Batching
from orthornn.service.registry.registry import Registry
from orthornn.service.settings import Settings

from ...service_helpers import make_repo, reference


@pytest.fixture(scope="module")
def repo(service_packages, tmp_path_factory):
    return make_repo(service_packages, tmp_path_factory.mktemp("dataplane-repo"),
                     {"adding": [4], "digits": [1], "words": [1]})


@asynccontextmanager
async def dataplane(repo) -> AsyncIterator[DataPlane]:
    """A DataPlane over a registry of REPO, as create_app assembles it, without the app."""
    settings = Settings(repo=repo, poll_interval_s=0)
    metrics = Metrics()
    executor = ThreadPoolExecutor(1)
    batching = Batching(settings, metrics, executor)
    registry = Registry(settings, metrics, ["CPUExecutionProvider"],
                        on_load=batching.attach, on_release=batching.close)
    plane = DataPlane(settings, registry, metrics)
    registry.start(asyncio.get_running_loop())
    try:
        assert await asyncio.to_thread(registry.scanned.wait, 60) and registry.ready()
        yield plane
    finally:
        await plane.sessions.close()
        await plane.shadows.close()
        await registry.close()
        executor.shutdown()


def run(repo, body: Callable[[DataPlane], Coroutine[Any, Any, None]]) -> None:
    async def main() -> None:
        async with dataplane(repo) as plane:
            await body(plane)
    asyncio.run(main())


def softmax(z: np.ndarray) -> np.ndarray:
    e = np.exp(z - z.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def test_predict_classify_and_the_request_scope(repo):
    rng = np.random.default_rng(0)
    seqs = [rng.normal(size=(n, 1)).astype(np.float32) for n in (5, 12, 3)]

    async def body(plane: DataPlane) -> None:
        with request.opened() as scope:
            result = await plane.predict(Prediction("digits", inputs=seqs, top_k=2))
        assert (result.served.model, result.served.version) == ("digits", 1)
        assert (scope.model, scope.version) == ("digits", 1)  # written where it was leased
        assert scope.compute_s is not None and scope.compute_s > 0
        assert scope.route_key == b""  # no version named: the service placed it
        expected = [softmax(r["logits"].astype(np.float64))
                    for r in reference(repo / "digits" / "1", seqs)]
        for out, p in zip(result.outputs, expected, strict=True):
            np.testing.assert_allclose(out["probabilities"], p, atol=1e-6)
            assert out["index"] == int(np.argmax(p))
            assert [c["index"] for c in out["top_k"]] == list(np.argsort(-p)[:2])
        with request.opened() as scope, pytest.raises(NotFound) as missing:
            await plane.predict(Prediction("nope", inputs=seqs))
        assert missing.value.status == 404 and scope.model is None
    run(repo, body)


def test_predict_language_model_scores_as_numpy_does(repo):
    async def body(plane: DataPlane) -> None:
        tokens = [np.array([2, 5, 7, 3, 9], np.int64)]
        result = await plane.predict(Prediction("words", inputs=tokens, top_k=3))
        (ref,) = reference(repo / "words" / "1", tokens)
        logp = np.log(softmax(ref["logits"].astype(np.float64)))
        expected = sum(logp[t, tokens[0][t + 1]] for t in range(4))
        (out,) = result.outputs
        assert out["log_likelihood"] == pytest.approx(expected, abs=1e-5)
        assert out["tokens"] == 4
        assert out["perplexity"] == pytest.approx(np.exp(-expected / 4), rel=1e-5)
        unk = plane.registry.get("words").spec.unk_id  # never listed (allow_unk off)
        ranked = [j for j in np.argsort(-logp[-1], kind="stable") if j != unk]
        assert [t["id"] for t in out["next_tokens"]] == ranked[:3]
    run(repo, body)


def test_infer_returns_every_output_tensor_as_onnxruntime_does(repo):
    x = np.linspace(-1, 1, 6, dtype=np.float32)

    async def body(plane: DataPlane) -> None:
        req = Inference([InputTensor("x", "FP32", (2, 3, 1), x)], id="r1")
        with request.opened() as scope:
            result = await plane.infer(req, "digits", "1")
        assert (scope.model, scope.version, scope.route_key) == ("digits", 1, None)
        assert result.id == "r1"
        ref = reference(repo / "digits" / "1", list(x.reshape(2, 3, 1)))
        tensors = {t.name: t.data for t in result.outputs}
        np.testing.assert_allclose(tensors["logits"], np.stack([r["logits"] for r in ref]),
                                   atol=1e-6)
        with pytest.raises(ClientError, match="outputs: unknown output 'nope'"):
            await plane.infer(Inference([InputTensor("x", "FP32", (1, 3, 1), x[:3])],
                                        outputs=[RequestOutput(name="nope")]), "digits", None)
    run(repo, body)


def test_a_session_in_chunks_answers_as_the_whole_sequence(repo):
    seq = np.random.default_rng(1).uniform(0, 1, size=(6, 2)).astype(np.float32)

    async def body(plane: DataPlane) -> None:
        first = await plane.predict(Prediction("adding", inputs=[seq[:2]], session="s",
                                               start=True))
        assert first.position == 2 and first.session_secret
        last = await plane.predict(Prediction("adding", inputs=[seq[2:]], session="s",
                                              end=True, session_secret=first.session_secret))
        assert last.position == 6
        (whole,) = reference(repo / "adding" / "4", [seq])
        assert last.outputs[0]["value"] == pytest.approx(float(whole["value"][0]), abs=1e-5)
        with pytest.raises(NotFound):  # ended: no longer open
            await plane.predict(Prediction("adding", inputs=[seq[:1]], session="s",
                                           session_secret=first.session_secret))
    run(repo, body)
