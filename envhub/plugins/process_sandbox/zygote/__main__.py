"""The zygote's entry point: ``python -I -B <this file> CONFIG_JSON`` (see forkserver.main).

``-I`` puts no script dir on ``sys.path``, and the sandbox's interpreter may have no
envhub installed, so this registers its own folder as a package named
``_envhub_zygote`` and runs the fork server from it: the zygote's modules import each
other relatively and load nothing from outside the standard library.
"""

import importlib.util
import os
import sys


def _load_package() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    spec = importlib.util.spec_from_file_location(
        "_envhub_zygote", os.path.join(here, "__init__.py"), submodule_search_locations=[here]
    )
    package = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = package
    spec.loader.exec_module(package)


if __name__ == "__main__":
    _load_package()
    from _envhub_zygote.forkserver import main

    main(sys.argv)
