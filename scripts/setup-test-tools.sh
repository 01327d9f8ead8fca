#!/usr/bin/env bash
# Idempotent set-up, as root on Debian 12 (bookworm), of what the browser, alerting and
# /run_code tests need beside the venv: Debian's `chromium` (driven by Playwright for
# Python from the test extra; Playwright's own browser download is never used, as it
# cannot be fetched here), `promtool`, taken out of Debian's `prometheus` package without
# installing it (the package would start a Prometheus server), and the toolchains of the
# languages /run_code offers (g++, nodejs, golang, default-jdk-headless, rustc, php-cli,
# ruby, lua5.4, r-base-core, iverilog), and
# skopeo, whose archives the rootfs sandbox's tests import (tests/test_rootfs_images.py),
# and slirp4netns, which gives the rootfs sandbox's episodes their network; and a newer Go
# from bookworm-backports.
# Assumes the only network is the Debian mirror + PyPI.
set -euo pipefail
export PATH="$PATH:/usr/local/sbin:/usr/sbin:/sbin"
die() { echo "setup-test-tools: $*" >&2; exit 1; }
[[ $(id -u) == 0 ]] || die "must run as root"

# Serialise concurrent runs (CI jobs sharing a machine), as scripts/setup-docker.sh does.
exec 9>/var/lock/envhub-setup-test-tools.lock
flock 9

updated=
apt_update() { [[ -n $updated ]] || { apt-get update -q; updated=1; }; }

# --- 1. chromium (its fonts come as dependencies).
if ! [[ -x /usr/bin/chromium ]]; then
  apt_update
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends chromium fonts-dejavu-core
fi
/usr/bin/chromium --headless=new --no-sandbox --disable-gpu --dump-dom about:blank >/dev/null 2>&1 \
  || die "chromium is installed but does not start headless"

# --- 2. promtool, for `promtool check rules` / `test rules` over docs/prometheus/.
if ! command -v promtool >/dev/null; then
  apt_update
  work=$(mktemp -d)
  chmod 755 "$work"  # apt-get download fetches as the _apt user
  trap 'rm -rf "$work"' EXIT
  (cd "$work" && apt-get download -q prometheus) || die "cannot download Debian's prometheus package"
  dpkg-deb --fsys-tarfile "$work"/prometheus_*.deb | tar -x -C "$work" ./usr/bin/promtool
  install -m 0755 "$work/usr/bin/promtool" /usr/local/bin/promtool
fi

# --- 3. the toolchains of /run_code's languages (tests/test_run_code*.py): Debian's, in
# /usr, where the process sandbox's view shows them (a rustup toolchain in a home dir is
# not offered). About 25 s and 740 MB when g++ and the JDK are there already (PHP, Ruby,
# Lua, R, Icarus Verilog, pytest and ldc, the D compiler of a test's extra language, about
# 20 s and 150 MB more); the JDK
# adds about a minute on a bare machine. skopeo too (tests/test_rootfs_images.py: what
# `skopeo copy` writes, and a pull that fails), about 10 s; slirp4netns
# (tests/test_rootfs_sandbox.py: an episode's network), a second.
toolchains=()
for pair in g++:g++ node:nodejs go:golang-go javac:default-jdk-headless rustc:rustc skopeo:skopeo \
  slirp4netns:slirp4netns php:php-cli ruby:ruby lua:lua5.4 Rscript:r-base-core iverilog:iverilog \
  pytest:python3-pytest ldmd2:ldc; do
  [[ -x /usr/bin/${pair%%:*} ]] || toolchains+=("${pair#*:}")
done
if (( ${#toolchains[@]} )); then
  apt_update
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${toolchains[@]}"
fi

# tsx, which runs /run_code's TypeScript as SandboxFusion does (esbuild strips the types),
# from the npm registry into /usr/lib/node_modules and /usr/bin (--prefix /usr, whatever
# npm's own prefix), where sandboxes see it. About 10 s.
if ! [[ -x /usr/bin/tsx ]]; then
  if ! command -v npm >/dev/null; then
    apt_update
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends npm
  fi
  npm install -g --prefix /usr --no-fund --no-audit tsx@4.23.15 || die "cannot install tsx from the npm registry"
fi

# --- 4. a Go that ships no compiled standard library (1.20 and later; bookworm's is 1.19),
# for the test of /run_code's compiled standard library (tests/test_run_code.py): Debian's
# golang-1.23-go from bookworm-backports, on the same mirror, into /usr/lib/go-1.23 beside
# the default go. The backports source is used for this one install and not kept.
# About 20 s and 250 MB.
if ! [[ -x /usr/lib/go-1.23/bin/go ]]; then
  mirror=$(awk '/^URIs:/ {print $2; exit}' /etc/apt/sources.list.d/debian.sources 2>/dev/null || true)
  mirror=${mirror:-http://deb.debian.org/debian}
  bpo=/etc/apt/sources.list.d/envhub-test-backports.sources
  printf 'Types: deb\nURIs: %s\nSuites: bookworm-backports\nComponents: main\nSigned-By: %s\n' \
    "$mirror" /usr/share/keyrings/debian-archive-keyring.gpg >"$bpo"
  trap 'rm -f "$bpo"; rm -rf "${work:-}"' EXIT
  apt-get update -q -o Dir::Etc::sourcelist="$bpo" -o Dir::Etc::sourceparts=- -o APT::Get::List-Cleanup=0 \
    || die "cannot read bookworm-backports from $mirror"
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends -t bookworm-backports golang-1.23-go \
    || die "cannot install golang-1.23-go from bookworm-backports"
  rm -f "$bpo"
fi

echo "setup-test-tools: OK $(/usr/bin/chromium --version 2>/dev/null | head -n1)," \
  "$(promtool --version 2>&1 | head -n1), $(/usr/bin/g++ --version | head -n1), node $(/usr/bin/node --version)," \
  "$(/usr/bin/go version), $(/usr/lib/go-1.23/bin/go version), $(/usr/bin/javac -version 2>&1), $(/usr/bin/rustc --version)," \
  "skopeo $(/usr/bin/skopeo --version | awk '{print $3}'), $(/usr/bin/slirp4netns --version | head -n1)"
