"""The zygote's entry point: ``python -I -B <this file> CONFIG_JSON`` (see forkserver.main).

``-I`` puts no script dir on ``sys.path``, and the sandbox's interpreter may have no
envhub installed, so this registers two folders as packages by path: the zygote code
shared by sandbox plugins (``envhub/confine/zygote``, named in the config, as
``_envhub_zygote``) and its own (``_envhub_process_zygote``), then runs the fork server
from it. Nothing loads from outside the standard library.
"""

import importlib.util
import json
import os
import sys


def _load_package(name: str, folder: str) -> None:
    spec = importlib.util.spec_from_file_location(
        name, os.path.join(folder, "__init__.py"), submodule_search_locations=[folder]
    )
    assert spec is not None and spec.loader is not None  # a folder with an __init__.py
    package = importlib.util.module_from_spec(spec)
    sys.modules[name] = package
    spec.loader.exec_module(package)


if __name__ == "__main__":
    _load_package("_envhub_zygote", json.loads(sys.argv[1])["zygote_package"])
    _load_package("_envhub_process_zygote", os.path.dirname(os.path.abspath(__file__)))
    from _envhub_process_zygote.forkserver import main

    main(sys.argv)
