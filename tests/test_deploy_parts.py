"""envhub deploy's parts that need no SSH host: nodes.yaml as SETA writes it plus envhub's
own keys (envhub/deploy/inventory.py), and the build it ships (envhub/deploy/wheels.py).
The hosts themselves are in tests/test_deploy.py."""

from __future__ import annotations

import base64
import csv
import hashlib
import io
import sys
import zipfile

import pytest
import yaml

from envhub.deploy import inventory, wheels
from envhub.errors import StartupError

pytest.importorskip("packaging", reason="the deploy extra: pip install -e '.[deploy]'")

SETA = """
nodes:
  - url: "http://10.0.0.11:8002"
    slots: 16
    deploy:
      host: 10.0.0.11
      ssh_key: ~/.ssh/id_ed25519
      ssh_user: root
      api_key: env-service-dev-key
      data_root: /data/harbor/dataset
  - url: "http://10.0.0.12:8002"
    slots: 8
url_rewrite:
  "http://proxy.internal:9000": "http://relay:39001"
api_key: env-service-dev-key
"""


def test_setas_nodes_yaml_as_it_is_deploys_its_nodes_with_a_deploy_block(tmp_path):
    path = tmp_path / "nodes.yaml"
    path.write_text(SETA)
    inv = inventory.load(path)
    (t,) = inv.targets
    assert (t.name, t.host, t.ssh_port, t.ssh_user, t.api_key) == (
        "10.0.0.11",
        "10.0.0.11",
        22,
        "root",
        "env-service-dev-key",
    )
    assert (t.bind, t.port, t.slots) == ("10.0.0.11", 8002, 16), "bound to the URL's address, capacity = slots"
    assert t.python == f"python{sys.version_info[0]}.{sys.version_info[1]}" and t.app_dir is None
    assert t.ssh_key.endswith("/.ssh/id_ed25519") and not t.ssh_key.startswith("~")
    assert inv.scheduler is not None and inv.scheduler.url == "http://127.0.0.1:8003", "SETA's scheduler address"
    assert inv.scheduler.dir == tmp_path / "envhub-scheduler"
    nodes_file = inv.nodes_file()
    assert [n["url"] for n in nodes_file["nodes"]] == ["http://10.0.0.11:8002", "http://10.0.0.12:8002"]
    assert nodes_file["nodes"][0]["api_key"] == "env-service-dev-key", "each deployed node with its key"
    assert nodes_file["url_rewrite"] == {"http://proxy.internal:9000": "http://relay:39001"}
    assert inv.select(("10.0.0.11",)) == [t] and inv.select(("http://10.0.0.11:8002",)) == [t]
    with pytest.raises(StartupError, match="--only 10.0.0.12: no node with a deploy block"):
        inv.select(("10.0.0.12",))


