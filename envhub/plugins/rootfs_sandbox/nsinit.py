"""The rootfs sandbox's zygote: forks each episode into namespaces of its own over a
copy-on-write root filesystem. Standard library only, run as ``python -I nsinit.py FD``
by the node (``FD``: its end of the control socket; ``SCRATCH``: see ``create``), as the
node's user: ``python -I nsinit.py FD SCRATCH``.

One episode is three processes:

- **C**, forked by the zygote: joins the episode's cgroup, unshares the user, mount, pid,
  network, ipc and uts namespaces (all owned by the new user namespace), waits until the
  zygote has written its uid and gid maps, becomes root there and forks G; then waits
  for G and exits with it. It dies with the zygote (``PR_SET_PDEATHSIG``).
- **G**, pid 1 of the episode's pid namespace: mounts a tmpfs of the episode's size as
  scratch, an overlay (the image rootfs below, the scratch's ``upper`` above) as the
  root, a fresh ``/proc``, a small ``/dev`` (the host's null, zero, full, random,
  urandom and tty bound in, its own ``pts`` and ``shm``), ``pivot_root``\\s into it and
  detaches the old root, brings loopback up (no other network exists), then forks the
  agent and reaps every process of the namespace until the agent exits. It dies with C.
- **the agent**, pid 2: ``sh`` speaking the shell agent's line protocol on its stdin and
  stdout (the node's socket), in the image's workdir, with the image's environment.

Every mount lives in the episode's mount namespace only: when G exits (the agent ended,
the node killed G, C or the zygote died), the kernel kills every process of the pid
namespace and the mounts go with the last of them. Nothing of an episode is left on the
host's filesystem, whatever killed it.

Control messages (``SOCK_SEQPACKET``, one JSON object each, replies matched by ``id``):

- ``{"op": "create", "id", "lower": [dirs], "scratch", "size_mb", "hostname", "uid_map",
  "gid_map", "cgroups": [dirs], "nproc", "env": {...}, "workdir", "modes": {path: mode},
  "hide": [paths], "script"}`` -> ``{"id", "pid"}``
  and the node's end of the agent's socket as an fd; ``pid`` is G's, in the zygote's pid
  namespace. ``lower`` lists overlay lower dirs, top first. ``scratch``: an empty dir of
the host over which G mounts the episode's tmpfs, in its own mount namespace only (every
episode uses the same one: nothing per episode exists on the host). ``uid_map``/``gid_map``: the
  lines to write (``None``: the zygote's own uid as root, with setgroups denied).
``cgroups``: the cgroup dirs C joins first, so that everything of the episode is charged
to them (the scratch tmpfs's pages included). ``nproc``: where no cgroup limits the
episode's processes (a node without root), C sets RLIMIT_NPROC to it once it is root of its
new user namespace: since Linux 5.14 processes are counted per user namespace, so the limit
holds for this episode's processes alone, and a fork bomb cannot take the host's pids (or
its node's, which runs as the same host uid). ``modes``: paths of the root whose mode G
sets (the image store keeps lower layers without group or other write bits; ``/tmp`` is
1777 again in the episode's upper layer). ``hide``:
  paths over which G mounts an empty read-only tmpfs (the host's own files, when the
  lower layer is the host's root). ``network`` (absent: loopback only): ``{"blackhole":
  [IPv4 CIDRs], "nameserver"}``: G adds a blackhole route for each CIDR (the node's
  slirp4netns then gives the namespace its ``tap0`` and default route, which these
  more specific routes win over) and writes ``/etc/resolv.conf`` naming the nameserver;
  the agent's processes lose ``CAP_NET_RAW`` as well, so that no packet socket sends
  past those routes. Without ``CAP_NET_ADMIN`` they cannot remove them.
  ``hosts``: names G maps to 127.0.0.1 in the episode's ``/etc/hosts`` (its sidecars').
- A sidecar (a compose service beside the episode) is a create with ``"join": pid`` (the
  G of its episode, one this zygote made) and ``"service": {"argv", "env", "workdir",
  "user"}``: its C joins that episode's user and network namespaces instead of making
  its own (no uid maps are written: the episode's hold) and unshares only mount, pid, ipc
  and uts, so it has the episode's network and ids but a root, processes and hostname of
  its own, out of the episode's sight and the episode out of its. Its G forks the
  service as ``user`` (Docker's forms: a name or uid, ``:group`` optional, looked up in
  its own root), its output through a pipe that G copies to ``SERVICE_DIR/log`` (a
  tmpfs of ``SERVICE_LOG_MB``; G keeps the log's end, cut to ``SERVICE_LOG_KEEP`` bytes
  whenever it passes ``SERVICE_LOG_MAX``, with a line saying so, so a service that
  writes without end neither fills it nor blocks), and writes its exit code to
  ``SERVICE_DIR/exit`` when it ends, after the output it wrote before; the agent beside it runs
  the sidecar's healthchecks. The sidecar ends when its G is killed, as an episode does.
- ``{"op": "kill", "id", "pid"}`` -> ``{"id"}``: SIGKILL to G, which ends the episode.
- ``{"op": "listen", "id", "pid", "port"}`` -> ``{"id"}`` and a TCP socket listening on
  ``127.0.0.1:port`` in the network namespace of G ``pid`` (one this zygote made), as an
  fd: made by a child that joins the episode's user and network namespaces, so only what
  runs there reaches it, while the node that holds it serves it (proxy.py).

The hello, sent first: ``{"ready": true, "pid", "uid"}`` or ``{"ready": false, "error"}``
when this kernel or user cannot make such namespaces (checked by making one).
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import json
import os
import resource
import select
import signal
import socket
import stat
import struct
import sys
import tempfile
import time
from typing import NoReturn

CLONE_NEWNS = 0x00020000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
MS_RDONLY = 0x1
MS_NOSUID = 0x2
MS_NODEV = 0x4
MS_NOEXEC = 0x8
MS_REMOUNT = 0x20
MS_BIND = 0x1000
MS_REC = 0x4000
MS_PRIVATE = 0x40000
_MS_NOATIME, _MS_NODIRATIME, _MS_RELATIME = 0x400, 0x800, 0x200000
_ST_RELATIME = 0x1000  # statvfs's f_flag has the MS_ bits below 0x1000, relatime here
MNT_DETACH = 2
PR_SET_PDEATHSIG = 1
PR_SET_NO_NEW_PRIVS = 38
PR_CAPBSET_DROP = 24
# The capabilities an episode's processes keep: Docker's default set (chown, dac_override,
# fowner, fsetid, kill, setgid, setuid, setpcap, net_bind_service, net_raw, sys_chroot,
# mknod, audit_write, setfcap). Without CAP_SYS_ADMIN they cannot unmount what covers the
# host's files or /proc/sys; and G, which keeps every capability, is out of their reach
# (ptrace, /proc/1/root, its fds: the kernel wants CAP_SYS_PTRACE of a caller that
# lacks a capability its target has).
KEPT_CAPS = frozenset({0, 1, 3, 4, 5, 6, 7, 8, 10, 13, 18, 27, 29, 31})
CAP_NET_RAW = 13
# Under /proc: what Docker masks. With root's identity uid map the episode's uid 0 is the
# host's root for these files' permission checks (kernel.core_pattern would run a program
# as the host's root; sysrq-trigger would crash it): /proc/sys read-only, the rest /dev/null.
PROC_MASKED = ("sysrq-trigger", "kcore", "kmsg", "timer_list", "sched_debug", "keys")
SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41}.get(os.uname().machine)
DEVICES = ("null", "zero", "full", "random", "urandom", "tty")
STEP_TIMEOUT = 10.0  # seconds a child may take between two steps of a create
MAX_MESSAGE = 128 << 10
AGENT_DIR = "/run/envhub-agent"
SERVICE_DIR = "/run/envhub-service"
SERVICE_LOG_MB = 16
# G cuts a sidecar's log to its last SERVICE_LOG_KEEP bytes whenever it grows past
# SERVICE_LOG_MAX, so a chatty service never fills the tmpfs its exit code goes to too.
SERVICE_LOG_MAX = (SERVICE_LOG_MB // 2) << 20
SERVICE_LOG_KEEP = 2 << 20

_libc = ctypes.CDLL(None, use_errno=True)


class Failed(Exception):
    """A step of a create failed; the message says which and why."""


def _check(rc: int, what: str) -> None:
    if rc != 0:
        err = ctypes.get_errno()
        raise Failed(f"{what}: {os.strerror(err)}")


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    rc = _libc.mount(
        source.encode() if source else None,
        target.encode(),
        fstype.encode() if fstype else None,
        ctypes.c_ulong(flags),
        data.encode() if data else None,
    )
    _check(rc, f"mount {fstype or source} on {target}")


def _prctl(option: int, arg: int) -> None:
    _check(_libc.prctl(option, ctypes.c_ulong(arg), 0, 0, 0), f"prctl({option})")


def _loopback_up() -> None:
    """Loopback is down in a new network namespace; episodes expect 127.0.0.1 to work."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        request = struct.pack("16sH14s", b"lo", 0x1 | 0x40, b"")  # IFF_UP | IFF_RUNNING
        fcntl.ioctl(sock, 0x8914, request)  # SIOCSIFFLAGS
    finally:
        sock.close()


