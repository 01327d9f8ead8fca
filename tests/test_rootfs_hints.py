"""What the node says to change when the rootfs sandbox cannot make an episode's
namespaces (``launcher.hint``), read from a proc tree as a container's looks and from
this host's own. The image test (tests/test_image.py) checks the same in real containers."""

from __future__ import annotations

from pathlib import Path

import pytest

from envhub.plugins.rootfs_sandbox.launcher import hint

pytestmark = pytest.mark.fast

# What a Docker container with the engine's defaults shows (seen in one here).
CONTAINER_MOUNTS = [
    "/",
    "/proc",
    "/dev",
    "/proc/bus",
    "/proc/fs",
    "/proc/irq",
    "/proc/sys",
    "/proc/acpi",
    "/proc/keys",
    "/proc/timer_list",
]
UNSHARE = "unshare: Operation not permitted"
MOUNT_PROC = "mount proc on /var/lib/envhub/data/rootfs-scratch/root/proc: Operation not permitted"


def proc_tree(root: Path, *, seccomp: str = "0", mounts=("/", "/proc"), sysctls: dict[str, str] | None = None) -> str:
    (root / "self").mkdir(parents=True)
    (root / "self" / "status").write_text(f"Name:\tpython3\nSeccomp:\t{seccomp}\nSeccomp_filters:\t1\n")
    lines = [f"{20 + i} 1 0:{i} / {m} rw,relatime - proc proc rw" for i, m in enumerate(mounts)]
    (root / "self" / "mountinfo").write_text("\n".join(lines) + "\n")
    for path, value in (sysctls or {}).items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text(value + "\n")
    return str(root)


def test_a_seccomp_filter_is_named_with_the_settings_that_lift_it(tmp_path):
    said = hint(UNSHARE, proc_tree(tmp_path, seccomp="2", mounts=CONTAINER_MOUNTS))
    assert "seccomp" in said and "--security-opt seccomp=unconfined" in said and "seccompProfile" in said


def test_a_masked_proc_is_named_with_the_settings_that_unmask_it(tmp_path):
    said = hint(MOUNT_PROC, proc_tree(tmp_path, seccomp="0", mounts=CONTAINER_MOUNTS))
    assert "masked" in said and "systempaths=unconfined" in said and "procMount: Unmasked" in said


@pytest.mark.parametrize(
    "sysctl, closed, fix",
    [
        ("sys/kernel/unprivileged_userns_clone", "0", "kernel.unprivileged_userns_clone=1"),
        ("sys/kernel/apparmor_restrict_unprivileged_userns", "1", "kernel.apparmor_restrict_unprivileged_userns=0"),
    ],
)
def test_user_namespaces_closed_by_a_sysctl_name_it(tmp_path, sysctl, closed, fix):
    assert fix in hint(UNSHARE, proc_tree(tmp_path, sysctls={sysctl: closed}))
    open_ = "1" if closed == "0" else "0"
    assert hint(UNSHARE, proc_tree(tmp_path / "open", sysctls={sysctl: open_})) == ""


def test_no_hint_where_the_cause_is_not_one_of_these(tmp_path):
    # A whole /proc (binfmt_misc's empty dir hides nothing) and no filter: nothing to say,
    # rather than a wrong lead; nor for errors of another kind.
    plain = proc_tree(tmp_path, mounts=("/", "/proc", "/proc/sys/fs/binfmt_misc"))
    assert hint(MOUNT_PROC, plain) == ""
    assert hint(UNSHARE, plain) == ""
    assert hint("unshare: Invalid argument", proc_tree(tmp_path / "b", seccomp="2")) == ""
    assert hint("mount proc on /x: No such device", proc_tree(tmp_path / "c", mounts=CONTAINER_MOUNTS)) == ""


def test_on_this_host_it_reads_its_own_proc():
    # Whatever this host is, the reading does not fail and a non-matching error gets nothing.
    assert hint("clone: Resource temporarily unavailable") == ""
    assert isinstance(hint(MOUNT_PROC), str)
