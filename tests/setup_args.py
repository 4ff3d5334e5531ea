"""One helper for the tests that read ``setup.py``: the keyword arguments it passes to ``setup()``.

Running the file with ``setuptools.setup`` replaced reads what a build would get (packages, extras, version)
without building anything and without distutils' ``run_setup``.
"""

import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]


def setup_kwargs(monkeypatch):
    """The keyword arguments ``setup.py`` passes to ``setup()`` (run with ``setup`` replaced)."""
    import setuptools

    captured = {}
    monkeypatch.chdir(ROOT)  # find_packages() looks in the working directory
    monkeypatch.setattr(setuptools, "setup", lambda **kwargs: captured.update(kwargs))
    exec(compile((ROOT / "setup.py").read_text(), str(ROOT / "setup.py"), "exec"), {"__name__": "__main__"})
    return captured
