"""The chart's data-parallel retraining (retraining.distributed): an Indexed Job of N pods
with a headless Service, every pod running `orthornn train --nnodes N --nproc-per-node P
--rdzv-endpoint <job>-0.<service>:PORT` (torchrun's c10d rendezvous at pod 0), gloo or
nccl by device, and export run once, by the pod that ran rank 0. In tests/system/test_deploy.py's
style, with its helpers (helm template, helm lint, kubernetes-validate)."""

from __future__ import annotations

import shlex
import shutil
import subprocess

import pytest

from tests.system.test_deploy import (
    CHART,
    DISTRIBUTED,
    GPU,
    RELEASE,
    SECRETS,
    _subcommands,
    one,
    render,
    run,
    tool,
)

SERVICE = f"{RELEASE}-orthornn-retrain"


def _jobs(docs) -> dict[str, dict]:
    """The Job spec of the runOnInstall Job and of the CronJob's template."""
    return {"Job": one(docs, "Job")["spec"],
            "CronJob": one(docs, "CronJob")["spec"]["jobTemplate"]["spec"]}


def _train_command(pod: dict, job: str = "rel-orthornn-retrain-r1") -> list[str]:
    """The pod's train command line, with the shell's $run and ${JOB_NAME} filled in."""
    (c,) = pod["containers"]
    script = c["args"][0].replace('"$run"', "/runs/x").replace("${JOB_NAME}", job)
    (line,) = [x for x in script.splitlines() if x.startswith("orthornn train ")]
    return shlex.split(line)


@pytest.mark.parametrize(("sets", "backend"), [(DISTRIBUTED, "gloo"), (GPU, "nccl")],
                         ids=["gloo", "nccl"])
def test_distributed_retraining_is_an_indexed_job_meeting_at_pod_0(sets, backend):
    docs = render(*sets)
    service = one(docs, "Service", "-retrain")
    assert service["metadata"]["name"] == SERVICE
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["publishNotReadyAddresses"] is True
    assert service["spec"]["ports"] == [{"name": "rendezvous", "port": 29400,
                                         "targetPort": 29400, "protocol": "TCP"}]
    parser, _ = _subcommands()
    for kind, job in _jobs(docs).items():
        assert (job["completionMode"], job["completions"], job["parallelism"]) == (
            "Indexed", 3, 3), kind
        pod = job["template"]
        # the headless Service selects the job's pods, which take it as their subdomain
        assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items(), kind
        assert pod["spec"]["subdomain"] == SERVICE, kind
        (c,) = pod["spec"]["containers"]
        (job_name,) = [e for e in c["env"] if e["name"] == "JOB_NAME"]
        assert job_name["valueFrom"]["fieldRef"]["fieldPath"] == (
            "metadata.labels['batch.kubernetes.io/job-name']")
        command = _train_command(pod["spec"])
        args = parser.parse_args(command[1:])  # the train command takes these flags
        assert (args.nnodes, args.nproc_per_node, args.max_restarts, args.backend,
                args.dist_timeout_s) == (3, 2, 1, backend, 600.0), kind
        # torchrun's c10d rendezvous on pod 0 of this job, by its stable DNS name
        assert args.rdzv_endpoint == f"rel-orthornn-retrain-r1-0.{SERVICE}:29400", kind
        assert (args.config, args.out) == ("/config/train.yaml", "/runs/x")
        if backend == "nccl":
            assert c["resources"]["limits"]["nvidia.com/gpu"] == 2


def test_distributed_is_off_by_default_and_leaves_the_job_as_it_was():
    for sets in [("retraining.enabled=true",), ("retraining.enabled=true",
                                                "retraining.distributed.nodes=4")]:
        docs = render(*sets)
        assert not [d for d in docs if d["kind"] == "Service"
                    and d["metadata"]["name"] == SERVICE]
        for kind, job in _jobs(docs).items():
            assert "completionMode" not in job and "parallelism" not in job, kind
            assert "subdomain" not in job["template"]["spec"], kind
            command = _train_command(job["template"]["spec"])
            assert command == ["orthornn", "train", "--config", "/config/train.yaml", "--out",
                               "/runs/x", "--no-progress"], kind


@pytest.mark.parametrize("rank0", [True, False])
def test_only_the_pod_that_ran_rank_0_exports(tmp_path, rank0):
    """The container's script under /bin/sh with a stand-in `orthornn`: every pod trains;
    the pod whose run directory holds summary.json (rank 0 wrote it there) exports, the
    others end with 0 without exporting."""
    sh = shutil.which("sh")
    if sh is None:
        pytest.skip("no POSIX sh")
    fake = tmp_path / "bin" / "orthornn"
    fake.parent.mkdir()
    fake.write_text('#!/bin/sh\necho "$*" >> "$CALLS"\n'
                    'if [ "$1" = train ] && [ "$RANK0" = 1 ]; then\n'
                    '  while [ "$1" != --out ]; do shift; done\n'
                    '  mkdir -p "$2" && touch "$2/summary.json"\nfi\nexit 0\n')
    fake.chmod(0o755)
    pod = one(render(*DISTRIBUTED), "Job")["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    script = c["args"][0].replace('run="/runs/', f'run="{tmp_path}/runs/')
    env = {e["name"]: e["value"] for e in c["env"] if "value" in e}
    calls = tmp_path / "calls"
    result = subprocess.run([sh, "-ec", script], capture_output=True, text=True, timeout=60,
                            env={**env, "JOB_NAME": "job", "CALLS": str(calls),
                                 "RANK0": "1" if rank0 else "0",
                                 "PATH": f"{fake.parent}:/usr/bin:/bin"})
    assert result.returncode == 0, result.stderr
    commands = [line.split()[0] for line in calls.read_text().splitlines()]
    assert commands == (["train", "export"] if rank0 else ["train"])
    if not rank0:
        assert "the pod of rank 0 exports the run" in result.stderr


@pytest.mark.parametrize(("sets", "message"), [
    ((*DISTRIBUTED, "retraining.gpu.enabled=true", "retraining.gpu.count=1"),
     "retraining.distributed.nprocPerNode (2) must be at most retraining.gpu.count (1)"),
    ((*DISTRIBUTED, "retraining.distributed.nodes=0"), "nodes"),
    ((*DISTRIBUTED, "retraining.distributed.nprocPerNode=0"), "nprocPerNode"),
    ((*DISTRIBUTED, "retraining.distributed.node=2"), "node"),  # misspelt
])
def test_bad_distributed_values_fail_at_render_time(sets, message):
    args = [tool("helm"), "template", RELEASE, str(CHART)]
    for item in (*SECRETS, *sets):
        args += ["--set", item]
    result = run(args)
    assert result.returncode != 0
    assert message in result.stderr, result.stderr
