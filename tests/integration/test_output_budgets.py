"""What one request, and all of them together, may make the service hold (issue 59,
findings 1 and 3, the parts left after the first replays): the default body limit
follows the loaded models' largest request, OIP JSON answers count their outputs as
written (17 bytes a value, not 4), and the per-step outputs of the answers being made are
bounded over all requests (``max_output_bytes_in_flight``). Against real servers on
loopback."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import orjson
import pytest
from orthornn.service.dataplane.checks import JSON_VALUE_BYTES
from orthornn.service.settings import MAX_BODY_BYTES, MIN_BODY_BYTES, Settings

from ..service_helpers import LiveServer, make_repo


@pytest.fixture(scope="module")
def repo(service_packages, tmp_path_factory):
    return make_repo(service_packages, tmp_path_factory.mktemp("budgets"),
                     {"digits": [1], "words": [1]})


def _infer(tokens: np.ndarray, binary: bool = False) -> dict:
    body: dict = {"inputs": [{"name": "tokens", "shape": list(tokens.shape),
                              "datatype": "INT64", "data": tokens.reshape(-1).tolist()}]}
    if binary:
        body["parameters"] = {"binary_data_output": True}
    return body


# -- the body limit ------------------------------------------------------------------------

def test_the_default_body_limit_is_bounded_and_an_explicit_one_wins(tmp_path):
    settings = Settings(repo=tmp_path)
    assert settings.body_limit(0) == MIN_BODY_BYTES == 4 << 20
    assert settings.body_limit(10 << 20) == 10 << 20
    assert settings.body_limit(1 << 40) == MAX_BODY_BYTES == 16 << 20
    assert Settings(repo=tmp_path, max_body_bytes=5000).body_limit(1 << 40) == 5000
    assert settings.body_timeout() == 256  # the ceiling at 64 KiB/s, as before


def test_the_default_body_limit_follows_the_loaded_models(service_packages, tmp_path):
    """A small classifier's largest request, every number written as long as JSON allows,
    is answered; a body past the derived limit gets 413 naming it, where the fixed 16 MiB
    took it; a model with longer requests raises the limit."""
    repo = make_repo(service_packages, tmp_path, {"digits": [1]})
    with LiveServer(repo=repo) as live, \
            httpx.Client(base_url=live.url, timeout=60) as http:
        spec = live.app.state.registry.get("digits").spec
        sequences = live.settings.max_request_sequences
        longest = "-1.2345678901234567e-308"  # a float64 as long as it gets
        row = "[" + ", ".join([longest] * spec.feature_size) + "]"
        one = "[" + ", ".join([row] * spec.max_length) + "]"
        body = ('{"model": "digits", "inputs": [' + ", ".join([one] * sequences)
                + "]}").encode()
        assert len(body) <= spec.largest_body(sequences)
        limit = live.settings.body_limit(live.app.state.registry.catalog.largest_body)
        assert len(body) <= limit < 16 << 20
        # (its numbers are far outside the training range: answered, with a warning)
        assert http.post("/predict", content=body,
                         headers={"Content-Type": "application/json"}).status_code == 200
        over = http.post("/predict", content=b" " * (limit + 1),
                         headers={"Content-Type": "application/json"})
        assert over.status_code == 413
        assert f"limit of {limit} bytes (max_body_bytes)" in over.json()["error"]
        # a language model, whose text requests are longer, published: it raises the limit
        make_repo(service_packages, repo, {"words": [1]})
        live.wait(lambda: live.app.state.registry.model_ready("words"))
        words = live.app.state.registry.get("words").spec
        raised = live.settings.body_limit(live.app.state.registry.catalog.largest_body)
        assert raised > limit and raised >= min(words.largest_body(sequences), 16 << 20)
        assert http.post("/predict", content=b" " * (limit + 1),
                         headers={"Content-Type": "application/json"}).status_code == 400


# -- output budgets --------------------------------------------------------------------------

def test_json_value_bytes_bound_every_float32_as_the_answer_writes_it():
    """JSON_VALUE_BYTES against orjson, the encoder of the answers: the longest float32
    forms (the smallest normal, denormals, the largest, long decimals) and random values
    over every exponent, each with its comma (over every 97th negative float32 bit
    pattern, 22 million values, the longest is 16 characters: "-0.0000010000131")."""
    rng = np.random.default_rng(0)
    values = np.concatenate([
        np.array([-1.17549435e-38, -1.4e-45, -3.4028235e38, -1.0000131e-6, -0.12345679,
                  np.nextafter(np.float32(-1e-38), np.float32(0))], dtype=np.float32),
        (rng.standard_normal(20_000) * 10.0 ** rng.integers(-45, 38, 20_000)
         ).astype(np.float32)])
    values = values[np.isfinite(values)]
    written = orjson.dumps(values, option=orjson.OPT_SERIALIZE_NUMPY)[1:-1].split(b",")
    assert len(written) == len(values)
    assert max(len(w) + 1 for w in written) <= JSON_VALUE_BYTES
    np.testing.assert_array_equal(np.array([float(w) for w in written], np.float32),
                                  values)


def test_oip_json_answers_count_their_outputs_as_written(repo):
    """A 39 MiB output tensor went back as 110 MiB of JSON while the budget counted 4
    bytes a value: an answer within the budget as float32 but not as JSON is refused
    (413 saying so), the same as binary data is answered, and a JSON answer within the
    budget is no longer than it counted."""
    with LiveServer(repo=repo) as live, httpx.Client(base_url=live.url, timeout=60) as http:
        spec = live.app.state.registry.get("words").spec
        tokens = np.ones((4, 32), dtype=np.int64)
        float32 = tokens.size * spec.output_size * 4
        live.settings.max_lm_output_bytes = 2 * float32  # within as float32, not as JSON
        url = "/v2/models/words/infer"
        refused = http.post(url, json=_infer(tokens))
        assert refused.status_code == 413
        error = refused.json()["error"]
        assert f"{float32 // 4 * JSON_VALUE_BYTES} bytes" in error and "as JSON" in error
        assert http.post(url, json=_infer(tokens, binary=True)).status_code == 200
        counted = float32 // 4 * JSON_VALUE_BYTES
        live.settings.max_lm_output_bytes = counted
        answer = http.post(url, json=_infer(tokens))
        assert answer.status_code == 200
        written = orjson.loads(answer.content)
        (logits,) = [o for o in written["outputs"] if o["name"] == "logits"]
        assert len(orjson.dumps(logits["data"])) <= counted


def test_answers_being_made_are_bounded_over_all_requests(repo):
    """Issue 59, finding 3: 16 concurrent requests, each within max_lm_output_bytes, held
    3.9 GiB together. With max_output_bytes_in_flight one and a half requests' worth, the
    requests that arrive while one waits for its batch get 503 with Retry-After naming
    the setting, the one waiting is answered, and once the answers are built the budget
    is whole again. The six start together, each connected already (a barrier), so the
    others arrive while the first holds the budget however slow the machine is (each
    opening its own connection as it went, on a loaded CI machine all six once came one
    after another, all answered)."""
    with LiveServer(repo=repo, max_queue_delay_ms=400) as live, \
            httpx.Client(base_url=live.url, timeout=60) as http:
        spec = live.app.state.registry.get("words").spec
        tokens = np.ones((2, 64), dtype=np.int64).tolist()
        size = 2 * 64 * spec.output_size * 4
        live.app.state.dataplane.outputs.limit = size * 3 // 2
        request = {"model": "words", "inputs": tokens}
        together = threading.Barrier(6)

        def post(_: int) -> httpx.Response:
            with httpx.Client(base_url=live.url, timeout=60) as client:
                client.get("/v2/health/live")  # connected before the barrier
                together.wait()
                return client.post("/predict", json=request)
        with ThreadPoolExecutor(6) as pool:
            answers = list(pool.map(post, range(6)))
        statuses = sorted(a.status_code for a in answers)
        assert 200 in statuses and 503 in statuses and set(statuses) <= {200, 503}, statuses
        for refused in (a for a in answers if a.status_code == 503):
            assert refused.headers["retry-after"] == "1"
            assert "max_output_bytes_in_flight" in refused.json()["error"]
        assert live.app.state.dataplane.outputs.held == 0
        assert http.post("/predict", json=request).status_code == 200
        # an error after the budget was taken gives it back too
        bad = http.post("/predict", json={**request, "per_step": True})
        assert bad.status_code == 400 and "per_step" in bad.json()["error"]
        assert live.app.state.dataplane.outputs.held == 0
