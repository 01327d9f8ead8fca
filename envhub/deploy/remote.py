"""What ``envhub deploy`` does on a node's server, as shell scripts run over SSH.

Layout on the host (``app_dir``: /opt/envhub as root, ~/envhub for another user)::

    wheels/<sha256[:16]>-<wheel>   every wheel ever uploaded, by content
    builds/<build id>/             one venv per build (venv/) and its wheels (hard links);
                                   .complete once pip finished, so a cut-off install is redone
    current -> builds/<build id>   the build the node runs
    node.yaml, node.env            the node's config and its key (ENVHUB_API_KEY), both 0600
    run/node.pid, log/node.log     under nohup: the node's pid and its log
    data/                          the node's data dir (``data_dir`` puts it elsewhere)

Invariants:
- Scripts only ever touch ``app_dir`` (and, under systemd, the unit file and the unit).
- A build is installed beside the running one and switched to only at a restart, so a
  node serves while its next build installs.
- Under nohup the node runs in a session of its own (``setsid``), outlives the SSH
  session, and is stopped only through its pid file, and only when that pid runs from
  this ``app_dir``. Under systemd it is the unit ``envhub systemd install`` writes.
- Every step that fails says why in one line, with the tail of the log that says more.
"""

from __future__ import annotations

import base64
import json
import posixpath
import shlex
from dataclasses import dataclass
from typing import Any

from envhub.deploy.inventory import Target
from envhub.deploy.ssh import Host, HostFailed
from envhub.deploy.wheels import Bundle, Wheel

UNIT = "envhub-node"
STOP_TIMEOUT = 150  # seconds SIGTERM gets (the unit's TimeoutStopSec is 120)

_PROBE = r"""
import hashlib, json, os, shutil, subprocess, sys
app_opt, data_opt, unit = sys.argv[1:4]
uid = os.getuid()
home = os.path.expanduser("~")
expand = lambda p: home + p[1:] if p.startswith("~") else p
app = expand(app_opt) if app_opt else ("/opt/envhub" if uid == 0 else os.path.join(home, "envhub"))
data = expand(data_opt) if data_opt else os.path.join(app, "data")
try:
    import venv  # noqa
    has_venv = True
except ImportError:
    has_venv = False
systemd = os.path.isdir("/run/systemd/system") and shutil.which("systemctl") is not None
if systemd and uid == 0:
    init, why = "systemd", "systemd runs this host"
elif systemd:
    init, why = "nohup", "systemd runs this host but " + os.environ.get("USER", "this user") + " is not root"
else:
    init, why = "nohup", "no systemd on this host"
def listdir(p):
    try:
        return sorted(os.listdir(p))
    except OSError:
        return []
current = os.path.join(app, "current")
current = os.path.basename(os.readlink(current)) if os.path.islink(current) else None
builds = os.path.join(app, "builds")
builds = [b for b in listdir(builds) if os.path.isfile(os.path.join(builds, b, ".complete"))]
def build_of(pid):
    try:
        with open("/proc/%d/cmdline" % pid, "rb") as f:
            args = f.read().decode(errors="replace").split("\0")
        with open("/proc/%d/status" % pid) as f:
            if any(line.startswith("State:") and "Z" in line for line in f):
                return None
    except OSError:
        return None
    mark = os.path.join(app, "builds") + "/"
    for a in args:
        if a.startswith(mark):
            return a[len(mark):].split("/")[0]
    return None
pid, build = None, None
if init == "systemd":
    out = subprocess.run(["systemctl", "show", "-p", "MainPID", "--value", unit], capture_output=True, text=True)
    if out.stdout.strip().isdigit() and int(out.stdout.strip()) > 0:
        pid = int(out.stdout.strip())
else:
    try:
        with open(os.path.join(app, "run", "node.pid")) as f:
            pid = int(f.read().strip())
    except (OSError, ValueError):
        pid = None
if pid is not None:
    build = build_of(pid)
    if build is None:
        pid = None
h = hashlib.sha256()
for name in ("node.yaml", "node.env"):
    try:
        with open(os.path.join(app, name), "rb") as f:
            h.update(f.read())
    except OSError:
        h.update(b"-")
print(json.dumps({
    "python": sys.executable, "version": "%d.%d.%d" % sys.version_info[:3], "venv": has_venv, "uid": uid,
    "home": home, "app_dir": app, "data_dir": data, "init": init, "init_why": why, "current": current,
    "builds": builds, "pool": listdir(os.path.join(app, "wheels")), "pid": pid, "running_build": build,
    "config_digest": h.hexdigest()[:16],
}))
"""


