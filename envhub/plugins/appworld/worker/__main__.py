"""The AppWorld zygote's entry point: ``python -I -B <this file> CONFIG_JSON``.

``-I`` puts no script dir on ``sys.path`` and the venv has no envhub, so this registers
two folders as packages by path: its own (``_envhub_appworld_worker``) and the zygote
code shared by sandbox plugins (``envhub/confine/zygote``, named in the config, as
``_envhub_zygote``), then runs the zygote.
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
    conf = json.loads(sys.argv[1])
    _load_package("_envhub_zygote", conf["zygote_package"])
    _load_package("_envhub_appworld_worker", os.path.dirname(os.path.abspath(__file__)))
    from _envhub_appworld_worker.zygote import main

    main(conf)
