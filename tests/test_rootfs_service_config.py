"""What the rootfs sandbox makes of a compose service before it runs it, without a node:
its command, environment, user and workdir as Docker would give them
(envhub/plugins/rootfs_sandbox/sidecars.py), its healthcheck (the service's, else its
image's), and the ids its user has in its image (nsinit.py, over an ``/etc`` of the test's
own). The sidecars themselves are tests/test_rootfs_sidecars.py's."""

from __future__ import annotations

import os

import pytest

from envhub.plugins.rootfs_sandbox import nsinit
from envhub.plugins.rootfs_sandbox.images import DEFAULT_PATH, ImageConfig
from envhub.plugins.rootfs_sandbox.sidecars import health_command, healthcheck_of, service_of
from envhub.sandbox import Sidecar

IMAGE = ImageConfig(
    env=("PATH=/opt/db/bin:/usr/bin", "LANG=C.UTF-8", "PGDATA=/var/lib/db"),
    workdir="/srv",
    user="db",
    entrypoint=("docker-entrypoint.sh",),
    cmd=("postgres", "-c", "fsync=off"),
    healthcheck={"Test": ["CMD-SHELL", "pg_isready"], "Interval": 2_000_000_000, "Retries": 5},
)


def test_the_command_is_docker_s_the_services_entrypoint_drops_the_images_cmd():
    assert service_of(Sidecar("db", "img"), IMAGE)["argv"] == ["docker-entrypoint.sh", "postgres", "-c", "fsync=off"]
    assert service_of(Sidecar("db", "img", command=("postgres",)), IMAGE)["argv"] == [
        "docker-entrypoint.sh",
        "postgres",
    ]
    assert service_of(Sidecar("db", "img", entrypoint=("sh", "-c", "x")), IMAGE)["argv"] == ["sh", "-c", "x"]
    both = Sidecar("db", "img", entrypoint=("run",), command=("a", "b"))
    assert service_of(both, IMAGE)["argv"] == ["run", "a", "b"]


def test_environment_user_and_workdir_are_the_services_over_the_images():
    plain = service_of(Sidecar("db", "img"), IMAGE)
    assert plain["env"] == {"PATH": "/opt/db/bin:/usr/bin", "LANG": "C.UTF-8", "PGDATA": "/var/lib/db"}
    assert (plain["user"], plain["workdir"]) == ("db", "/srv")
    own = service_of(Sidecar("db", "img", env={"PGDATA": "/tmp/db"}, user="0", workdir="/data"), IMAGE)
    assert own["env"]["PGDATA"] == "/tmp/db" and own["env"]["LANG"] == "C.UTF-8"
    assert (own["user"], own["workdir"]) == ("0", "/data")
    bare = service_of(Sidecar("db", "img", command=("true",)), ImageConfig())
    assert bare["env"] == {"PATH": DEFAULT_PATH} and (bare["user"], bare["workdir"]) == ("", "/")


def test_the_healthcheck_is_the_services_else_the_images_in_seconds():
    assert healthcheck_of(Sidecar("db", "img"), IMAGE) == {
        "test": ["CMD-SHELL", "pg_isready"],
        "interval_sec": 2.0,
        "retries": 5,
    }
    own = {"test": ["CMD", "true"], "interval_sec": 0.5}
    assert healthcheck_of(Sidecar("db", "img", healthcheck=own), IMAGE) == own
    assert healthcheck_of(Sidecar("db", "img"), ImageConfig(healthcheck={"Test": ["NONE"]})) is None
    assert healthcheck_of(Sidecar("db", "img"), ImageConfig()) is None
    assert ImageConfig.from_json(IMAGE.to_json()) == IMAGE, "image.json keeps it"


@pytest.mark.parametrize(
    "test, command",
    [
        (["CMD", "redis-cli", "ping", "it's"], "redis-cli ping 'it'\"'\"'s'"),
        (["CMD-SHELL", "pg_isready -U x || exit 1"], "pg_isready -U x || exit 1"),
        (["NONE"], None),
        ([], None),
    ],
)
def test_a_healthcheck_runs_as_docker_runs_it(test, command):
    assert health_command({"test": test}) == command


@pytest.fixture
def etc(tmp_path):
    (tmp_path / "passwd").write_text(
        "root:x:0:0::/root:/bin/sh\ndb:x:70:71::/srv:/bin/sh\nnobody:x:65534:65534::/:/bin/false\n"
    )
    (tmp_path / "group").write_text("root:x:0:\ndb:x:71:\nssl:x:72:db\nnogroup:x:65534:\n")
    return str(tmp_path)


@pytest.mark.skipif(os.geteuid() != 0, reason="the ids are checked against this process's uid map, root's here")
@pytest.mark.parametrize(
    "user, ids",
    [
        ("", (0, 0, [0])),
        ("db", (70, 71, [71, 72])),  # its primary group and the one that lists it
        ("70", (70, 71, [71, 72])),  # a uid its passwd names: as that user
        ("4242", (4242, 0, [0])),  # one it does not name: gid 0, as on Docker
        ("db:nogroup", (70, 65534, [72, 65534])),
        ("4242:4343", (4242, 4343, [4343])),
    ],
)
def test_a_services_user_has_the_ids_its_image_gives_it(etc, user, ids):
    assert nsinit._user_ids(user, etc) == ids


def test_a_user_or_group_its_image_lacks_is_an_error(etc):
    with pytest.raises(nsinit.Failed, match="the sidecar's user 'postgres' is not in its image's /etc/passwd"):
        nsinit._user_ids("postgres", etc)
    with pytest.raises(nsinit.Failed, match="the sidecar's group 'wheel' is not in its image's /etc/group"):
        nsinit._user_ids("db:wheel", etc)
