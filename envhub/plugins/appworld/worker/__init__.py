"""The programs that run inside the AppWorld venv: the zygote and its children.

The node never imports these modules. The zygote runs as a script on the venv's
interpreter (``python -I -B worker/__main__.py CONFIG_JSON``), registers this folder as
the package ``_envhub_appworld_worker`` and the process sandbox's zygote folder as
``_envhub_zygote`` (for its mount-namespace hiding, Landlock rulesets and uid kill, all
standard library), so nothing here imports envhub.
"""