def _blackhole_routes(cidrs: list[str]) -> None:
    """A blackhole route for each IPv4 CIDR in this network namespace, through rtnetlink
    (no ``ip`` binary: the image may have none)."""
    sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, 0)  # NETLINK_ROUTE
    try:
        sock.bind((0, 0))
        for seq, cidr in enumerate(cidrs, 1):
            address, _, length = cidr.partition("/")
            # struct rtmsg: family, dst_len, src_len, tos, table (main), protocol (static),
            # scope (universe), type (blackhole), flags; then one RTA_DST attribute.
            body = struct.pack("=BBBBBBBBI", socket.AF_INET, int(length), 0, 0, 254, 4, 0, 6, 0)
            body += struct.pack("=HH", 8, 1) + socket.inet_aton(address)
            flags = 0x1 | 0x4 | 0x400 | 0x200  # NLM_F_REQUEST | NLM_F_ACK | NLM_F_CREATE | NLM_F_EXCL
            sock.send(struct.pack("=IHHII", 16 + len(body), 24, flags, seq, 0) + body)  # RTM_NEWROUTE
            reply = sock.recv(4096)
            kind, error = struct.unpack_from("=H", reply, 4)[0], struct.unpack_from("=i", reply, 16)[0]
            if kind != 2 or error != 0:  # NLMSG_ERROR carries the ack; 0 is success
                raise Failed(f"adding a blackhole route for {cidr}: {os.strerror(-error) if error else 'no ack'}")
    finally:
        sock.close()


