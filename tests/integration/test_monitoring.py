"""The chart's monitoring: the Grafana dashboard (dashboards.enabled) and the PrometheusRule
(rules.enabled), checked against a real Prometheus.

- The rendered manifests pass helm lint and kubernetes-validate (the PrometheusRule and the
  ServiceMonitor are CRDs: promtool checks the rule groups instead).
- `promtool check rules` on the rendered groups, and `promtool test rules` with
  tests/monitoring_rules_test.yaml: every alert has a case where it fires and one where it
  stays silent.
- A real `orthornn serve` under load (requests, overload, sessions in a real Redis that goes
  down and comes back, a promotion, a broken version; and the loop: capture on, with one
  version's folder broken so that its records are dropped, labels given back for captured
  digits, and the digits clients switched to inverted digits until drift is detected),
  scraped every second by a real
  Prometheus (Debian's `prometheus`) configured from the rendered ServiceMonitor (its
  target labels and relabelings) and loaded with the rendered rules. Then every dashboard
  variable's query and every panel's query, with the variables substituted (All, and one
  model, version and pod; the Loop row's panels at the digits model), returns data through
  Prometheus's query API, and so does every recording rule: a renamed metric or a wrong
  label fails here.

prometheus and promtool come from scripts/ci-debian.sh (`make test`'s tools step); where
they are missing the tests that need them skip with the reason. Each process is started on
a free loopback port and stopped by its PID (tests/cluster.py).
"""

from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
import yaml

from tests.cluster import RedisServer, Replica, free_port, require, stop_pid, wait_port
from tests.system.test_deploy import (
    CHART,
    KUBERNETES_VERSION,
    RELEASE,
    SECRETS,
    one,
    render,
    run,
    tool,
)

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs" / "deployment.md"
PROMTOOL_TESTS = Path(__file__).parents[1] / "monitoring_rules_test.yaml"
MONITORING = ("dashboards.enabled=true", "rules.enabled=true",
              "metrics.serviceMonitor.enabled=true")
SCRAPE_S = 1  # Prometheus's scrape and rule evaluation interval here
RATE_INTERVAL = f"{4 * SCRAPE_S}s"  # Grafana's $__rate_interval: 4 x the scrape interval
SEQ = [[0.5, 1.0], [0.25, 0.0], [0.1, 1.0]]  # one sequence of the "adding" model (d = 2)
LABELS_TOKEN = "monitoring-labels-token-0123456789"
#: Loop panels no live feature answers yet, by title, with why: the every-panel check
#: requires these to have NO data (so the entry must go once the feature lands) and every
#: other panel to have data. Empty: every panel answers.
NOT_YET_ANSWERED: dict[str, str] = {}


def digits(count: int, seed: int, inverted: bool = False) -> tuple[list, list[int]]:
    """COUNT of scikit-learn's 8x8 digits drawn at random (SEED), as the digits model reads
    them (T = 64, d = 1, scaled to [0, 1]; inverted: 1 - x, the drift the live check
    makes), and their classes."""
    import numpy as np
    from sklearn.datasets import load_digits

    bunch = load_digits()
    pick = np.random.default_rng(seed).integers(0, len(bunch.target), count)
    x = bunch.data[pick] / 16.0
    x = 1.0 - x if inverted else x
    return [[[float(v)] for v in row] for row in x], [int(c) for c in bunch.target[pick]]


# ------------------------------------------------------------------------------ rendering

def rule_spec(*sets: str) -> dict:
    return one(render(*MONITORING, *sets), "PrometheusRule")["spec"]


def dashboard(*sets: str) -> dict:
    config = one(render(*MONITORING, *sets), "ConfigMap", "-dashboard")
    (text,) = config["data"].values()
    return json.loads(text)


def alerts(spec: dict) -> dict[str, dict]:
    return {r["alert"]: r for g in spec["groups"] for r in g["rules"] if "alert" in r}


def records(spec: dict) -> dict[str, dict]:
    return {r["record"]: r for g in spec["groups"] for r in g["rules"] if "record" in r}


def panels(board: dict) -> list[dict]:
    return [p for p in board["panels"] if p["type"] != "row"]


def row_of(board: dict) -> dict[str, str]:
    """Each panel's title -> the title of the row it is under."""
    rows, row = {}, ""
    for p in board["panels"]:
        if p["type"] == "row":
            row = p["title"]
        else:
            rows[p["title"]] = row
    return rows


