"""The ``rewrite`` and ``runpod`` network modes: model URLs rewritten by prefix.

SETA's scheduler rewrites each ``model_url`` with a ``url_rewrite`` map of
``{prefix: replacement}`` before a node sees it (PROTOCOLS.md §2.3, §2.5). These modes
are that map, plus two ways to build it.

Policy and invariants:

- **Longest prefix wins.** Upstream takes the first matching prefix in insertion order,
  although its docstring promises the longest; envhub sorts, so the result does not depend
  on the order of the keys. The result is ``replacement + url[len(prefix):]``: the path
  (``/v1/<session_id>``), query and fragment after the prefix are kept.
- **Prefixes match at a boundary only** (envhub's choice; upstream uses a bare
  ``startswith``). A prefix matches when the URL equals it, when the next character of
  the URL is ``/``, ``?`` or ``#``, or when the prefix itself ends in ``/``. So
  ``http://a:8000`` rewrites ``http://a:8000/v1/s`` but not ``http://a:80001/v1/s``, and
  ``http://a:8000/v1`` does not rewrite ``http://a:8000/v10``. Matching is exact and
  case-sensitive, as upstream's is.
- Every key and value of a map is a string that parses as an ``http``/``https`` URL with
  a host. A bad map in config is a ``StartupError``; a bad map sent to :meth:`set_map`
  (the scheduler's ``POST /url_rewrite``) is an ``InvalidRequest`` whose ``field`` names
  the bad key, and leaves the old map in place.
- :meth:`rewrite` is a pure function of the URL and the current map; it never raises and
  returns the URL unchanged when no rule applies.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from envhub.errors import InvalidRequest, StartupError
from envhub.network import NetworkMode

log = logging.getLogger(__name__)

_BOUNDARY = "/?#"
_POD_ID = re.compile(r"[a-z0-9]+")


# --- the rewrite map ------------------------------------------------------------------


class _BadEntry(ValueError):
    """One entry of a rewrite map is invalid; ``key`` names it."""

    def __init__(self, message: str, key: str) -> None:
        super().__init__(message)
        self.key = key


def is_http_url(value: Any) -> bool:
    if not isinstance(value, str) or not value or any(c.isspace() for c in value):
        return False
    try:
        parts = urlsplit(value)
        parts.port  # noqa: B018 - raises ValueError for a port that is not a number in range
    except ValueError:
        return False
    return parts.scheme in ("http", "https") and bool(parts.hostname)


def _checked_map(mapping: Any, *, what: str = "url_rewrite") -> dict[str, str]:
    """A copy of ``mapping`` after checking every entry; raises :class:`_BadEntry`."""
    if not isinstance(mapping, Mapping):
        raise _BadEntry(f"{what} must be a mapping of URL prefix to URL, not {type(mapping).__name__}", what)
    out: dict[str, str] = {}
    for key, value in mapping.items():
        if not is_http_url(key):
            raise _BadEntry(f"{what}: key {key!r} is not an http(s) URL", str(key))
        if not is_http_url(value):
            raise _BadEntry(f"{what}: value {value!r} for {key!r} is not an http(s) URL", key)
        out[key] = value
    return out


def _matches(url: str, prefix: str) -> bool:
    if not url.startswith(prefix):
        return False
    return len(url) == len(prefix) or prefix[-1] == "/" or url[len(prefix)] in _BOUNDARY


class RewriteMap:
    """An immutable, checked ``{prefix: replacement}`` map with longest-prefix lookup."""

    def __init__(self, mapping: Mapping[str, str] | None = None) -> None:
        self._map = _checked_map(mapping or {})
        self._rules = sorted(self._map.items(), key=lambda kv: len(kv[0]), reverse=True)

    def as_dict(self) -> dict[str, str]:
        return dict(self._map)

    def lookup(self, url: str) -> str | None:
        """The rewritten URL, or None when no prefix matches."""
        for prefix, replacement in self._rules:
            if _matches(url, prefix):
                return replacement + url[len(prefix) :]
        return None


def _map_from_config(config: Mapping[str, Any], mode: str) -> RewriteMap:
    try:
        return RewriteMap(config.get("url_rewrite") or {})
    except _BadEntry as e:
        raise StartupError(f"network mode {mode!r}: {e}") from None


# --- rewrite ----------------------------------------------------------------------------


class RewriteNetwork(NetworkMode):
    """Rewrite model URLs with a ``{prefix: replacement}`` map (SETA's ``url_rewrite``).

    Config: ``url_rewrite`` (optional mapping; default empty). The scheduler's
    ``POST /url_rewrite`` replaces the whole map through :meth:`set_map`.

    Example::

        mode = RewriteNetwork({"url_rewrite": {"http://10.0.0.5:8100": "http://relay:39001"}})
        mode.rewrite("http://10.0.0.5:8100/v1/s1")  # "http://relay:39001/v1/s1"
        mode.rewrite("http://10.0.0.5:81000/v1/s1")  # unchanged: not at a boundary
    """

    name = "rewrite"
    description = "Model URLs rewritten by a {prefix: replacement} map, longest prefix first"

    def __init__(self, config: Mapping[str, Any] | None = None) -> None:
        super().__init__(config)
        self._rewrites = _map_from_config(self.config, self.name)

    def get_map(self) -> dict[str, str]:
        """A copy of the current map, in the order it was given."""
        return self._rewrites.as_dict()

    def set_map(self, mapping: Mapping[str, str]) -> dict[str, str]:
        """Replace the whole map and return the new one.

        Raises ``InvalidRequest`` (``field`` = the bad key, or ``"url_rewrite"`` when
        ``mapping`` is not a mapping); the old map then stays in place.
        """
        try:
            new = RewriteMap(mapping)
        except _BadEntry as e:
            raise InvalidRequest(str(e), field=e.key) from None
        self._rewrites = new  # one assignment: a concurrent rewrite() sees the old or the new map
        return new.as_dict()

    def rewrite(self, url: str) -> str:
        rewritten = self._rewrites.lookup(url)
        return url if rewritten is None else rewritten


# --- runpod -----------------------------------------------------------------------------


class RunPodNetwork(RewriteNetwork):
    """Rewrite ``http://HOST:PORT/path`` to RunPod's proxy ``https://<pod_id>-<PORT>.proxy.runpod.net/path``.

    Config: ``pod_id`` (required, ``[a-z0-9]+``); ``hosts`` (optional list of host names
    or IPs whose URLs are rewritten; default any host); ``url_rewrite`` (optional map,
    tried first, longest prefix wins, exactly as in ``rewrite`` mode).

    Left unchanged: URLs with no explicit port, ``https`` URLs (already public) and hosts
    not in ``hosts``. Path, query and fragment are kept; so are credentials in the URL.

    Example::

        mode = RunPodNetwork({"pod_id": "abc123"})
        mode.rewrite("http://10.0.0.5:8100/v1/s1")  # "https://abc123-8100.proxy.runpod.net/v1/s1"
    """

    name = "runpod"
    description = "Model URLs on http://HOST:PORT sent to https://<pod_id>-<PORT>.proxy.runpod.net"

    def __init__(self, config: Mapping[str, Any] | None = None) -> None:
        super().__init__(config)
        pod_id = self.config.get("pod_id")
        if not isinstance(pod_id, str) or not _POD_ID.fullmatch(pod_id):
            raise StartupError(f"network mode 'runpod': pod_id must match [a-z0-9]+, got {pod_id!r}")
        self.pod_id = pod_id
        hosts = self.config.get("hosts")
        if hosts is None:
            self.hosts: frozenset[str] | None = None
        elif isinstance(hosts, (list, tuple)) and all(isinstance(h, str) and h.strip() for h in hosts):
            self.hosts = frozenset(h.strip().strip("[]").lower() for h in hosts)
        else:
            raise StartupError(f"network mode 'runpod': hosts must be a list of host names, got {hosts!r}")

    def rewrite(self, url: str) -> str:
        rewritten = self._rewrites.lookup(url)
        if rewritten is not None:
            return rewritten
        try:
            parts = urlsplit(url)
            port = parts.port
        except ValueError:
            return url
        host = (parts.hostname or "").lower()
        if parts.scheme != "http" or port is None or not host:
            return url
        if self.hosts is not None and host not in self.hosts:
            return url
        userinfo, at, _ = parts.netloc.rpartition("@")
        netloc = f"{userinfo}{at}{self.pod_id}-{port}.proxy.runpod.net"
        return urlunsplit(("https", netloc, parts.path, parts.query, parts.fragment))
