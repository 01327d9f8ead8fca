"""The zygote: the warm process every process-sandbox interpreter is forked from.

Its modules run only in the zygote, as a script under ``python -I`` on the sandbox's
interpreter, which may have no envhub installed: nothing here imports envhub or anything
outside the standard library. What it shares with other zygotes (the fork server's loop,
isolation, Landlock, rlimits, the frame format) is ``envhub/confine/zygote``, which
``__main__.py`` loads as ``_envhub_zygote``; the node's side is in ``envhub/confine`` and
this plugin's other modules.
"""