def test_monitoring_is_off_by_default():
    assert not [d for d in render() if d["kind"] == "PrometheusRule"
                or d["metadata"]["name"].endswith("-dashboard")]


def test_helm_lint_strict_with_monitoring():
    args = [tool("helm"), "lint", "--strict", str(CHART)]
    for item in (*SECRETS, *MONITORING, "autoscaling.enabled=true",
                 "autoscaling.queueComputeRatio.enabled=true"):
        args += ["--set", item]
    result = run(args)
    assert result.returncode == 0, result.stdout + result.stderr


def test_monitoring_manifests_pass_kubernetes_validate(tmp_path):
    validate = tool("kubernetes-validate")
    docs = render(*MONITORING)
    crds = {"ServiceMonitor", "PrometheusRule"}  # no Kubernetes schema: promtool checks rules
    assert {d["kind"] for d in docs} >= crds
    checked = [d for d in docs if d["kind"] not in crds]
    path = tmp_path / "monitoring.yaml"
    path.write_text(yaml.safe_dump_all(checked))
    result = run([validate, "--strict", "--kubernetes-version", KUBERNETES_VERSION, str(path)])
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("passed") == len(checked)
    rule = one(docs, "PrometheusRule")
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    assert rule["metadata"]["namespace"] == "ml"


def test_dashboard_configmap_for_the_grafana_sidecar():
    docs = render(*MONITORING, "dashboards.annotations.grafana_folder=ML")
    config = one(docs, "ConfigMap", "-dashboard")
    assert config["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert config["metadata"]["annotations"] == {"grafana_folder": "ML"}
    (name,) = config["data"]
    assert name.endswith(".json")
    board = json.loads(config["data"][name])
    assert "__ORTHORNN_" not in json.dumps({k: v for k, v in board.items() if k != "__comment"})
    assert board["title"] == f"orthornn (ml/{RELEASE}-orthornn)"
    assert len(board["uid"]) <= 40  # Grafana's limit
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert list(variables) == ["datasource", "selector", "model", "version", "pod"]
    assert variables["selector"]["query"] == 'namespace="ml",service="rel-orthornn"'
    for name in ("model", "version", "pod"):
        assert variables[name]["includeAll"] and variables[name]["allValue"] == ".*"
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids))
    for panel in panels(board):
        assert panel["description"] and panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert "$selector" in target["expr"], (panel["title"], target["expr"])
            assert target["datasource"]["uid"] == "${datasource}"
    # another selector reaches every query through the one constant
    custom = dashboard('metrics.selector=job="orthornn"')
    assert {v["name"]: v for v in custom["templating"]["list"]}["selector"]["query"] == \
        'job="orthornn"'


def test_service_monitor_keeps_the_route_label():
    """The operator's target label "endpoint" (the port name) would turn the metrics' own
    "endpoint" (the route) into "exported_endpoint": the ServiceMonitor drops it first."""
    (endpoint,) = one(render(*MONITORING, "metrics.serviceMonitor.relabelings[0].action=drop",
                             "metrics.serviceMonitor.relabelings[0].regex=x",
                             "metrics.serviceMonitor.relabelings[0].sourceLabels[0]=pod"),
                      "ServiceMonitor")["spec"]["endpoints"]
    assert endpoint["relabelings"] == [{"action": "labeldrop", "regex": "endpoint"},
                                       {"action": "drop", "regex": "x", "sourceLabels": ["pod"]}]


@pytest.mark.parametrize("queue_time", [False, True])
def test_hpa_scales_on_the_queue_compute_ratio(queue_time):
    docs = render("autoscaling.enabled=true", "autoscaling.queueComputeRatio.enabled=true",
                  f"autoscaling.queueTime.enabled={str(queue_time).lower()}")
    metrics = one(docs, "HorizontalPodAutoscaler")["spec"]["metrics"]
    assert [m["type"] for m in metrics] == ["Resource", *(["Pods"] * (1 + queue_time))]
    ratio = metrics[-1]["pods"]
    assert ratio == {"metric": {"name": "orthornn_queue_compute_ratio"},
                     "target": {"type": "AverageValue", "averageValue": "500m"}}
    if queue_time:
        assert metrics[1]["pods"]["metric"]["name"] == "orthornn_queue_duration_seconds_avg"
    # the recording rule the adapter serves under that name
    assert "orthornn:queue_compute_ratio:rate2m" in records(rule_spec())


