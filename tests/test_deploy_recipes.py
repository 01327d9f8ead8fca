"""The Slurm and Kubernetes recipes under deploy/, run as far as this machine can: their
own commands start real node and scheduler processes that find each other by joining.

Neither Slurm nor a Kubernetes cluster runs here. The Slurm test runs the sbatch script
itself with a stand-in ``srun`` that runs its command once on this host, as one task of
a one-host job would; the Kubernetes test reads the manifest, checks that its parts name
each other (Service, ports, keys), and runs each container's own arguments and
environment as Kubernetes would resolve them, with the pod IP and the Service's name
both 127.0.0.1 and free ports for the manifest's ones; before that, kubernetes-validate
checks every resource against the OpenAPI schemas Kubernetes itself publishes.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import kubernetes_validate
import pytest
import yaml
from conftest import REPO, EnvhubProcess, eventually, free_port

KEY = "recipe-key"
SBATCH = REPO / "deploy" / "slurm" / "envhub-nodes.sbatch"
MANIFEST = REPO / "deploy" / "kubernetes" / "envhub.yaml"

SRUN_STANDIN = """#!/usr/bin/env bash
# Stand-in for Slurm's srun (no Slurm here): one task on this host.
while [[ "$1" == --* ]]; do shift; done
export SLURM_JOB_ID=4242 SLURM_CPUS_ON_NODE=2
exec "$@"
"""


def scheduler(tmp_path: Path) -> EnvhubProcess:
    return EnvhubProcess(
        tmp_path / "sched",
        "--set",
        "health_interval=0.2",
        "--set",
        f"node_api_key={KEY}",
        role="scheduler",
        api_key=KEY,
    ).start()


def joined(c: httpx.Client) -> list[dict]:
    return [n for n in c.get("/status").json()["nodes"] if n["joined"] and n["healthy"]]


def run_an_episode(c: httpx.Client) -> None:
    r = c.post("/instances", json={"environment": "mbpp", "task_id": "13"})
    assert r.status_code == 201, r.text
    iid = r.json()["instance_id"]
    r = c.post(f"/instances/{iid}/step", json={"action": {"tool": "run_python", "arguments": {"code": "6*7"}}})
    assert r.status_code == 200 and r.json()["observation"]["value_repr"] == "42", r.text
    assert c.post(f"/instances/{iid}/release").json()["released"] is True


def test_the_slurm_script_starts_a_node_that_joins_the_scheduler_and_stops_at_sigterm(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(SRUN_STANDIN)
    (bin_dir / "srun").chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith("ENVHUB_")}
    env["PATH"] = f"{bin_dir}:{env['PATH']}"
    env["PYTHONPATH"] = str(REPO)  # the console script runs this checkout's envhub

    missing = subprocess.run(["bash", str(SBATCH)], env=env, capture_output=True, text=True, timeout=30)
    assert missing.returncode != 0 and "set ENVHUB_SCHEDULER" in missing.stderr, missing

    sched = scheduler(tmp_path)
    port = free_port()
    env.update(
        ENVHUB_SCHEDULER=sched.url,
        ENVHUB_API_KEY=KEY,
        ENVHUB=str(Path(sys.executable).parent / "envhub"),
        ENVHUB_PORT=str(port),
        ENVHUB_DATA_ROOT=str(tmp_path),
    )
    log = open(tmp_path / "job.log", "wb")
    job = subprocess.Popen(
        ["bash", str(SBATCH), "--set", "environments.terminal-bench.enabled=false"],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
    )
    try:
        with sched.client() as c:
            nodes = eventually(
                lambda: joined(c), timeout=60, message=lambda: (tmp_path / "job.log").read_text(errors="replace")
            )
            assert [n["url"] for n in nodes] == [f"http://127.0.0.1:{port}"]
            assert nodes[0]["total_slots"] == 2, "slots: the CPUs Slurm gave the task"
            assert (tmp_path / f"envhub-4242-{os.uname().nodename.split('.')[0]}" / "envhub.db").exists()
            run_an_episode(c)
        job.send_signal(signal.SIGTERM)  # as Slurm at the job's end: srun and bash exec'd, so this is the node
        assert job.wait(60) == 0, (tmp_path / "job.log").read_text(errors="replace")
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()
        log.close()
        assert sched.stop() == 0, sched.log()


def _manifests() -> dict[tuple[str, str], dict[str, Any]]:
    docs = [d for d in yaml.safe_load_all(MANIFEST.read_text()) if d]
    return {(d["kind"], d["metadata"]["name"]): d for d in docs}


@pytest.mark.parametrize("version", ["1.29.0", kubernetes_validate.latest_version()])
def test_the_kubernetes_manifest_holds_to_kubernetes_own_schemas(version):
    """Each resource of the manifest against Kubernetes's published schemas for an older
    release still in use (1.29) and the newest the validator knows, strictly: a misspelt
    or misplaced field is an error here, as a cluster's server-side validation makes it."""
    found = _manifests()
    assert {kind for kind, _ in found} == {"Secret", "Service", "PersistentVolumeClaim", "Deployment"}
    for doc in found.values():
        kubernetes_validate.validate(doc, version, strict=True)
    broken = found[("Deployment", "envhub-node")]
    broken["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGet"]["prot"] = 8000
    with pytest.raises(kubernetes_validate.ValidationError, match="prot"):
        kubernetes_validate.validate(broken, version, strict=True)


