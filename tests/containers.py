"""The container images for the tests: built by scripts/images.sh (what `make images` runs),
and run the way the Helm chart's pods run them.

Kubernetes is not here, and podman's `kube play` needs an infra (pause) container, which
podman 4.3 builds only from catatonit (a package recommended, not required, by Debian's
podman) or else pulls from a registry, and a pod network (CNI plugins); so a rendered pod's
container becomes `podman run` flags in one place, `run_flags` (tested in
tests/system/test_images.py against the rendered chart): its command and args, its env (literal,
from the rendered ConfigMap and Secret), its user and group, a read-only root, dropped
capabilities, no privilege escalation, emptyDir volumes as tmpfs and the other volumes bound
from host folders (read-only where the pod mounts them so). The network is the host's
(`--network host`), and the chart is rendered with a free loopback port as containerPort.

The build starts when the session collects a container test (conftest.py), or earlier when
make test started it (tests/background.py), and runs beside the other tests; `images()`
waits for it. Where no engine can run, the tests skip with the
reason scripts/images.sh gives (a failure under CI_TOOLS_STRICT=1).
"""

from __future__ import annotations

import base64
import functools
import os
import re
import shutil
import subprocess
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path

from .background import SHARED, Job

ROOT = Path(__file__).resolve().parents[1]
VERSION = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
SERVE_IMAGE = f"orthornn:{VERSION}-cpu"
TRAIN_IMAGE = f"orthornn-train:{VERSION}-cpu"
#: the build's job name (tests/background.Job): its log is FOLDER/images.log
BUILD = "images"
_build: Job | None = None
_owned = False  # started by this session (not adopted): stopped at its end


@functools.cache
def engine() -> str | None:
    """ENGINE when set, else docker where its engine runs, else podman (as
    scripts/images.sh picks)."""
    if os.environ.get("ENGINE"):
        return os.environ["ENGINE"]
    if shutil.which("docker") and subprocess.run(["docker", "info"], capture_output=True,
                                                 timeout=30).returncode == 0:
        return "docker"
    return "podman" if shutil.which("podman") else None


def engine_env() -> dict[str, str]:
    return {**os.environ,
            "CONTAINERS_CONF": os.environ.get("CONTAINERS_CONF",
                                              str(ROOT / "scripts" / "containers.conf"))}


def build_job(folder: Path) -> Job:
    """scripts/images.sh --or-skip as a detached job in FOLDER, at the lowest CPU
    priority: the tests beside it that time replicas and load balancers come first."""
    return Job.start(folder, BUILD, ["bash", str(ROOT / "scripts" / "images.sh"),
                                     "--or-skip"], env=engine_env(), nice=True)


def start_build() -> None:
    """The images' build: make test's when it started one (``ORTHORNN_BACKGROUND``),
    else started now (once a session) in build/."""
    global _build, _owned
    if _build is not None:
        return
    shared = os.environ.get(SHARED)
    _build = Job.adopt(Path(shared), BUILD) if shared else None
    if _build is None:
        _build, _owned = build_job(ROOT / "build"), True


def stop_build() -> None:
    """End a build this session started, still running when it ends (-x, Ctrl-C, a
    timeout); an adopted one is its starter's (another worker may still wait for it)."""
    if _build is not None and _owned:
        _build.stop()


def images() -> str:
    """The engine, once both images are built; skips with the reason where they
    cannot be (no engine, no root), fails where the build failed."""
    import pytest

    from .artifacts import skip_or_fail

    start_build()
    assert _build is not None
    code = _build.wait(timeout=1500)
    log = _build.log.read_text()
    if code != 0:
        pytest.fail(f"scripts/images.sh failed (exit {code}):\n{log[-4000:]}")
    if "images: not built" in log:
        skip_or_fail("container images not built: " + " ".join(
            line.removeprefix("images: ") for line in log.splitlines()
            if line.startswith("images: ")))
    return engine() or "podman"