def test_rule_thresholds_are_values():
    spec = rule_spec("rules.alerts.errorRatio.threshold=0.02",
                     "rules.alerts.latencyP99.thresholdSeconds=0.25",
                     "rules.alerts.queueComputeRatio.threshold=1.5",
                     "rules.alerts.queueComputeRatio.for=7m",
                     "rules.alerts.modelLoadFailures.window=30m",
                     "rules.alerts.promotedEvaluation.window=6h",
                     "rules.alerts.promotedEvaluation.tolerance=0.01",
                     "rules.alerts.noReadyReplica.severity=page",
                     "rules.alerts.driftDetected.for=30m",
                     "rules.alerts.captureDrops.threshold=0.5",
                     "rules.alerts.captureDrops.severity=page",
                     "rules.runbookUrl=https://docs.example.com/deployment/",
                     "rules.labels.release=kube-prometheus-stack")
    found = alerts(spec)
    assert found["OrthornnErrorRatioHigh"]["expr"].endswith("> 0.02")
    assert found["OrthornnLatencyP99High"]["expr"].endswith("> 0.25")
    assert found["OrthornnQueueSaturated"]["expr"].endswith("> 1.5")
    assert found["OrthornnQueueSaturated"]["for"] == "7m"
    assert "[30m]" in found["OrthornnModelLoadFailed"]["expr"]
    assert "offset 6h - 0.01" in found["OrthornnPromotedVersionWorse"]["expr"]
    assert found["OrthornnNoReadyReplica"]["labels"]["severity"] == "page"
    assert found["OrthornnDriftDetected"]["for"] == "30m"
    assert "for 30m" in found["OrthornnDriftDetected"]["annotations"]["description"]
    assert found["OrthornnCaptureDropping"]["expr"].endswith("[5m]) > 0.5")
    assert found["OrthornnCaptureDropping"]["labels"]["severity"] == "page"
    for name, rule in found.items():
        assert rule["annotations"]["runbook_url"] == \
            f"https://docs.example.com/deployment/#{name.lower()}"
    rule = one(render(*MONITORING, "rules.labels.release=kube-prometheus-stack"),
               "PrometheusRule")
    assert rule["metadata"]["labels"]["release"] == "kube-prometheus-stack"


def test_higher_is_better_matches_the_evaluation():
    """The alert's default direction of each metric is the evaluation's (export)."""
    from orthornn.export.builder.evaluation import HIGHER_IS_BETTER

    values = yaml.safe_load((CHART / "values.yaml").read_text())
    higher = values["rules"]["alerts"]["promotedEvaluation"]["higherIsBetter"]
    assert sorted(higher) == sorted(m for m, up in HIGHER_IS_BETTER.items() if up)


def test_bad_monitoring_values_fail_the_schema():
    for sets in (["rules.alerts.errorRatio.for=5 minutes"], ["metrics.selector=namespace=ml"],
                 ["rules.alerts.latencyP99.thresholdSeconds=-1"],
                 ["rules.alerts.captureDrops.threshold=-0.1"],
                 ["rules.alerts.driftDetected.for=ten minutes"]):
        args = [tool("helm"), "template", RELEASE, str(CHART)]
        for item in sets:
            args += ["--set", item]
        result = run(args)
        assert result.returncode != 0 and "schema" in result.stderr, (sets, result.stderr)


# ------------------------------------------------------------------------------ promtool

def write_rules(folder: Path, *sets: str) -> Path:
    path = folder / "rules.yaml"
    path.write_text(yaml.safe_dump(rule_spec(*sets), sort_keys=False))
    return path


def test_rules_pass_promtool_check(tmp_path):
    promtool = require("promtool")
    path = write_rules(tmp_path)
    result = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(alerts(rule_spec())) + len(records(rule_spec()))} rules found" \
        in result.stdout