def test_envhubs_own_keys_and_defaults_for_every_block(tmp_path):
    data = yaml.safe_load(SETA)
    data["deploy"] = {"bind": "0.0.0.0", "port": 9000, "config": {"idle_ttl": 60}, "ssh_user": "ops"}
    data["nodes"][0]["deploy"]["name"] = "left"
    data["nodes"][1]["deploy"] = {"api_key": "k2", "jump_host": "ops@bastion:2222", "ssh_port": 2200}
    data["scheduler"] = {"port": 9100, "dir": "sched", "api_key": "trainer"}
    inv = inventory.parse(data, base=tmp_path / "nodes.yaml")
    left, right = inv.targets
    assert (left.name, left.ssh_user, left.bind, left.port, left.config) == (
        "left",
        "root",
        "0.0.0.0",
        9000,
        {"idle_ttl": 60},
    )
    assert (right.name, right.ssh_user, right.jump_host, right.api_key) == (
        "10.0.0.12:2200",
        "ops",
        "ops@bastion:2222",
        "k2",
    )
    assert inv.scheduler.dir == tmp_path / "sched" and inv.scheduler.api_key == "trainer"
    assert inventory.parse({**data, "scheduler": False}, base=tmp_path / "n.yaml").scheduler is None


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda d: d["nodes"][0]["deploy"].update(sshport=22), "nodes\\[0\\].deploy: unknown key 'sshport'"),
        (lambda d: (d.pop("api_key"), d["nodes"][0]["deploy"].pop("api_key")), "needs an API key"),
        (lambda d: d["nodes"][0]["deploy"].update(ssh_port=0), "ssh_port must be a port number"),
        (lambda d: d["nodes"][0].update(slots=0), "slots must be a whole number"),
        (lambda d: d["nodes"][1].update(deploy={"host": "10.0.0.11", "name": "10.0.0.11"}), "two deployed nodes"),
        (lambda d: d.update(scheduler={"host": "0.0.0.0"}) or d.pop("api_key"), "give it an api_key"),
        (lambda d: d.update(nodes=[]), "'nodes' must list the nodes"),
        # A key goes into an environment file a shell sources: no shell syntax in it.
        (lambda d: d["nodes"][0]["deploy"].update(api_key="k$(touch /tmp/x)"), "nodes\\[0\\]: an API key may hold"),
        (lambda d: d.update(scheduler={"api_key": "a b"}), "scheduler: an API key may hold"),
    ],
)
def test_each_mistake_names_its_entry(tmp_path, change, message):
    data = yaml.safe_load(SETA)
    change(data)
    with pytest.raises(StartupError, match=message):
        inventory.parse(data, base=tmp_path / "nodes.yaml")


def test_the_build_is_the_local_install_as_wheels_and_the_same_build_has_the_same_id(tmp_path):
    first = wheels.make(cache=tmp_path)
    again = wheels.make(cache=tmp_path)
    assert first.build_id == again.build_id and first.requirements == [f"envhub=={first.version}"]
    names = {w.dist for w in first.wheels}
    assert {"envhub", "sanic", "aiosqlite", "pluggy", "pyyaml", "pip"} <= names
    with zipfile.ZipFile(next(w.path for w in first.wheels if w.dist == "envhub")) as z:
        assert any(n.startswith("envhub/migrations/") for n in z.namelist()), "the schema ships in the wheel"
    pluggy = next(w for w in first.wheels if w.dist == "pluggy")
    with zipfile.ZipFile(pluggy.path) as z:
        record = next(n for n in z.namelist() if n.endswith(".dist-info/RECORD"))
        rows = list(csv.reader(io.StringIO(z.read(record).decode())))
        files = {n for n in z.namelist()}
        assert {r[0] for r in rows} == files, "RECORD lists every file"
        for name, digest, _size in rows:
            if digest:
                data = z.read(name)
                expected = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
                assert digest == f"sha256={expected}", name
        assert not any(n.endswith((".pyc", "INSTALLER", "direct_url.json")) for n in files)


def test_an_extra_named_ships_its_dependencies_and_an_index_url_ships_none(tmp_path):
    pytest.importorskip("asyncssh")
    bundle = wheels.make(cache=tmp_path, extras=("deploy",))
    assert bundle.requirements == [f"envhub[deploy]=={bundle.version}"]
    assert {"asyncssh", "cryptography", "packaging"} <= {w.dist for w in bundle.wheels}
    mirror = wheels.make(cache=tmp_path, index_url="https://mirror.example/simple")
    assert {w.dist for w in mirror.wheels} == {"envhub", "pip"}, "the hosts take the rest from the mirror"
    assert any(c.lower().startswith("sanic==") for c in mirror.constraints), "pinned to the versions here"
    assert mirror.build_id != wheels.make(cache=tmp_path).build_id


def test_a_build_that_cannot_be_shipped_says_why(tmp_path):
    with pytest.raises(StartupError, match="has no extra 'gpu'"):
        wheels.make(cache=tmp_path, extras=("gpu",))
    pluggy = next(w for w in wheels.make(cache=tmp_path).wheels if w.dist == "pluggy")
    with pytest.raises(StartupError, match="is a wheel of pluggy, not of envhub"):
        wheels.make(cache=tmp_path, wheel=pluggy.path)
    with pytest.raises(StartupError, match="is not installed here"):
        wheels.make(cache=tmp_path, plugins=("no-such-envhub-plugin",))