@dataclass
class Probe:
    """A host as found: its Python, how a node runs there, and what is installed."""

    python: str
    version: str
    init: str  # systemd | nohup
    init_why: str
    app_dir: str
    data_dir: str
    current: str | None
    builds: list[str]
    pool: set[str]
    pid: int | None
    running_build: str | None
    config_digest: str

    @property
    def running(self) -> bool:
        return self.pid is not None


def q(value: Any) -> str:
    return shlex.quote(str(value))


async def probe(host: Host, target: Target) -> Probe:
    """Find the target's Python (``deploy.python``) and what is installed; a host without
    it is :class:`HostFailed` at step ``probe``."""
    script = (
        f"py=$(command -v {q(target.python)} 2>/dev/null || true)\n"
        'if [ -z "$py" ]; then echo null; exit 0; fi\n'
        f"exec \"$py\" - {q(target.app_dir or '')} {q(target.data_dir or '')} {UNIT} <<'ENVHUB_PROBE'\n"
        f"{_PROBE}\nENVHUB_PROBE\n"
    )
    ran = await host.run(script, timeout=60)
    try:
        found = json.loads(ran.stdout.strip().splitlines()[-1]) if ran.stdout.strip() else None
    except ValueError:
        found = None
    if ran.status != 0 or (found is not None and not isinstance(found, dict)):
        raise HostFailed("probe", f"cannot inspect the host (exit {ran.status})", ran.stderr[-2000:])
    if found is None:
        raise HostFailed(
            "probe", f"no {target.python} on this host (the build is for it): install it, or set deploy.python"
        )
    if not found["venv"]:
        raise HostFailed("probe", f"{target.python} has no venv module (Debian: apt-get install {target.python}-venv)")
    return Probe(
        python=found["python"],
        version=found["version"],
        init=found["init"],
        init_why=found["init_why"],
        app_dir=found["app_dir"],
        data_dir=found["data_dir"],
        current=found["current"],
        builds=list(found["builds"]),
        pool=set(found["pool"]),
        pid=found["pid"],
        running_build=found["running_build"],
        config_digest=found["config_digest"],
    )


def pooled(wheel: Wheel) -> str:
    return f"{wheel.sha256[:16]}-{wheel.name}"


async def upload(host: Any, found: Probe, bundle: Bundle) -> int:
    """Copy the wheels the host lacks into its pool; returns how many went."""
    await _check(host, "upload", f"mkdir -p {q(found.app_dir + '/wheels')}")
    missing = [w for w in bundle.wheels if pooled(w) not in found.pool]
    for wheel in missing:
        try:
            await host.put(wheel.path, f"{found.app_dir}/wheels/{pooled(wheel)}")
        except Exception as e:  # an SFTP failure of any kind: this host's upload failed
            raise HostFailed("upload", f"cannot copy {wheel.name}: {type(e).__name__}: {e}") from None
    return len(missing)