def sh(*args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run(list(args), capture_output=True, text=True, timeout=timeout,
                            env=engine_env())
    if check and result.returncode != 0:
        raise AssertionError(f"{' '.join(args)} -> {result.returncode}\n{result.stderr}")
    return result


# ------------------------------------------------------------------ pod spec -> run flags

@dataclass
class Rendered:
    """The documents of one `helm template`, by kind and name."""
    docs: list[dict]

    def one(self, kind: str, component: str | None = None) -> dict:
        found = [d for d in self.docs if d["kind"] == kind and (
            component is None
            or d["metadata"].get("labels", {}).get("app.kubernetes.io/component") == component)]
        assert len(found) == 1, f"{len(found)} {kind} documents ({component})"
        return found[0]

    def named(self, kind: str, name: str) -> dict:
        (doc,) = [d for d in self.docs if d["kind"] == kind and d["metadata"]["name"] == name]
        return doc


def pod_spec(workload: dict) -> dict:
    """The pod spec of a Deployment, Job or CronJob."""
    if workload["kind"] == "CronJob":
        return workload["spec"]["jobTemplate"]["spec"]["template"]["spec"]
    return workload["spec"]["template"]["spec"]


def _security(pod: dict, container: dict, key: str):
    return container.get("securityContext", {}).get(
        key, pod.get("securityContext", {}).get(key))


def _env(container: dict, rendered: Rendered,
         secrets: dict[str, dict[str, str]]) -> dict[str, str]:
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        if "secretRef" in source:  # a Secret made beside the chart (an existingSecret)
            env.update(secrets[source["secretRef"]["name"]])
            continue
        ref = source["configMapRef"]["name"]
        env.update(rendered.named("ConfigMap", ref)["data"])
    for item in container.get("env", []):
        if "value" in item:
            env[item["name"]] = str(item["value"])
            continue
        ref = item["valueFrom"]["secretKeyRef"]
        secret = rendered.named("Secret", ref["name"])
        if ref["key"] in secret.get("stringData", {}):
            env[item["name"]] = secret["stringData"][ref["key"]]
        else:
            env[item["name"]] = base64.b64decode(secret["data"][ref["key"]]).decode()
    return env


def run_flags(workload: dict, rendered: Rendered, host_paths: dict[str, Path],
              scratch: Path, secrets: dict[str, dict[str, str]] | None = None) -> list[str]:
    """`podman run` flags and image and arguments for the first container of WORKLOAD's
    pod: `[flags..., image, args...]`. HOST_PATHS gives a host folder for each volume that
    is neither an emptyDir nor a ConfigMap (the PVC); ConfigMap volumes are written under
    SCRATCH. SECRETS: the data of the Secrets the chart names but does not render (as
    `kubectl create secret` made them)."""
    pod = pod_spec(workload)
    container = pod["containers"][0]
    uid, gid = _security(pod, container, "runAsUser"), _security(pod, container, "runAsGroup")
    if _security(pod, container, "runAsNonRoot"):
        assert uid not in (None, 0), "runAsNonRoot needs a non-root runAsUser"
    flags = ["--network", "host", "--user", f"{uid}:{gid}"]
    if _security(pod, container, "readOnlyRootFilesystem"):
        flags.append("--read-only")
    if _security(pod, container, "allowPrivilegeEscalation") is False:
        flags += ["--security-opt", "no-new-privileges"]
    for cap in container.get("securityContext", {}).get("capabilities", {}).get("drop", []):
        flags += ["--cap-drop", cap]
    assert not _security(pod, container, "privileged"), "privileged pods are not run here"
    for name, value in _env(container, rendered, secrets or {}).items():
        flags += ["--env", f"{name}={value}"]
    fs_group = pod.get("securityContext", {}).get("fsGroup")
    if fs_group is not None:
        flags += ["--group-add", str(fs_group)]
    volumes = {v["name"]: v for v in pod.get("volumes", [])}
    for mount in container.get("volumeMounts", []):
        volume, target = volumes[mount["name"]], mount["mountPath"]
        read_only = mount.get("readOnly", False)
        if volume.get("emptyDir", {}).get("medium") == "Memory":
            size = volume["emptyDir"].get("sizeLimit", "1Gi").replace("Gi", "g") \
                .replace("Mi", "m")
            flags += ["--tmpfs", f"{target}:rw,size={size},mode=1777"]
            continue
        if "emptyDir" in volume:
            # as the kubelet makes one: a fresh folder of the node's
            source = scratch / "emptyDir" / mount["name"]
            source.mkdir(parents=True, exist_ok=True)
            apply_fs_group(source, fs_group)
        elif "configMap" in volume:
            data = rendered.named("ConfigMap", volume["configMap"]["name"])["data"]
            source = scratch / mount["name"]
            source.mkdir(parents=True, exist_ok=True)
            for key, text in data.items():
                (source / key).write_text(text)
        else:
            source = host_paths[mount["name"]]
            apply_fs_group(source, fs_group)
        flags += ["--volume", f"{source}:{target}:{'ro' if read_only else 'rw'}"]
    command = container.get("command") or []
    if command:  # the program as entrypoint, its own arguments before the args (as docker)
        flags += ["--entrypoint", command[0]]
    return [*flags, container["image"], *command[1:], *container.get("args", [])]


def apply_fs_group(path: Path, gid: int | None) -> None:
    """What the kubelet does to a volume for a pod's fsGroup: the group owns everything,
    may read and write it, and new files in its folders inherit the group (setgid)."""
    if gid is None or os.geteuid() != 0:  # only root may give files to another group
        return
    for item in [path, *path.rglob("*")]:
        os.chown(item, -1, gid)
        mode = item.stat().st_mode
        os.chmod(item, mode | 0o060 | (0o2010 if item.is_dir() else 0))


def probes(workload: dict) -> dict[str, tuple[str, int | str]]:
    """probe kind -> (path, port) of the first container's HTTP probes."""
    container = pod_spec(workload)["containers"][0]
    ports = {p["name"]: p["containerPort"] for p in container.get("ports", [])}
    out = {}
    for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
        if kind in container:
            get = container[kind]["httpGet"]
            out[kind] = (get["path"], ports.get(get["port"], get["port"]))
    return out


def wait_status(url: str, status: int, timeout: float, container: str | None = None
                ) -> float:
    """Seconds until URL answers STATUS (an HTTP error status counts as an answer); on
    timeout, or when CONTAINER has stopped, AssertionError with its log."""
    import urllib.error
    import urllib.request

    start, got = time.monotonic(), None
    while time.monotonic() - start < timeout:
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                got = r.status
        except urllib.error.HTTPError as error:
            got = error.code
        except OSError:
            got = None
        if got == status:
            return time.monotonic() - start
        if container and sh(engine() or "podman", "inspect", "--format", "{{.State.Running}}",
                            container, check=False).stdout.strip() == "false":
            break
        time.sleep(0.05)
    logs = sh(engine() or "podman", "logs", container, check=False).stderr if container else ""
    raise AssertionError(f"{url} answered {got}, not {status}, after "
                         f"{time.monotonic() - start:.1f} s\n{logs}")


_NAME = re.compile(r"[^a-zA-Z0-9_.-]")


def container_name(label: str) -> str:
    return "orthornn-test-" + _NAME.sub("-", label) + f"-{os.getpid()}"
