"""hpa: Hybrid Preference Alignment on megatron-core."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("hpa")  # stated once, in setup.py
except PackageNotFoundError:  # a source tree on the path that was never installed
    __version__ = "unknown (not installed: pip install -e . or a wheel)"