async def install(host: Host, found: Probe, bundle: Bundle) -> bool:
    """Install the bundle's build into ``builds/<id>`` beside the running one; False when
    it was there already."""
    build_id = bundle.build_id
    build = f"{found.app_dir}/builds/{build_id}"
    links = "\n".join(f"ln -f wheels/{q(pooled(w))} {q(build + '/wheels/' + w.name)}" for w in bundle.wheels)
    pip = f"{q(build + '/venv/bin/python')} {q(build + '/wheels/' + bundle.pip.name)}/pip install"
    if bundle.index_url:
        constraints = "\n".join(bundle.constraints)
        where = (
            f"--index-url {q(bundle.index_url)} --find-links {q(build + '/wheels')} -c {q(build + '/constraints.txt')}"
        )
        extra = f"printf '%s\\n' {q(constraints)} > {q(build + '/constraints.txt')}\n"
    else:
        where = f"--isolated --no-index --find-links {q(build + '/wheels')}"
        extra = ""
    log = f"log/install-{build_id}.log"
    script = f"""set -eu
cd {q(found.app_dir)}
mkdir -p builds log run
if [ -f {q(build + "/.complete")} ]; then echo unchanged; exit 0; fi
rm -rf {q(build)}
mkdir -p {q(build + "/wheels")}
{links}
{extra}{q(found.python)} -m venv --without-pip {q(build + "/venv")}
if ! {pip} --no-cache-dir --disable-pip-version-check --no-warn-script-location {where} \
    {" ".join(q(r) for r in bundle.requirements)} > {log} 2>&1; then
  tail -n 25 {log} >&2
  exit 1
fi
touch {q(build + "/.complete")}
echo installed
"""
    ran = await host.run(script, timeout=1800)
    if ran.status != 0:
        last = (ran.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise HostFailed("install", f"pip could not install build {build_id}: {last}", ran.stderr[-4000:])
    return "installed" in ran.stdout


def node_config(target: Target, found: Probe) -> tuple[str, str]:
    """node.yaml and node.env for ``target`` (the same whichever nodes.yaml named it)."""
    import yaml

    settings: dict[str, Any] = {
        "host": target.bind,
        "port": target.port,
        "data_dir": found.data_dir,
        "capacity": target.slots,
        **target.config,
    }
    text = "# Written by `envhub deploy`; the next deploy writes it again.\n" + yaml.safe_dump(
        settings, sort_keys=False
    )
    return text, f"ENVHUB_API_KEY={target.api_key}\n"


async def configure(host: Host, found: Probe, target: Target) -> bool:
    """Write node.yaml and node.env (0600); whether either changed."""
    config, env = node_config(target, found)
    script = f"""set -eu
umask 077
cd {q(found.app_dir)}
{_write("node.yaml", config)}
{_write("node.env", env)}
mkdir -p {q(found.data_dir)}
chmod 700 {q(found.data_dir)}
"""
    ran = await host.run(script, timeout=60)
    if ran.status != 0:
        raise HostFailed("configure", f"cannot write the node's config: {ran.stderr.strip()[-300:]}")
    return "changed" in ran.stdout


def _write(name: str, text: str) -> str:
    encoded = base64.b64encode(text.encode()).decode()
    return (
        f"printf '%s' {encoded} | base64 -d > {name}.new\n"
        f"if cmp -s {name}.new {name}; then rm -f {name}.new; else mv {name}.new {name}; echo changed; fi"
    )


async def start(host: Host, found: Probe, build_id: str) -> int | None:
    """Start the node on ``build_id`` (stopping the one running first); returns its pid."""
    await stop(host, found)
    app = found.app_dir
    build = f"{app}/builds/{build_id}"
    envhub = f"{build}/venv/bin/envhub"
    if found.init == "systemd":
        script = f"""set -eu
cd {q(app)}
ln -sfn builds/{build_id} current
{q(envhub)} systemd install --role node --config {q(app + "/node.yaml")} --env-file {q(app + "/node.env")} \
  --data-dir {q(found.data_dir)} --name {UNIT} > /dev/null
systemctl daemon-reload
systemctl enable {UNIT} > /dev/null 2>&1
systemctl restart {UNIT}
systemctl show -p MainPID --value {UNIT}
"""
    else:
        script = f"""set -eu
cd {q(app)}
ln -sfn builds/{build_id} current
mkdir -p run log
set -a; . ./node.env; set +a
echo "--- $(date -u +%FT%TZ) starting build {build_id}" >> log/node.log
nohup setsid {q(envhub)} serve --role node --config {q(app + "/node.yaml")} >> log/node.log 2>&1 < /dev/null &
echo $! > run/node.pid
echo $!
"""
    ran = await host.run(script, timeout=600)
    if ran.status != 0:
        raise HostFailed("start", f"cannot start the node: {ran.stderr.strip()[-300:]}", await log_tail(host, found))
    out = ran.stdout.strip().splitlines()
    return int(out[-1]) if out and out[-1].isdigit() else None


async def stop(host: Host, found: Probe) -> str:
    """Stop the node (SIGTERM: it detaches its Docker episodes); what was done."""
    app = found.app_dir
    if found.init == "systemd":
        script = f"if systemctl is-active --quiet {UNIT}; then systemctl stop {UNIT}; echo stopped; fi\n"
    else:
        script = f"""cd {q(app)} 2>/dev/null || exit 0
[ -f run/node.pid ] || exit 0
pid=$(cat run/node.pid)
alive() {{ kill -0 "$1" 2>/dev/null && ! grep -q '^State:.*Z' /proc/"$1"/status 2>/dev/null; }}
ours() {{ tr '\\0' ' ' < /proc/"$1"/cmdline 2>/dev/null | grep -qF {q(app + "/builds/")}; }}
if alive "$pid" && ours "$pid"; then
  kill -TERM "$pid"
  i=0
  while alive "$pid" && [ $i -lt {STOP_TIMEOUT * 10} ]; do sleep 0.1; i=$((i+1)); done
  if alive "$pid"; then kill -KILL "$pid"; echo killed; else echo stopped; fi
fi
rm -f run/node.pid
"""
    ran = await host.run(script, timeout=STOP_TIMEOUT + 60)
    if ran.status != 0:
        raise HostFailed("stop", f"cannot stop the node: {ran.stderr.strip()[-300:]}")
    return ran.stdout.strip() or "not running"


def kept_entry(app_dir: str, data_dir: str) -> str:
    """The entry of ``app_dir`` that an uninstall keeps: the one that is or holds the data
    dir (whatever its spelling: ``/opt/envhub/data/``, ``/opt/envhub/var/data``), else a
    path no entry has."""
    app, data = posixpath.normpath(app_dir), posixpath.normpath(data_dir)
    if data == app or not data.startswith(app.rstrip("/") + "/"):
        return data if data != app else app + "/.envhub-none"
    return posixpath.join(app, data[len(app.rstrip("/")) + 1 :].split("/")[0])


async def uninstall(host: Host, found: Probe) -> None:
    """Remove the unit (systemd) and everything under ``app_dir`` but the data dir."""
    unit = ""
    if found.init == "systemd":
        unit = (
            f"systemctl disable {UNIT} > /dev/null 2>&1 || true\n"
            f"rm -f /etc/systemd/system/{UNIT}.service\nsystemctl daemon-reload\n"
        )
    kept = kept_entry(found.app_dir, found.data_dir)
    script = f"""set -eu
{unit}[ -d {q(found.app_dir)} ] || exit 0
find {q(found.app_dir)} -mindepth 1 -maxdepth 1 ! -path {q(kept)} -exec rm -rf {{}} +
rmdir {q(found.app_dir)} 2>/dev/null || true
"""
    ran = await host.run(script, timeout=300)
    if ran.status != 0:
        raise HostFailed("uninstall", f"cannot remove {found.app_dir}: {ran.stderr.strip()[-300:]}")


async def log_tail(host: Host, found: Probe, lines: int = 25) -> str:
    """The end of the node's log (its journal under systemd)."""
    if found.init == "systemd":
        script = f"journalctl -u {UNIT} -n {lines} --no-pager 2>&1 || true\n"
    else:
        script = f"tail -n {lines} {q(found.app_dir + '/log/node.log')} 2>&1 || true\n"
    try:
        return (await host.run(script, timeout=30)).stdout
    except Exception:  # the tail is a courtesy: never hide the failure it explains
        return ""


async def _check(host: Host, step: str, script: str) -> str:
    ran = await host.run(script, timeout=120)
    if ran.status != 0:
        raise HostFailed(step, ran.stderr.strip().splitlines()[-1] if ran.stderr.strip() else f"exit {ran.status}")
    return ran.stdout