def test_every_alert_fires_and_stays_silent_in_promtool_tests(tmp_path):
    promtool = require("promtool")
    write_rules(tmp_path)
    shutil.copy(PROMTOOL_TESTS, tmp_path / "tests.yaml")
    result = subprocess.run([promtool, "test", "rules", "tests.yaml"], cwd=tmp_path,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout
    # every alert of the chart has a case where it fires and one where it does not
    cases = [case for test in yaml.safe_load(PROMTOOL_TESTS.read_text())["tests"]
             for case in test.get("alert_rule_test", [])]
    for name in alerts(rule_spec()):
        mine = [c for c in cases if c["alertname"] == name]
        assert any(c["exp_alerts"] for c in mine), f"{name}: no case where it fires"
        assert any(not c["exp_alerts"] for c in mine), f"{name}: no case where it is silent"


# ------------------------------------------------------------------------------ the docs

def test_docs_describe_every_panel_and_alert():
    text = DOCS.read_text()
    for panel in panels(dashboard()):
        assert f"**{panel['title']}**" in text, f"docs/deployment.md: panel {panel['title']!r}"
    for name in alerts(rule_spec()):
        section = re.search(rf"^#### {name}\n(.*?)(?=^#|\Z)", text, flags=re.S | re.M)
        assert section, f"docs/deployment.md: no '#### {name}' section"
        assert "Runbook:" in section.group(1), f"{name}: no runbook line"
    for name in records(rule_spec()):
        assert f"`{name}`" in text, name


# ------------------------------------------------------------------------------ /metrics

def test_metrics_show_process_and_monitoring_series(service_packages, tmp_path):
    from fastapi.testclient import TestClient
    from orthornn.export.artifacts.repository import promote
    from orthornn.service.http.app import create_app
    from orthornn.service.settings import Settings

    from ..service_helpers import make_repo

    repo = make_repo(service_packages, tmp_path / "repo", {"adding": [1]})
    promote(repo / "adding", 1, "publish", "exported")
    app = create_app(Settings(repo=repo, poll_interval_s=0))
    with TestClient(app) as client:
        assert app.state.registry.scanned.wait(60) and app.state.registry.ready()
        assert client.post("/predict", json={"model": "adding", "inputs": [SEQ]}).status_code \
            == 200
        text = client.get("/metrics").text
    for line in ("orthornn_process_cpu_seconds_total ", "orthornn_process_resident_memory_bytes ",
                 "orthornn_held_connections_total 0.0",
                 'orthornn_model_loads_total{model="adding"} 1.0',
                 'orthornn_model_load_failures_total{model="adding"} 0.0',
                 'orthornn_model_promoted{model="adding",version="1"} 1.0',
                 'orthornn_request_duration_seconds_count{endpoint="/predict",model="adding"} 1.0'):
        assert line in text, line


# ------------------------------------------------------------------------------ live

class Prometheus:
    """A real prometheus on 127.0.0.1:PORT with CONFIG (a dict, written as prometheus.yml)
    and its data in WORKDIR; stopped by its PID."""

    def __init__(self, workdir: Path, config: dict):
        self.binary = require("prometheus")
        self.workdir = workdir
        self.port = free_port()
        self.config = workdir / "prometheus.yml"
        self.config.write_text(yaml.safe_dump(config, sort_keys=False))
        self.proc: subprocess.Popen | None = None
        self.url = f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> Prometheus:
        check = subprocess.run([require("promtool"), "check", "config", str(self.config)],
                               capture_output=True, text=True, timeout=60)
        assert check.returncode == 0, check.stdout + check.stderr
        self.log = open(self.workdir / "prometheus.log", "wb")
        self.proc = subprocess.Popen(
            [self.binary, f"--config.file={self.config}",
             f"--storage.tsdb.path={self.workdir / 'data'}",
             f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"],
            stdin=subprocess.DEVNULL, stdout=self.log, stderr=subprocess.STDOUT)
        wait_port(self.port, self.proc, timeout=30, what="prometheus")
        deadline = time.monotonic() + 30
        while httpx.get(self.url + "/-/ready", timeout=5).status_code != 200:
            assert time.monotonic() < deadline, "prometheus not ready"
            time.sleep(0.1)
        return self

    def __exit__(self, *exc) -> None:
        if self.proc is not None:
            stop_pid(self.proc, signal.SIGTERM)
        self.log.close()

    def api(self, path: str, **params) -> list | dict:
        r = httpx.get(f"{self.url}/api/v1/{path}", params=params, timeout=30)
        body = r.json()
        assert r.status_code == 200 and body["status"] == "success", (path, params, r.text)
        return body["data"]

    def query_range(self, expr: str, start: float, end: float) -> list[dict]:
        return self.api("query_range", query=expr, start=start, end=end,
                        step=f"{SCRAPE_S}s")["result"]

    def wait(self, expr: str, timeout: float = 20.0) -> None:
        """Until the instant query EXPR returns a sample."""
        deadline = time.monotonic() + timeout
        while not self.api("query", query=expr)["result"]:
            assert time.monotonic() < deadline, f"no data for {expr} within {timeout} s"
            time.sleep(0.2)


def scrape_config(docs: tuple[dict, ...], port: int, pod: str) -> dict:
    """The scrape job prometheus-operator makes of the rendered ServiceMonitor, for one pod
    at 127.0.0.1:PORT: the target labels the operator sets (namespace, service, pod,
    container, endpoint = the port name, job from jobLabel), then the ServiceMonitor's own
    relabelings, honorLabels and metricRelabelings."""
    monitor, service = one(docs, "ServiceMonitor"), one(docs, "Service", "-orthornn")
    (endpoint,) = monitor["spec"]["endpoints"]
    (container,) = one(docs, "Deployment")["spec"]["template"]["spec"]["containers"]

    def snake(rules: list[dict]) -> list[dict]:
        return [{re.sub(r"[A-Z]", lambda m: "_" + m.group(0).lower(), k): v
                 for k, v in rule.items()} for rule in rules]

    return {
        "job_name": f"serviceMonitor/ml/{monitor['metadata']['name']}/0",
        "scrape_interval": f"{SCRAPE_S}s", "scrape_timeout": f"{SCRAPE_S}s",
        "metrics_path": endpoint["path"], "honor_labels": endpoint["honorLabels"],
        "static_configs": [{"targets": [f"127.0.0.1:{port}"], "labels": {
            "namespace": "ml", "service": service["metadata"]["name"], "pod": pod,
            "container": container["name"], "endpoint": endpoint["port"],
            "job": service["metadata"]["labels"][monitor["spec"]["jobLabel"]]}}],
        "relabel_configs": snake(endpoint.get("relabelings", [])),
        "metric_relabel_configs": snake(endpoint.get("metricRelabelings", [])),
    }


def interpolate(expr: str, variables: dict[str, str]) -> str:
    """Grafana's substitution of $name and ${name} (KeyError: an undefined variable)."""
    return re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: variables[m.group(1) or m.group(2)], expr)


def grafana_escape(value: str) -> str:
    """A single value of a multi-value variable as Grafana's Prometheus data source writes
    it into a regex matcher: regex characters escaped, the backslash doubled for PromQL."""
    return re.sub(r"([\\^$*+?.()|{}\[\]'])", r"\\\\\1", value)


def label_values(prom: Prometheus, query: str, start: float, end: float) -> list[str]:
    """Grafana's label_values(SELECTOR, LABEL) variable query through the series API."""
    found = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", query)
    assert found, query
    data = prom.api(f"label/{found.group(2)}/values", **{"match[]": found.group(1)},
                    start=start, end=end)
    assert isinstance(data, list)
    return data


class Load:
    """Client threads, each on its own connection, posting to /predict until stopped."""

    def __init__(self, url: str, threads: int = 3):
        self.url, self.stop, self.answers = url, threading.Event(), []
        self.normal_digits = threading.Event()  # set: the clients also send (plain) digits
        self.normal_digits.set()
        self.threads = [threading.Thread(target=self._run, args=(k,), daemon=True)
                        for k in range(threads)]

    def _run(self, k: int) -> None:
        plain, _ = digits(1000, seed=k)
        with httpx.Client(base_url=self.url, timeout=30) as client:
            n = 0
            while not self.stop.is_set():
                r = client.post("/predict", json={"model": "adding", "inputs": [SEQ, SEQ[:2]]})
                self.answers.append(r.status_code)
                if self.normal_digits.is_set():
                    n = (n + 4) % len(plain)
                    r = client.post("/predict", json={"model": "digits",
                                                      "inputs": plain[n:n + 4]})
                    self.answers.append(r.status_code)
                client.post("/v2/models/adding/infer", json={"inputs": [
                    {"name": "x", "shape": [1, 3, 2], "datatype": "FP32",
                     "data": [x for step in SEQ for x in step]}]})

    def __enter__(self) -> Load:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=30)


