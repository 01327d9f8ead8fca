#!/usr/bin/env bash
# Idempotent Docker setup for envhub on Debian 12 (bookworm), run as root.
# Assumes the only network is the Debian mirror + PyPI (no registry: `docker pull`
# fails), so the base image is built locally with debootstrap + `docker import`.
# Env: ENVHUB_BASE_CACHE=<dir>  reuse/store the rootfs tarball there (optional)
#      ENVHUB_DEBIAN_MIRROR=<url> override the mirror detected from apt sources
set -euo pipefail

IMAGE=envhub/base:bookworm
LOG=/var/log/dockerd.log
export PATH="$PATH:/usr/local/sbin:/usr/sbin:/sbin"   # dockerd/debootstrap live in sbin
die() { echo "setup-docker: $*" >&2; exit 1; }
[[ $(id -u) == 0 ]] || die "must run as root"

# Serialise concurrent runs (CI jobs sharing a machine).
exec 9>/var/lock/envhub-setup-docker.lock
flock 9

# --- 1. packages. /usr/local/bin/docker may be a client only, so test for dockerd.
pkgs=()
command -v dockerd >/dev/null || pkgs+=(docker.io)
command -v debootstrap >/dev/null || pkgs+=(debootstrap)
if ((${#pkgs[@]})); then
  apt-get update -q
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${pkgs[@]}"
fi

# --- 2. engine. No systemd here, so run dockerd ourselves, detached from this shell.
start_dockerd() {  # args: extra dockerd flags; returns 0 once `docker info` answers
  echo "setup-docker: starting dockerd $* (log: $LOG)"
  # setsid+nohup: survive the CI job's session; 9>&-: don't inherit our lock fd.
  setsid nohup dockerd "$@" >>"$LOG" 2>&1 </dev/null 9>&- &
  local pid=$! i
  for ((i = 0; i < 60; i++)); do
    docker info >/dev/null 2>&1 && return 0
    kill -0 "$pid" 2>/dev/null || return 1   # dockerd exited: driver/flags rejected
    sleep 1
  done
  kill "$pid" 2>/dev/null; wait "$pid" 2>/dev/null || true
  return 1
}
if ! docker info >/dev/null 2>&1; then
  if pgrep -x dockerd >/dev/null; then
    # A dockerd exists but does not answer (still starting, or wedged): wait a bit.
    for ((i = 0; i < 60; i++)); do docker info >/dev/null 2>&1 && break; sleep 1; done
    docker info >/dev/null 2>&1 || die "dockerd running but not answering; see $LOG"
  else
    # overlay2 is fast and works on this kernel; vfs works anywhere (slow, disk-hungry),
    # e.g. when /var/lib/docker is itself on overlayfs. Default iptables/bridge setup
    # works (nf_tables), and is needed so containers can NAT out to the mirror.
    start_dockerd --storage-driver=overlay2 || start_dockerd --storage-driver=vfs \
      || die "dockerd failed to start with overlay2 and vfs; see $LOG"
  fi
fi

# --- 3. base image. Use the same mirror as the host's apt (the only one reachable).
host_mirror() {
  # deb822 stanzas (*.sources) whose Suites include bookworm, then one-line format.
  local f
  for f in /etc/apt/sources.list.d/*.sources; do
    [[ -f $f ]] && awk 'BEGIN { RS = ""; FS = "\n" }
      { u = s = ""; off = 0
        for (i = 1; i <= NF; i++) {
          if ($i ~ /^URIs:/) u = $i; if ($i ~ /^Suites:/) s = $i
          if ($i ~ /^Enabled: *[Nn]o/) off = 1 }
        if (!off && s ~ /[ \t](bookworm|stable)([ \t]|$)/) { split(u, a, /[ \t]+/); print a[2] } }' "$f"
  done
  cat /etc/apt/sources.list /etc/apt/sources.list.d/*.list 2>/dev/null |
    sed -nE 's/^[[:space:]]*deb[[:space:]]+(\[[^]]*\][[:space:]]+)?([^[:space:]]+)[[:space:]]+(bookworm|stable)[[:space:]].*/\2/p'
}
# `|| true`: unmatched globs / SIGPIPE from head must not trip pipefail.
MIRROR=${ENVHUB_DEBIAN_MIRROR:-$(host_mirror 2>/dev/null | head -n1 || true)}
MIRROR=${MIRROR:-http://deb.debian.org/debian}

if ! docker image inspect "$IMAGE" >/dev/null 2>&1; then
  changes=(--change 'CMD ["bash"]'
           --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin'
           --change 'ENV LANG=C.UTF-8')
  tarball=
  if [[ -n ${ENVHUB_BASE_CACHE:-} ]]; then
    mkdir -p "$ENVHUB_BASE_CACHE"; tarball=$ENVHUB_BASE_CACHE/envhub-base-bookworm.tar
  fi
  if [[ -z $tarball || ! -s $tarball ]]; then
    work=$(mktemp -d /var/tmp/envhub-rootfs.XXXXXX)
    # On failure debootstrap may leave /proc etc. mounted inside: unmount before rm.
    cleanup() {
      grep -o " $work/[^ ]*" /proc/mounts | sort -r | xargs -r umount -l || true
      rm -rf --one-file-system "$work"
    }
    trap cleanup EXIT
    echo "setup-docker: debootstrapping bookworm from $MIRROR (takes a few minutes)"
    debootstrap --variant=minbase \
      --include=python3,python3-pytest,bash,coreutils,procps,ca-certificates \
      bookworm "$work/rootfs" "$MIRROR" >"$work/debootstrap.log" 2>&1 \
      || { tail -n 30 "$work/debootstrap.log" >&2; die "debootstrap failed"; }
    # Drop caches to shrink the image; container apt needs `apt-get update` first anyway.
    rm -rf "$work"/rootfs/var/cache/apt/archives/*.deb "$work"/rootfs/var/lib/apt/lists/*
    if [[ -n $tarball ]]; then
      tar -C "$work/rootfs" --numeric-owner -cf "$tarball.tmp" . && mv "$tarball.tmp" "$tarball"
    else
      tar -C "$work/rootfs" --numeric-owner -c . | docker import "${changes[@]}" - "$IMAGE" >/dev/null
    fi
    cleanup; trap - EXIT
  fi
  [[ -z $tarball ]] || docker import "${changes[@]}" - "$IMAGE" <"$tarball" >/dev/null
fi

# --- 4. verify containers reach the mirror (DNS + bridge NAT) with a plain TCP connect.
hostport=${MIRROR#*://}; hostport=${hostport%%/*}
port=80; [[ $MIRROR == https:* ]] && port=443
[[ $hostport == *:* ]] && port=${hostport##*:}
docker run --rm --network bridge "$IMAGE" timeout 15 bash -c "exec 3<>/dev/tcp/${hostport%%:*}/$port" \
  || die "containers cannot reach ${hostport%%:*}:$port (bridge/iptables NAT?); see $LOG"

echo "setup-docker: OK docker=$(docker version -f '{{.Server.Version}}')" \
  "storage=$(docker info -f '{{.Driver}}') image=$IMAGE" \
  "id=$(docker image inspect -f '{{.Id}}' "$IMAGE" | cut -c8-19) mirror=$MIRROR"
