"""Base URLs of envhub processes, as settings and joins give them."""

from __future__ import annotations

import ipaddress
from urllib.parse import urlsplit


def is_loopback(host: str | None) -> bool:
    """Whether ``host`` (a name or an address) is this machine's loopback."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host or "").is_loopback
    except ValueError:
        return False


def base_url(value: object) -> str:
    """``value`` as a process's base URL, ``http(s)://host[:port]`` with no path, query,
    user or fragment, without a trailing slash; ``ValueError`` saying what is wrong."""
    if not isinstance(value, str) or not value:
        raise ValueError("expected a base URL such as http://10.0.0.11:8000")
    url = value.rstrip("/")
    try:
        parts = urlsplit(url)
        port = parts.port  # a port that is no number in range raises here
    except ValueError as e:
        raise ValueError(f"{value!r} is not a URL: {e}") from None
    if (
        len(url) > 2048
        or port == 0
        or parts.scheme not in ("http", "https")
        or not parts.hostname
        or parts.path
        or parts.query
        or parts.fragment
        or parts.username is not None
    ):
        raise ValueError(f"expected http(s)://host[:port] with nothing after it, not {value!r}")
    return url