def overload(url: str, clients: int = 24) -> list[int]:
    """CLIENTS requests at once, each on a connection of its own: over the in-flight limit
    some are refused (503) and their connections held."""
    statuses: list[int] = []
    barrier = threading.Barrier(clients)

    def one_request() -> None:
        with httpx.Client(base_url=url, timeout=30) as client:
            barrier.wait()
            statuses.append(client.post("/predict", json={"model": "adding",
                                                          "inputs": [SEQ] * 8}).status_code)
    threads = [threading.Thread(target=one_request) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    return statuses


def sessions(url: str, name: str, chunks: int = 3) -> list[int]:
    statuses = []
    with httpx.Client(base_url=url, timeout=30) as client:
        for i in range(chunks):
            flags = {"start": True} if i == 0 else {"end": True} if i == chunks - 1 else {}
            statuses.append(client.post("/predict", json={
                "model": "adding", "session": name, "inputs": [SEQ], **flags,
                "session_secret": f"{name}-client-secret-0123456789"}).status_code)
    return statuses


def metric_line(url: str, pattern: str) -> bool:
    return re.search(pattern, httpx.get(url + "/metrics", timeout=10).text, re.M) is not None


def wait_for(condition, timeout: float = 20.0, what="") -> None:
    """Until CONDITION() is true; past TIMEOUT, AssertionError naming WHAT (a string, or a
    callable describing the state at the deadline)."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, \
            f"not within {timeout} s: {what() if callable(what) else what}"
        time.sleep(0.1)


Check = Callable[[], str | None]  # None: passed; else what is missing


def data_checks(prom: Prometheus, start: float, pod: str) -> list[tuple[str, Check]]:
    """What must have data in PROM from START to now, named: each check answers None once
    it has, else what is missing (the range only grows: a check that passed stays passed).
    Every recording rule of the chart; the alert on load failures, firing for the broken
    version, the one on capture drops pending (or firing) for the broken capture folder
    and the one on drift for the inverted digits;
    every dashboard variable's query offering the chosen model, version and pod; every
    panel's query with the variables at All and at those values (the Loop row's at digits
    version 1, the model labels and drift are for), with a finite sample; the panels of
    NOT_YET_ANSWERED with no data at all."""
    checks: list[tuple[str, Check]] = []

    def has_data(expr: str, what: str) -> Check:
        return lambda: None if prom.query_range(expr, start, time.time()) else what

    for name in records(rule_spec()):  # every recording rule of the chart has data
        checks.append((f"recording rule {name}", has_data(name, "no data")))
    # the alert on load failures fired for the broken version
    checks.append(("OrthornnModelLoadFailed", has_data(
        'ALERTS{alertname="OrthornnModelLoadFailed",alertstate="firing",model="adding"}',
        "did not fire")))
    # the alert on capture drops went pending (for: 5m is longer than this test) for the
    # records of adding version 2, whose capture folder is broken
    checks.append(("OrthornnCaptureDropping", has_data(
        'ALERTS{alertname="OrthornnCaptureDropping",reason="error"}', "not pending")))
    # and the one on drift for digits version 1, once its inverted inputs were detected
    checks.append(("OrthornnDriftDetected", has_data(
        'ALERTS{alertname="OrthornnDriftDetected",model="digits",version="1"}',
        "not pending")))

    board = dashboard()
    variables = {v["name"]: v for v in board["templating"]["list"]}
    selector = variables["selector"]["query"]
    chosen = {"model": "adding", "version": "2", "pod": pod}
    loop = {"model": "digits", "version": "1", "pod": pod}  # the Loop row's selection
    rows = row_of(board)

    def offers(name: str, value: str) -> Check:
        query = interpolate(variables[name]["query"]["query"],
                            {"selector": selector, "model": "adding", "pod": ".*"})

        def check() -> str | None:
            offered = label_values(prom, query, start, time.time())
            return None if value in offered else f"{query} offers {offered}, not {value}"
        return check

    for name, value in chosen.items():  # each variable's query offers the value
        checks.append((f"variable {name}", offers(name, value)))

    def finite(expr: str) -> Check:
        def check() -> str | None:
            result = prom.query_range(expr, start, time.time())
            if any(v not in ("NaN", "+Inf", "-Inf") for s in result for _, v in s["values"]):
                return None
            return f"{'only NaN' if result else 'no data'}: {expr}"
        return check

    def empty(expr: str, why: str) -> Check:  # a panel NOT_YET_ANSWERED says has no data
        def check() -> str | None:
            if prom.query_range(expr, start, time.time()):
                return f"answers now (remove it from NOT_YET_ANSWERED: {why!r}): {expr}"
            return None
        return check

    assert set(NOT_YET_ANSWERED) <= {p["title"] for p in panels(board)}, NOT_YET_ANSWERED
    for selection in ("All", "one"):
        for panel in panels(board):
            values = chosen if rows[panel["title"]] != "Loop" else loop
            values = ({k: grafana_escape(v) for k, v in values.items()} if selection == "one"
                      else dict.fromkeys(values, ".*"))
            substitutions = {"selector": selector, "__rate_interval": RATE_INTERVAL, **values}
            for target in panel["targets"]:
                expr = interpolate(target["expr"], substitutions)
                why = NOT_YET_ANSWERED.get(panel["title"])
                checks.append((f"{selection}: {panel['title']} [{target['legendFormat']}]",
                               finite(expr) if why is None else empty(expr, why)))
    return checks


def give_labels(url: str, prom: Prometheus, count: int = 20) -> None:
    """COUNT digits, each a request of its own with an X-Request-Id, then their true
    classes as labels, in two halves (the second after Prometheus saw the first, so that
    the rate moves)."""
    plain, classes = digits(count, seed=100)
    auth = {"Authorization": f"Bearer {LABELS_TOKEN}"}
    with httpx.Client(base_url=url, timeout=30) as client:
        for i, sequence in enumerate(plain):
            r = client.post("/predict", json={"model": "digits", "inputs": [sequence]},
                            headers={"X-Request-Id": f"monitoring-{i}"})
            assert r.status_code == 200, r.text
        half = count // 2
        for part, scraped in ((range(half), "> 0"), (range(half, count), f"== {count}")):
            r = client.post("/v2/models/digits/labels", headers=auth, json=[
                {"id": f"monitoring-{i}", "label": classes[i]} for i in part])
            assert r.status_code == 200, r.text
            assert r.json()["accepted"] == len(part), r.text
            prom.wait(f'orthornn_labels_received_total{{model="digits"}} {scraped}')


DIGITS_1 = r'\{(?=[^}]*model="digits")(?=[^}]*version="1")[^}]*\}'


def drift(url: str, load: Load, timeout: float = 60.0) -> None:
    """The digits clients switch to inverted digits: plain digits until a window has been
    tested (orthornn_drift_score), then inverted ones until the drift is detected."""
    load.normal_digits.clear()
    plain, _ = digits(400, seed=200)
    inverted, _ = digits(400, seed=300, inverted=True)
    with httpx.Client(base_url=url, timeout=30) as client:
        # digits version 1's series, whatever the order of the labels
        for batch, pattern in ((plain, rf"^orthornn_drift_score{DIGITS_1}"),
                               (inverted, rf"^orthornn_drift_detected{DIGITS_1} 1")):
            deadline, n = time.monotonic() + timeout, 0
            while not metric_line(url, pattern):
                assert time.monotonic() < deadline, f"not within {timeout} s: {pattern}"
                for _ in range(5):  # 40 sequences, then look again
                    r = client.post("/predict", json={"model": "digits",
                                                      "inputs": batch[n:n + 8]})
                    assert r.status_code == 200, r.text
                    n = (n + 8) % len(batch)


def test_every_panel_and_recording_rule_returns_data_from_a_real_prometheus(
        service_packages, tmp_path):
    require("prometheus")
    require("promtool")
    from orthornn.export.artifacts.repository import promote

    from ..service_helpers import make_repo, publish_copy
    from .test_service_promotion import break_model, set_manifest

    # the repository: adding 1 (promoted) and 2, each with its test score, and digits 1 (a
    # classifier: labels and drift)
    repo = make_repo(service_packages, tmp_path / "repo", {"adding": [1, 2], "digits": [1]})
    model_dir = repo / "adding"
    for version, mse in ((1, 0.05), (2, 0.04)):
        set_manifest(model_dir / str(version), evaluation={
            "metric": "mse", "value": mse, "higher_is_better": False, "split": "test",
            "examples": 512, "data_fingerprint": "ab" * 32})
    promote(model_dir, 1, "publish", "exported")

    # capture on, every request; adding version 2's folder is a file, so once version 2
    # serves, its records are dropped (reason "error") while the others are written
    capture = tmp_path / "capture"
    (capture / "adding").mkdir(parents=True)
    (capture / "adding" / "2").write_text("a file where capture makes a folder\n")

    docs = render(*MONITORING)
    pod = f"{RELEASE}-orthornn-0"
    with RedisServer(tmp_path / "redis") as redis, \
            Replica(repo, env={"ORTHORNN_SESSION_STORE": redis.url,
                               "ORTHORNN_MAX_INFLIGHT_REQUESTS": "4",
                               "ORTHORNN_KEEP_VERSIONS": "2",
                               "ORTHORNN_POLL_INTERVAL_S": "0.2",
                               "ORTHORNN_LABELS_TOKEN": LABELS_TOKEN},
                    args=["--capture", str(capture), "--capture-sample", "1"]) as server:
        config = {"global": {"scrape_interval": f"{SCRAPE_S}s",
                             "evaluation_interval": f"{SCRAPE_S}s"},
                  "rule_files": [str(write_rules(tmp_path))],
                  "scrape_configs": [scrape_config(docs, server.port, pod)]}
        with Prometheus(tmp_path, config) as prom:
            start = time.time()
            prom.wait(f'up{{pod="{pod}"}} == 1')
            with Load(server.url) as load:
                # overload: refused (503) and held connections
                statuses = overload(server.url)
                assert 503 in statuses and 200 in statuses, statuses
                assert metric_line(server.url, r"^orthornn_held_connections_total [1-9]")
                # sessions in the Redis store
                assert sessions(server.url, "a") == [200, 200, 200]
                # a promotion: version 2 serves
                promote(model_dir, 2, "promote", "better test score")
                wait_for(lambda: metric_line(server.url, r'^orthornn_model_promotions_total\{'
                                             r'action="promote",model="adding"\} 1'),
                         what="the promotion counted")
                # a broken version 3: refused
                broken = tmp_path / "broken"
                shutil.copytree(service_packages / "adding" / "3", broken)
                break_model(broken)
                publish_copy(broken, model_dir, 3)
                wait_for(lambda: metric_line(server.url, r'^orthornn_model_load_failures_total'
                                             r'\{model="adding"\} 1'),
                         what="the broken version refused")
                # the session store down, then back
                redis.stop()
                assert 503 in sessions(server.url, "b", chunks=1)
                wait_for(lambda: metric_line(server.url, r"^orthornn_session_store_up 0"),
                         what="the store seen down")
                prom.wait(f'orthornn_session_store_up{{pod="{pod}"}} == 0')
                redis.start()
                wait_for(lambda: metric_line(server.url, r"^orthornn_session_store_up 1"),
                         what="the store seen up again")
                assert sessions(server.url, "c") == [200, 200, 200]
                # version 2 of adding serves and its records are dropped; digits are written
                wait_for(lambda: metric_line(server.url, r'^orthornn_capture_dropped_total'
                                             r'\{reason="error"\} [1-9]'),
                         what="version 2's records dropped")
                wait_for(lambda: metric_line(server.url, r'^orthornn_capture_records_total'
                                             r'\{model="digits"\} [1-9]'),
                         what="digits' records written")
                give_labels(server.url, prom)
                drift(server.url, load)
                # every check below polled under load until it passes: each new series
                # scraped a few times (a rate needs two samples in its window) and the
                # rules evaluated on the last state, however slowly Prometheus gets there
                pending = {k: (name, check, "not run") for k, (name, check)
                           in enumerate(data_checks(prom, start, pod))}

                def passed() -> bool:  # runs the checks that have not passed yet
                    for k, (name, check, _) in list(pending.items()):
                        missing = check()
                        if missing is None:
                            del pending[k]
                        else:
                            pending[k] = (name, check, missing)
                    return not pending

                wait_for(passed, timeout=90, what=lambda: "\n".join(
                    f"{name}: {missing}" for name, _, missing in pending.values()))
            assert load.answers and set(load.answers) <= {200, 503}, set(load.answers)
