"""The programs that run inside the AppWorld venv: the zygote and its children.

The node never imports these modules. The zygote runs as a script on the venv's
interpreter (``python -I -B worker/__main__.py CONFIG_JSON``), registers this folder as
the package ``_envhub_appworld_worker`` and the zygote code shared by sandbox plugins
(``envhub/confine/zygote``) as ``_envhub_zygote`` (for the fork server, mount-namespace
hiding, Landlock rulesets, rlimits and the uid kill, all standard library), so nothing
here imports envhub.
"""