def _container(deployment: dict[str, Any]) -> dict[str, Any]:
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return container


def _env(container: dict[str, Any], secrets: dict[str, dict[str, str]], pod_ip: str) -> dict[str, str]:
    """The container's environment as Kubernetes resolves it: secret and field refs, and
    ``$(NAME)`` of a variable defined above it."""
    out: dict[str, str] = {}
    for item in container["env"]:
        if "value" in item:
            out[item["name"]] = re.sub(r"\$\((\w+)\)", lambda m: out.get(m[1], m[0]), item["value"])
        elif "secretKeyRef" in item["valueFrom"]:
            ref = item["valueFrom"]["secretKeyRef"]
            out[item["name"]] = secrets[ref["name"]][ref["key"]]
        else:
            assert item["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
            out[item["name"]] = pod_ip
    return out


def _arg(container: dict[str, Any], flag: str) -> str:
    args = container["args"]
    return str(args[args.index(flag) + 1])


def test_the_kubernetes_manifest_runs_a_scheduler_and_nodes_that_join_it(tmp_path):
    found = _manifests()
    secrets = {name: d["stringData"] for (kind, name), d in found.items() if kind == "Secret"}
    service = found[("Service", "envhub-scheduler")]
    sched_c = _container(found[("Deployment", "envhub-scheduler")])
    node_c = _container(found[("Deployment", "envhub-node")])
    (svc_port,) = service["spec"]["ports"]
    assert (
        service["spec"]["selector"]
        == found[("Deployment", "envhub-scheduler")]["spec"]["template"]["metadata"]["labels"]
    )
    sched_port, node_port = _arg(sched_c, "--port"), _arg(node_c, "--port")
    assert str(svc_port["targetPort"]) == sched_port == str(sched_c["ports"][0]["containerPort"])
    assert str(node_c["ports"][0]["containerPort"]) == node_port
    for c, port in ((sched_c, sched_port), (node_c, node_port)):
        assert str(c["readinessProbe"]["httpGet"]["port"]) == port and _arg(c, "--host") == "0.0.0.0"
    node_env = _env(node_c, secrets, "127.0.0.1")
    sched_env = _env(sched_c, secrets, "10.0.0.1")
    assert node_env["ENVHUB_JOIN"] == f"http://{service['metadata']['name']}:{svc_port['port']}"
    assert node_env["ENVHUB_ADVERTISE_URL"] == f"http://127.0.0.1:{node_port}"
    assert node_env["ENVHUB_API_KEY"] == sched_env["ENVHUB_API_KEY"] == sched_env["ENVHUB_NODE_API_KEY"]

    # The containers' own arguments and environment, on free ports of this host.
    def process(container: dict[str, Any], env: dict[str, str], data: str, port_of: dict[str, int]) -> EnvhubProcess:
        proc = EnvhubProcess(tmp_path / data, api_key=env["ENVHUB_API_KEY"])
        proc.port = port_of[_arg(container, "--port")]
        proc.url = f"http://127.0.0.1:{proc.port}"
        proc.node_id = None
        args = [str(a) for a in container["args"]]
        args[args.index("--port") + 1] = str(proc.port)
        args[args.index("--data-dir") + 1] = str(proc.data_dir)
        proc.args = args
        for name, value in env.items():
            for manifest_port, port in port_of.items():
                value = value.replace(f":{manifest_port}", f":{port}")
            proc.env[name] = value.replace(f"//{service['metadata']['name']}:", "//127.0.0.1:")
        return proc

    ports = {sched_port: free_port(), node_port: free_port()}
    sched = process(sched_c, sched_env, "sched", ports).start()
    ports_b = {sched_port: ports[sched_port], node_port: free_port()}
    nodes = [process(node_c, node_env, "node-a", ports), process(node_c, node_env, "node-b", ports_b)]
    try:
        for n in nodes:
            n.start()
        with sched.client() as c:
            eventually(lambda: len(joined(c)) == 2, timeout=30, message=lambda: str(c.get("/status").json()))
            assert {n["url"] for n in joined(c)} == {n.url for n in nodes}
            run_an_episode(c)
    finally:
        for p in (*nodes, sched):
            if p.proc is not None:
                assert p.stop() == 0, p.log()