def _resolv_conf(nameserver: str) -> None:
    """The episode's ``/etc/resolv.conf`` (in its own root, after pivot_root: a symlink
    the image has there then leads nowhere outside it), naming ``nameserver``."""
    os.makedirs("/etc", exist_ok=True)
    if os.path.islink("/etc/resolv.conf"):
        os.unlink("/etc/resolv.conf")
    with open("/etc/resolv.conf", "w") as f:
        f.write(f"nameserver {nameserver}\n")
    os.chmod("/etc/resolv.conf", 0o644)


def _write(path: str, text: str) -> None:
    fd = os.open(path, os.O_WRONLY)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


# -- inside the episode ----------------------------------------------------------------------


def _build_root(req: dict, scratch: str) -> str:
    """G: the episode's root, mounted at ``<scratch>/root``; returns that path."""
    _mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing we mount propagates out
    _mount("tmpfs", scratch, "tmpfs", MS_NOSUID | MS_NODEV, f"size={int(req['size_mb'])}m,mode=0755")
    for name in ("upper", "work", "root"):
        os.mkdir(os.path.join(scratch, name), 0o755)
    root = os.path.join(scratch, "root")
    if req.get("host"):
        _host_root(req, scratch, root)
    else:
        lower = ":".join(req["lower"])
        _overlay(root, f"lowerdir={lower},upperdir={scratch}/upper,workdir={scratch}/work")
    for path, mode in (req.get("modes") or {}).items():
        # Dirs and plain files only: a device node cannot be copied up (no mknod here), and
        # /dev is the episode's own anyway.
        target = os.path.join(root, path.lstrip("/"))
        try:
            kind = os.lstat(target).st_mode
        except FileNotFoundError:
            continue
        if stat.S_ISDIR(kind) or stat.S_ISREG(kind):
            os.chmod(target, int(mode))
    for path in req.get("hide") or ():  # the host's own files, when its root is the lower layer
        target = os.path.join(root, path.lstrip("/"))
        if os.path.isdir(target):
            _mount("tmpfs", target, "tmpfs", MS_NOSUID | MS_NODEV | MS_RDONLY, "size=4k,mode=0755")
        elif os.path.lexists(target):
            _mount("/dev/null", target, None, MS_BIND)
    for name in ("proc", "dev", "tmp"):
        os.makedirs(os.path.join(root, name), exist_ok=True)
    _mount("proc", f"{root}/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    _mount(f"{root}/proc/sys", f"{root}/proc/sys", None, MS_BIND | MS_REC)
    _mount(None, f"{root}/proc/sys", None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC)
    for name in PROC_MASKED:
        if os.path.lexists(f"{root}/proc/{name}"):
            _mount("/dev/null", f"{root}/proc/{name}", None, MS_BIND)
    _mount("tmpfs", f"{root}/dev", "tmpfs", MS_NOSUID, "size=64k,mode=0755")
    for dev in DEVICES:
        target = f"{root}/dev/{dev}"
        os.close(os.open(target, os.O_CREAT | os.O_WRONLY, 0o666))
        _mount(f"/dev/{dev}", target, None, MS_BIND)
    os.mkdir(f"{root}/dev/pts")
    os.mkdir(f"{root}/dev/shm")
    _mount("devpts", f"{root}/dev/pts", "devpts", MS_NOSUID | MS_NOEXEC, "newinstance,ptmxmode=0666,mode=0620")
    _mount("tmpfs", f"{root}/dev/shm", "tmpfs", MS_NOSUID | MS_NODEV, f"size={int(req['size_mb'])}m,mode=1777")
    os.symlink("pts/ptmx", f"{root}/dev/ptmx")
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"), ("stdout", "/proc/self/fd/1")):
        os.symlink(target, f"{root}/dev/{name}")
    os.symlink("/proc/self/fd/2", f"{root}/dev/stderr")
    # The agent's own files (its commands' outputs) on a filesystem of their own: an
    # episode that fills its writable layer still gets its commands' output back.
    os.makedirs(f"{root}{AGENT_DIR}", exist_ok=True)
    _mount("tmpfs", f"{root}{AGENT_DIR}", "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, "size=64m,mode=0700")
    if req.get("service"):  # a sidecar's output and exit code, on a filesystem of their own too
        os.makedirs(f"{root}{SERVICE_DIR}", exist_ok=True)
        _mount(
            "tmpfs",
            f"{root}{SERVICE_DIR}",
            "tmpfs",
            MS_NOSUID | MS_NODEV | MS_NOEXEC,
            f"size={SERVICE_LOG_MB}m,mode=0755",
        )
    return root


def _host_root(req: dict, scratch: str, root: str) -> None:
    """The host's own system as the lower layer, dir by dir (an allow-list): each of
    ``host_dirs`` that exists is an overlay of the host's dir (written to this episode's
    upper dir only), a symlink stays a symlink, and everything else of the root (``/tmp``,
    ``/root``, ``/home``, ``/app``, ...) is the episode's own, in its tmpfs."""
    _mount(root, root, None, MS_BIND | MS_REC)  # pivot_root needs the new root to be a mount
    for top in req.get("host_dirs") or ():
        name = top.strip("/")
        if name and "/" not in name:
            _host_overlay(scratch, name, depth=2)
    for name in ("tmp", "root", "home", "run", "app", "mnt", "srv"):
        os.makedirs(os.path.join(root, name), exist_ok=True)
    os.chmod(os.path.join(root, "tmp"), 0o1777)


def _host_overlay(scratch: str, rel: str, *, depth: int) -> None:
    """``/<rel>`` of the host at ``<scratch>/root/<rel>``: an overlay of it, or where the
    kernel refuses one (a dir holding another overlay's upper or work dir, such as a
    container engine's storage under /var/lib), its children one by one, ``depth`` levels
    down at most; what is still refused is left out."""
    source, target = "/" + rel, os.path.join(scratch, "root", rel)
    if os.path.islink(source):
        os.symlink(os.readlink(source), target)
        return
    if not os.path.isdir(source):
        return
    for part in ("upper", "work", "root"):
        os.makedirs(os.path.join(scratch, part, rel), 0o755, exist_ok=True)
    try:
        _overlay(target, f"lowerdir={source},upperdir={scratch}/upper/{rel},workdir={scratch}/work/{rel}")
        return
    except Failed:
        if depth <= 0:
            return
    for child in sorted(os.listdir(source)):
        path = os.path.join(source, child)
        if os.path.islink(path) or os.path.isdir(path):
            _host_overlay(scratch, f"{rel}/{child}", depth=depth - 1)
        elif os.path.isfile(path):
            os.close(os.open(os.path.join(target, child), os.O_CREAT | os.O_WRONLY, 0o644))
            _read_only_bind(path, os.path.join(target, child))


def _read_only_bind(source: str, target: str) -> None:
    """``source`` bound at ``target``, read-only: a host file with no overlay over it
    must not be written through (an episode's root is the host's root for its permission
    checks). The remount keeps the flags the source's mount has, which a user namespace
    may not drop (the kernel refuses the remount otherwise)."""
    _mount(source, target, None, MS_BIND)
    flags = os.statvfs(source).f_flag
    kept = flags & (MS_NOSUID | MS_NODEV | MS_NOEXEC | _MS_NOATIME | _MS_NODIRATIME)
    if flags & _ST_RELATIME:
        kept |= _MS_RELATIME
    _mount(None, target, None, MS_BIND | MS_REMOUNT | MS_RDONLY | kept)


def _overlay(target: str, options: str) -> None:
    """An overlay at ``target``, its metadata in ``user.*`` xattrs (``userxattr``: what a
    user namespace may write; without it every mount logs that ``trusted.*`` failed),
    and without that option where the kernel lacks it (before Linux 5.11)."""
    try:
        _mount("overlay", target, "overlay", 0, f"{options},userxattr")
    except Failed:
        _mount("overlay", target, "overlay", 0, options)


def _pivot(root: str) -> None:
    os.chdir(root)
    if SYS_PIVOT_ROOT is None:
        raise Failed(f"pivot_root: unknown on {os.uname().machine}")
    _check(_libc.syscall(SYS_PIVOT_ROOT, b".", b"."), "pivot_root")
    _check(_libc.umount2(b".", MNT_DETACH), "detaching the old root")
    os.chdir("/")


def _init(req: dict, scratch: str, agent_fd: int, report: int) -> None:
    """G, pid 1 of the episode: build its root, start the agent, reap until it exits."""
    try:
        _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        root = _build_root(req, scratch)
        _pivot(root)
        hostname = str(req.get("hostname") or "envhub")[:64].encode()
        _check(_libc.sethostname(hostname, len(hostname)), "sethostname")
        _loopback_up()
        network = req.get("network")
        if network:
            _blackhole_routes([str(c) for c in network.get("blackhole") or ()])
            _resolv_conf(str(network["nameserver"]))
        if req.get("hosts"):
            _hosts([str(name) for name in req["hosts"]])
        env = {str(k): str(v) for k, v in (req.get("env") or {}).items()}
        env["ENVHUB_AGENT_DIR"] = AGENT_DIR
        workdir = str(req.get("workdir") or "/")
        try:
            os.chdir(workdir)
        except OSError:
            os.makedirs(workdir, exist_ok=True)
            os.chdir(workdir)
        _prctl(PR_SET_NO_NEW_PRIVS, 1)
        if req.get("script") is None:  # the start-up probe: namespaces and mounts were the point
            os.write(report, b"ok")
            os._exit(0)
        shell = next((p for p in ("/bin/sh", "/usr/bin/sh") if os.path.exists(p)), None)
        if shell is None:
            raise Failed("the image has no /bin/sh")
        agent = os.fork()
        if agent == 0:
            _drop_capabilities(KEPT_CAPS - {CAP_NET_RAW} if network else KEPT_CAPS)
            os.dup2(agent_fd, 0)
            os.dup2(agent_fd, 1)
            devnull = os.open("/dev/null", os.O_WRONLY)
            os.dup2(devnull, 2)
            _default_signals()
            os.execve(shell, ["sh", "-c", req["script"]], env)
        service, output = _start_service(req["service"], network=bool(network)) if req.get("service") else (None, None)
    except BaseException as e:  # told to the zygote, which answers the create with it
        os.write(report, f"E{e}".encode()[:4000])
        os._exit(1)
    os.close(agent_fd)
    os.write(report, b"ok")
    os.close(report)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    _init_loop(agent, service, output)


def _init_loop(agent: int, service: int | None, output: int | None) -> NoReturn:
    """G's life as pid 1 of the namespace: reap everything; the agent's end is the
    episode's. A sidecar's G also copies its service's output to the log until nothing
    holds the pipe open, and records the service's exit after copying what it wrote."""
    log = _ServiceLog() if output is not None else None
    while True:
        flags = 0
        if output is not None and log is not None:
            try:
                ready, _, _ = select.select([output], [], [], 0.5)
            except InterruptedError:
                ready = []
            if ready and not log.copy(output):
                os.close(output)
                output = None
            flags = os.WNOHANG
        while True:
            try:
                pid, status = os.waitpid(-1, flags)
            except ChildProcessError:
                os._exit(0)
            except InterruptedError:
                continue
            if pid == 0:
                break
            if pid == agent:
                os._exit(os.waitstatus_to_exitcode(status) & 0xFF)
            if pid == service:
                if output is not None and log is not None:
                    log.copy(output)  # what it wrote before it ended, ahead of its exit code
                _exited(os.waitstatus_to_exitcode(status))
            if flags == 0:
                break


class _ServiceLog:
    """``SERVICE_DIR/log`` as G writes it: the service's output, its end kept."""

    def __init__(self) -> None:
        self.fd = os.open(f"{SERVICE_DIR}/log", os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o644)
        self.size = 0
        self.dropped = 0

    def copy(self, pipe: int) -> bool:
        """Copy what ``pipe`` (non-blocking) holds now; False once it is closed."""
        while True:
            try:
                data = os.read(pipe, 1 << 16)
            except BlockingIOError:
                return True
            except InterruptedError:
                continue
            if not data:
                return False
            self._write(data)

    def _write(self, data: bytes) -> None:
        try:
            os.write(self.fd, data)
            self.size += len(data)
            if self.size > SERVICE_LOG_MAX:
                keep = os.pread(self.fd, SERVICE_LOG_KEEP, self.size - SERVICE_LOG_KEEP)
                self.dropped += self.size - len(keep)
                note = f"[envhub: the first {self.dropped} bytes of this log were dropped]\n".encode()
                os.ftruncate(self.fd, 0)
                os.write(self.fd, note + keep)
                self.size = len(note) + len(keep)
        except OSError:
            pass  # a log that cannot be written must not end the sidecar


def _hosts(names: list[str]) -> None:
    """``names`` mapped to 127.0.0.1 in this root's ``/etc/hosts`` (a sidecar listens on
    the loopback its episode shares), after what the image has there."""
    path = "/etc/hosts"
    if os.path.islink(path):
        os.unlink(path)
    try:
        with open(path) as f:
            kept = f.read()
    except OSError:
        kept = "127.0.0.1\tlocalhost\n"
    if kept and not kept.endswith("\n"):
        kept += "\n"
    os.makedirs("/etc", exist_ok=True)
    with open(path, "w") as f:
        f.write(kept + "".join(f"127.0.0.1\t{name}\n" for name in names))
    os.chmod(path, 0o644)


def _start_service(service: dict, *, network: bool) -> tuple[int, int]:
    """G of a sidecar: fork its service (see the module's docstring); returns its pid and
    the read end of the pipe its output goes to (non-blocking)."""
    argv = [str(a) for a in service.get("argv") or ()]
    if not argv:
        raise Failed("the sidecar has no command (its image names none and the service gives none)")
    env = {str(k): str(v) for k, v in (service.get("env") or {}).items()}
    program = _which(argv[0], env.get("PATH", ""))  # the node always sets one (sidecars.service_of)
    if program is None:
        raise Failed(f"the sidecar's command {argv[0]!r} is not in its image")
    uid, gid, groups = _user_ids(str(service.get("user") or ""))
    workdir = str(service.get("workdir") or "/")
    os.makedirs(workdir, exist_ok=True)
    output, out = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(output)
            os.dup2(out, 1)
            os.dup2(out, 2)
            if out > 2:
                os.close(out)
            os.dup2(os.open("/dev/null", os.O_RDONLY), 0)
            os.setsid()
            _drop_capabilities(KEPT_CAPS - {CAP_NET_RAW} if network else KEPT_CAPS)
            os.chdir(workdir)
            if groups is not None:
                os.setgroups(groups)
            os.setresgid(gid, gid, gid)
            os.setresuid(uid, uid, uid)
            _default_signals()
            os.execve(program, argv, env)
        except BaseException as e:
            os.write(2, f"envhub: the sidecar's command did not start: {e}\n".encode())
        finally:
            os._exit(127)
    os.close(out)
    os.set_blocking(output, False)
    return pid, output


def _exited(code: int) -> None:
    """Record the sidecar's service's exit code where the node reads it (atomically)."""
    try:
        with open(f"{SERVICE_DIR}/exit.tmp", "w") as f:
            f.write(str(code))
        os.rename(f"{SERVICE_DIR}/exit.tmp", f"{SERVICE_DIR}/exit")
    except OSError:
        pass  # nothing to do about it here: the node then sees the service as running


def _which(name: str, path: str) -> str | None:
    if "/" in name:
        return name if os.access(name, os.X_OK) else None
    for folder in path.split(":"):
        candidate = os.path.join(folder or ".", name)
        if os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            return candidate
    return None


def _user_ids(user: str, etc: str = "/etc") -> tuple[int, int, list[int] | None]:
    """uid, gid and supplementary groups of Docker's ``user`` (``name``, ``uid``,
    ``name:group``, ``uid:gid``; empty: root), looked up in this root's ``etc``/passwd and
    ``etc``/group; a uid they do not name has gid 0, as on Docker. The groups are None
    where this user namespace may not set them (one that maps a single id: the node
    without root)."""
    name, _, group = user.partition(":")
    passwd = _table(f"{etc}/passwd")
    uid = gid = 0
    if name:
        row = next((r for r in passwd if r[0] == name), None)
        if row is None and name.isdigit():
            row = next((r for r in passwd if len(r) > 2 and r[2] == name), None) or [name, "", name, "0"]
        if row is None or len(row) < 4:
            raise Failed(f"the sidecar's user {name!r} is not in its image's /etc/passwd")
        uid, gid = int(row[2]), int(row[3])
    if group:
        if group.isdigit():
            gid = int(group)
        else:
            grow = next((r for r in _table(f"{etc}/group") if r[0] == group), None)
            if grow is None:
                raise Failed(f"the sidecar's group {group!r} is not in its image's /etc/group")
            gid = int(grow[2])
    for kind, value in (("uid", uid), ("gid", gid)):
        if not _mapped(f"/proc/self/{kind}_map", value):
            raise Failed(
                f"the sidecar's user {user!r} ({kind} {value}) has no id here: a node without root "
                "maps its own uid only, as the episode's root (run the node as root)"
            )
    with open("/proc/self/setgroups") as f:
        may_set_groups = f.read().strip() == "allow"
    groups = None
    if may_set_groups:
        member = {r[0] for r in passwd if len(r) > 2 and r[2] == str(uid)}
        groups = sorted(
            {gid} | {int(r[2]) for r in _table(f"{etc}/group") if len(r) > 3 and member & set(r[3].split(","))}
        )
    return uid, gid, groups


def _mapped(path: str, value: int) -> bool:
    with open(path) as f:
        for line in f:
            inside, _, count = (int(x) for x in line.split())
            if inside <= value < inside + count:
                return True
    return False


def _table(path: str) -> list[list[str]]:
    try:
        with open(path) as f:
            return [line.rstrip("\n").split(":") for line in f if line.strip() and not line.startswith("#")]
    except OSError:
        return []


def _default_signals() -> None:
    """Before an exec: what Python ignores from its start (SIGPIPE, SIGXFSZ) back to the
    default. An ignored signal stays ignored across exec, and the writer of a pipeline
    whose reader has gone must end by SIGPIPE, as on Docker (``yes | head -1``), not
    live on to fail with EPIPE."""
    for sig in (signal.SIGPIPE, signal.SIGXFSZ):
        signal.signal(sig, signal.SIG_DFL)


def _drop_capabilities(kept: frozenset[int]) -> None:
    """Leave only ``kept`` in the bounding set: what the agent execs (and all it starts)
    has no other capability, whatever its uid."""
    for cap in range(64):
        if cap not in kept and _libc.prctl(PR_CAPBSET_DROP, ctypes.c_ulong(cap), 0, 0, 0) != 0:
            if ctypes.get_errno() == errno.EINVAL:  # past the kernel's last capability
                break
            _check(-1, f"dropping capability {cap}")


def _only_fds(keep: set[int]) -> None:
    """Keep ``keep`` and nothing else of what the zygote had open: fds 0-2 become
    /dev/null (not the node's log) and every other fd is closed, the control socket first.
    Episode code reaches its init's fds through /proc/1/fd: none of them may be the
    node's."""
    devnull = os.open("/dev/null", os.O_RDWR)
    for fd in (0, 1, 2):
        if fd not in keep:
            os.dup2(devnull, fd)
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd > 2 and fd not in keep:
            try:
                os.close(fd)
            except OSError:
                pass


def _join(pid: int) -> None:
    """Into the user, then the network namespace of episode init ``pid``: its owner (the
    node's uid, or root) has every capability in that user namespace, which entering its
    network namespace then needs."""
    for kind, flag in (("user", CLONE_NEWUSER), ("net", CLONE_NEWNET)):
        fd = os.open(f"/proc/{pid}/ns/{kind}", os.O_RDONLY | os.O_CLOEXEC)
        try:
            _check(_libc.setns(fd, flag), f"entering the episode's {kind} namespace")
        finally:
            os.close(fd)


def _episode(req: dict, agent_fd: int, to_zygote: int, from_zygote: int, report: int) -> None:
    """C: into the episode's cgroup and namespaces, then G."""
    try:
        _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        _only_fds({agent_fd, to_zygote, from_zygote, report})
        for group in req.get("cgroups") or ():  # before anything is forked: all of it is charged
            _write(os.path.join(group, "cgroup.procs"), "0")
        flags = CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS
        if req.get("join"):  # a sidecar: its episode's ids and network, the rest its own
            _join(int(req["join"]))
            flags &= ~(CLONE_NEWUSER | CLONE_NEWNET)
        _check(_libc.unshare(flags), "unshare")
        os.write(to_zygote, b"u")
        if os.read(from_zygote, 1) != b"m":
            raise Failed("the zygote did not write the uid map")
        os.setresgid(0, 0, 0)
        if req.get("gid_map") is not None:
            os.setgroups([])
        os.setresuid(0, 0, 0)
        if req.get("nproc"):  # lowering needs no privilege; counted in this user namespace
            resource.setrlimit(resource.RLIMIT_NPROC, (int(req["nproc"]), int(req["nproc"])))
        init = os.fork()
        if init == 0:
            os.close(to_zygote)  # C's own line to the zygote: the episode never holds it
            os.close(from_zygote)
            _init(req, req["scratch"], agent_fd, report)
        os.close(agent_fd)
        os.close(report)
        os.write(to_zygote, str(init).encode())
        os.close(to_zygote)
    except BaseException as e:
        try:
            os.write(report, f"E{e}".encode()[:4000])
        finally:
            os._exit(1)
    while True:
        try:
            _, status = os.waitpid(init, 0)
            break
        except InterruptedError:
            continue
    os._exit(0)


# -- the zygote ------------------------------------------------------------------------------


def _read_within(fd: int, n: int, timeout: float) -> bytes:
    ready, _, _ = select.select([fd], [], [], timeout)
    if not ready:
        raise Failed("a child of the create did not answer in time")
    return os.read(fd, n)


def _maps(req: dict, pid: int) -> None:
    uid_map, gid_map = req.get("uid_map"), req.get("gid_map")
    if uid_map is None or gid_map is None:  # one id, our own: all an unprivileged user may map
        _write(f"/proc/{pid}/setgroups", "deny")
        uid_map, gid_map = f"0 {os.getuid()} 1\n", f"0 {os.getgid()} 1\n"
    _write(f"/proc/{pid}/uid_map", str(uid_map))
    _write(f"/proc/{pid}/gid_map", str(gid_map))


def create(req: dict) -> tuple[int, socket.socket, int]:
    """Fork one episode; returns G's pid, the node's end of the agent socket, and C's pid."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    up_r, up_w = os.pipe()  # C -> zygote: "u" (unshared), then G's pid
    down_r, down_w = os.pipe()  # zygote -> C: "m" (maps written)
    rep_r, rep_w = os.pipe2(os.O_CLOEXEC)  # G -> zygote: "ok" once the agent runs, or the error
    child = os.fork()
    if child == 0:
        try:
            ours.close()
            for fd in (up_r, down_w, rep_r):
                os.close(fd)
            _episode(req, theirs.fileno(), up_w, down_r, rep_w)
        finally:
            os._exit(1)
    theirs.close()
    for fd in (up_w, down_r, rep_w):
        os.close(fd)
    try:
        if _read_within(up_r, 1, STEP_TIMEOUT) != b"u":
            raise Failed(_reported(rep_r) or "the episode's first process failed before unsharing")
        if not req.get("join"):  # a sidecar's user namespace is its episode's, mapped already
            _maps(req, child)
        os.write(down_w, b"m")
        got = _read_within(up_r, 16, STEP_TIMEOUT)
        if not got:
            raise Failed(_reported(rep_r) or "the episode's first process failed")
        init = int(got)
        outcome = _read_within(rep_r, 4096, STEP_TIMEOUT)
        if outcome != b"ok":
            raise Failed(outcome[1:].decode(errors="replace") if outcome else "the episode's init died")
    except BaseException:
        ours.close()
        os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)
        raise
    finally:
        for fd in (up_r, down_w, rep_r):
            os.close(fd)
    return init, ours, child


def listen_in(pid: int, port: int) -> socket.socket:
    """A socket listening on 127.0.0.1:``port`` in the network namespace of episode init
    ``pid``, made by a child of ours that enters it (the zygote itself stays where it is)."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
    child = os.fork()
    if child == 0:
        try:
            ours.close()
            _only_fds({theirs.fileno()})
            _join(pid)
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(("127.0.0.1", port))
            sock.listen(128)
            socket.send_fds(theirs, [b"ok"], [sock.fileno()])
        except BaseException as e:
            theirs.send(f"E{e}".encode()[:4000])
        finally:
            os._exit(0)
    theirs.close()
    try:
        ready, _, _ = select.select([ours], [], [], STEP_TIMEOUT)
        msg, fds, _, _ = socket.recv_fds(ours, 4096, 1) if ready else (b"", [], 0, None)
    finally:
        ours.close()
        try:
            os.kill(child, signal.SIGKILL)  # done or stuck: either way it has nothing more to do
            os.waitpid(child, 0)
        except (ProcessLookupError, ChildProcessError):
            pass
    if msg != b"ok" or not fds:
        for fd in fds:
            os.close(fd)
        raise Failed(msg[1:].decode(errors="replace") if msg else "the listener's process did not answer")
    return socket.socket(fileno=fds[0])


def _reported(fd: int) -> str:
    try:
        ready, _, _ = select.select([fd], [], [], 1.0)
        data = os.read(fd, 4096) if ready else b""
    except OSError:
        data = b""
    return data[1:].decode(errors="replace") if data.startswith(b"E") else ""


class Zygote:
    def __init__(self, ctl: socket.socket) -> None:
        self.ctl = ctl
        self.children: dict[int, int] = {}  # C's pid -> G's pid

    def send(self, msg: dict, fds: tuple[int, ...] = ()) -> None:
        data = json.dumps(msg).encode()
        if fds:
            socket.send_fds(self.ctl, [data], list(fds))
        else:
            self.ctl.send(data)

    def reap(self) -> None:
        while True:
            try:
                pid, _ = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            self.children.pop(pid, None)

    def handle(self, req: dict) -> None:
        rid = req.get("id")
        try:
            if req.get("op") == "create":
                if req.get("join") is not None and int(req["join"]) not in self.children.values():
                    raise Failed(f"no episode {req['join']} to join")  # only ours: a pid may be reused
                init, sock, child = create(req)
                self.children[child] = init
                try:
                    self.send({"id": rid, "pid": init}, (sock.fileno(),))
                finally:
                    sock.close()
            elif req.get("op") == "listen":
                pid = int(req["pid"])
                if pid not in self.children.values():
                    raise Failed(f"no episode {pid} to listen in")
                sock = listen_in(pid, int(req["port"]))
                try:
                    self.send({"id": rid}, (sock.fileno(),))
                finally:
                    sock.close()
            elif req.get("op") == "kill":
                pid = int(req["pid"])
                if pid in self.children.values():  # only what we forked: a pid may be reused
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                self.send({"id": rid})
            else:
                self.send({"id": rid, "error": f"unknown op {req.get('op')!r}"})
        except Failed as e:
            self.send({"id": rid, "error": str(e)})
        except OSError as e:
            self.send({"id": rid, "error": f"{type(e).__name__}: {e}"})

    def serve(self) -> None:
        signal.signal(signal.SIGCHLD, lambda *_: None)  # wakes the select below
        while True:
            self.reap()
            try:
                ready, _, _ = select.select([self.ctl], [], [], 1.0)
            except InterruptedError:
                continue
            if not ready:
                continue
            try:
                data = self.ctl.recv(MAX_MESSAGE)
            except InterruptedError:
                continue
            if not data:  # the node closed its end: end every episode, then ourselves
                self.shutdown()
                return
            self.handle(json.loads(data))

    def shutdown(self) -> None:
        for init in list(self.children.values()):
            try:
                os.kill(init, signal.SIGKILL)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 5
        while self.children and time.monotonic() < deadline:
            self.reap()
            time.sleep(0.01)


def probe(scratch: str) -> str | None:
    """Why this kernel or user cannot make an episode's namespaces, or None: one episode
    over an empty lower dir, made (no agent) and ended."""
    lower = tempfile.mkdtemp(prefix="envhub-rootfs-probe-")
    try:
        init, sock, child = create(
            {"lower": [lower], "scratch": scratch, "size_mb": 1, "hostname": "probe", "uid_map": _root_map(),
             "gid_map": _root_map(), "cgroups": [], "env": {}, "workdir": "/", "script": None}
        )  # fmt: skip
        sock.close()
        try:
            os.kill(init, signal.SIGKILL)
        except ProcessLookupError:
            pass
        os.waitpid(child, 0)
        return None
    except Failed as e:
        return str(e)
    except OSError as e:
        return f"{type(e).__name__}: {e}"
    finally:
        os.rmdir(lower)


def _root_map() -> str | None:
    return "0 0 1\n" if os.getuid() == 0 else None


def main() -> None:
    ctl = socket.socket(fileno=int(sys.argv[1]))
    ctl.set_inheritable(False)  # and every episode closes it first (_only_fds)
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    why = probe(sys.argv[2])
    zygote = Zygote(ctl)
    if why is not None:
        zygote.send({"ready": False, "error": why})
        return
    zygote.send({"ready": True, "pid": os.getpid(), "uid": os.getuid()})
    zygote.serve()


if __name__ == "__main__":
    try:
        main()
    except OSError as e:
        if e.errno not in (errno.EPIPE, errno.ECONNRESET):
            raise
