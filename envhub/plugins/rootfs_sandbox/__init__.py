"""The ``rootfs`` sandbox: each episode gets its own copy-on-write root filesystem over a
read-only image rootfs, with no container engine (issue 30).

- ``images.py``: :class:`~.images.RootfsStore`, the node's image rootfs dirs, unpacked
  once per image from ``docker save``/OCI archives and layouts.
"""
