"""The container images: how long `make images` takes, how big the images are, and how long
the serving container takes from `run` to ready with a model, against the same
`orthornn serve` started from this checkout's venv in the same run (the ratio is what the
container adds: its start, the read-only root, the image's Python).

    python bench/load/images.py [--runs 5] [--cold]

--cold first removes both images and the local Debian base, so `scripts/images.sh` builds
everything (the wheelhouse comes from pip's cache); without it the build runs on the layer
cache. Prints a table and writes bench/results/images.json.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import tomllib
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.common import write_result  # noqa: E402
from bench.load.client import free_port  # noqa: E402

VERSION = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
IMAGES = {"serve": f"orthornn:{VERSION}-cpu", "train": f"orthornn-train:{VERSION}-cpu"}
BASE = "localhost/orthornn-base:bookworm"
BIN = Path(sys.executable).parent
ENV = {**os.environ, "CONTAINERS_CONF": os.environ.get(
    "CONTAINERS_CONF", str(ROOT / "scripts" / "containers.conf"))}


def engine() -> str:
    """ENGINE when set, else docker where its engine runs, else podman (as
    scripts/images.sh picks)."""
    if os.environ.get("ENGINE"):
        return os.environ["ENGINE"]
    if shutil.which("docker") and subprocess.run(["docker", "info"], capture_output=True,
                                                 env=ENV).returncode == 0:
        return "docker"
    return "podman"


def sh(*args: str, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(list(args), capture_output=True, text=True, env=ENV, check=True,
                          **kwargs)


def seconds_to_ready(port: int, timeout: float = 60) -> float:
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/v2/health/ready",
                                        timeout=1) as r:
                if r.status == 200:
                    return time.monotonic() - start
        except OSError:
            time.sleep(0.02)
    raise TimeoutError(f"not ready after {timeout} s")


def build(cli: str, cold: bool) -> dict:
    if cold:
        subprocess.run([cli, "rmi", "--force", *IMAGES.values(), BASE], capture_output=True,
                       env=ENV)
    start = time.monotonic()
    out = sh("bash", str(ROOT / "scripts" / "images.sh"), cwd=ROOT)
    return {"seconds": round(time.monotonic() - start, 1), "cold": cold,
            "log": [line for line in (out.stdout + out.stderr).splitlines()
                    if line.startswith("images: ")]}


def model_repo(folder: Path) -> Path:
    """A repository with one small digits model, trained and exported by this checkout."""
    run, repo = folder / "run", folder / "repo"
    sh(str(BIN / "orthornn"), "train", "--arch", "svdrnn", "--task", "digits", "--hidden",
       "16", "--steps", "5", "--out", str(run), "--no-progress")
    sh(str(BIN / "orthornn"), "export", str(run), "--repo", str(repo), "--name", "digits")
    for path in [repo, *repo.rglob("*")]:
        path.chmod(path.stat().st_mode | 0o555 if path.is_dir() else 0o444)
    return repo


def start_to_ready(cli: str, repo: Path, runs: int) -> dict:
    container, native = [], []
    for i in range(runs):
        port = free_port()
        name = f"orthornn-bench-{os.getpid()}-{i}"
        start = time.monotonic()
        sh(cli, "run", "--detach", "--name", name, "--network", "host", "--read-only",
           "--user", "10001:10001", "--tmpfs", "/tmp", "--volume", f"{repo}:/models:ro",
           IMAGES["serve"], "serve", "--repo", "/models", "--host", "127.0.0.1",
           "--port", str(port))
        try:
            container.append(time.monotonic() - start + seconds_to_ready(port))
        finally:
            subprocess.run([cli, "rm", "--force", name], capture_output=True, env=ENV)
        port = free_port()
        start = time.monotonic()
        server = subprocess.Popen([str(BIN / "orthornn"), "serve", "--repo", str(repo),
                                   "--host", "127.0.0.1", "--port", str(port)],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            native.append(time.monotonic() - start + seconds_to_ready(port))
        finally:
            server.terminate()
            server.wait(timeout=30)
    median_c, median_n = statistics.median(container), statistics.median(native)
    return {"container_s": [round(s, 2) for s in container],
            "native_s": [round(s, 2) for s in native],
            "container_median_s": round(median_c, 2), "native_median_s": round(median_n, 2),
            "ratio": round(median_c / median_n, 2)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5, help="container starts (default 5)")
    parser.add_argument("--cold", action="store_true",
                        help="remove the images and the base first: a build from nothing")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "images.json")
    args = parser.parse_args(argv)
    if args.runs < 1:
        parser.error(f"--runs must be at least 1; got {args.runs}")
    cli = engine()
    result: dict = {"engine": cli, "build": build(cli, args.cold)}
    result["size_mib"] = {
        kind: round(int(sh(cli, "image", "inspect", "--format", "{{.Size}}", image)
                        .stdout.strip()) / 2**20)
        for kind, image in IMAGES.items()}
    with tempfile.TemporaryDirectory() as folder:
        result["start_to_ready"] = start_to_ready(cli, model_repo(Path(folder)), args.runs)
    ready = result["start_to_ready"]
    rows = [("make images" + (" (cold)" if args.cold else " (layer cache)"),
             f"{result['build']['seconds']} s"),
            *((f"{kind} image", f"{mib} MiB") for kind, mib in result["size_mib"].items()),
            ("run -> ready, container (median)", f"{ready['container_median_s']} s"),
            ("orthornn serve -> ready, this venv (median)", f"{ready['native_median_s']} s"),
            ("container / venv", f"{ready['ratio']}x")]
    width = max(len(r[0]) for r in rows)
    for label, value in rows:
        print(f"{label:<{width}}  {value}")
    write_result(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
