"""The ``rootfs`` sandbox: each episode gets its own copy-on-write root filesystem and its
own namespaces over a read-only image rootfs, with no container engine: terminal-bench
where there is no Docker (Slurm, Kubernetes pods, shared HPC nodes).

- ``sandbox.py``: :class:`~.sandbox.RootfsSandbox`, the node's side: images, episodes,
  cgroups.
- ``images.py``: :class:`~.images.RootfsStore`, the node's image rootfs dirs, unpacked
  once per image from ``docker save``/OCI archives and layouts; ``archives.py`` reads an
  archive or layout into a plan of layers, ``layers.py`` applies them.
- ``launcher.py``: the zygote as the node launches it; ``nsinit.py``: the zygote itself
  (standard library only), which forks each episode into its namespaces.
- ``agent.py``: the node's end of an episode's shell; ``files.py``: an episode's files,
  reached through ``/proc/<pid>/root`` and never outside its root.
"""

from envhub.hookspecs import hookimpl
from envhub.plugins.rootfs_sandbox.sandbox import RootfsSandbox


@hookimpl
def register_sandboxes():
    return [RootfsSandbox]
