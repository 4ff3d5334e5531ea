"""A ``bench/proxies`` module loaded as ``bench/step_proxies.py`` loads it: by its path, with its folder on the import
path (its helpers: ``_common``)."""

import importlib.util
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROXIES = os.path.join(ROOT, "bench", "proxies")


def load_proxy(name: str):
    """The module ``bench/proxies/<name>.py``."""
    if PROXIES not in sys.path:
        sys.path.insert(0, PROXIES)
    spec = importlib.util.spec_from_file_location(f"{name}_proxy", os.path.join(PROXIES, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
