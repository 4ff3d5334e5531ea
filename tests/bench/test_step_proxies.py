"""``bench/step_proxies.py``: loads every proxy module of a folder by path, merges their keys into one JSON line."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "bench", "step_proxies.py")


def _proxies(tmp_path, **modules):
    folder = tmp_path / "proxies"
    folder.mkdir()
    (folder / "README.md").write_text("not a proxy\n")
    for name, body in modules.items():
        (folder / f"{name}.py").write_text(textwrap.dedent(body))
    return folder


def _run(folder, *args):
    proc = subprocess.run([sys.executable, SCRIPT, "--dir", str(folder), *args], capture_output=True, text=True,
                          timeout=300, cwd=folder.parent)
    lines = proc.stdout.strip().splitlines()
    return proc.returncode, (json.loads(lines[-1]) if lines else None), proc.stderr


GOOD = {
    "alpha": """
        import os
        def measure():
            return {"alpha.ops": 1200, "alpha.bytes_per_token": 2.5e6, "alpha.pid": os.getpid()}
        if __name__ == "__main__":
            raise SystemExit("loaded as a script: the aggregator must load it as a module")
        """,
    "beta": """
        from __future__ import annotations

        import dataclasses, os, _shared

        @dataclasses.dataclass(frozen=True)
        class Shape:  # a dataclass needs its module in sys.modules
            rows: int

        def measure():
            return {"beta.kernels_per_step": _shared.KERNELS, "beta.rows": Shape(rows=64).rows, "beta.pid": os.getpid()}
        """,
    # a helper the proxies import (the folder is on their path when run as scripts): never run as a proxy
    "_shared": """
        KERNELS = 390
        def measure():
            raise AssertionError("a helper is not a proxy")
        """,
}


def test_every_proxy_runs_in_a_process_of_its_own_and_the_keys_merge(tmp_path):
    folder = _proxies(tmp_path, **GOOD)
    rc, out, err = _run(folder)
    assert rc == 0, err
    assert list(out) == sorted(out)
    pids = {out.pop("alpha.pid"), out.pop("beta.pid")}
    assert out == {"alpha.bytes_per_token": 2.5e6, "alpha.ops": 1200, "beta.kernels_per_step": 390, "beta.rows": 64}
    assert len(pids) == 2  # one process per proxy: nothing one leaves behind reaches another


def test_only_runs_one_proxy_in_this_process(tmp_path):
    folder = _proxies(tmp_path, **GOOD)
    rc, out, err = _run(folder, "--only", "alpha")
    assert rc == 0 and set(out) == {"alpha.ops", "alpha.bytes_per_token", "alpha.pid"}, err
    rc, out, err = _run(folder, "--only", "gamma")
    assert rc == 2 and "no proxy of that name" in err and "alpha, beta" in err and out is None


@pytest.mark.parametrize("body,reason", [
    ("X = 1\n", "has no measure()"),
    ("def measure():\n    return [1]\n", "not a dict"),
    ("def measure():\n    return {'ops': 3}\n", "is not under broken."),
    ("def measure():\n    return {'broken.ops': 'many'}\n", "not a finite int or float"),
    ("def measure():\n    return {'broken.ok': True}\n", "not a finite int or float"),
    ("def measure():\n    return {'broken.ops': float('nan')}\n", "not a finite int or float"),
    ("def measure():\n    raise RuntimeError('no model')\n", "RuntimeError: no model"),
    ("import sys\ndef measure():\n    sys.exit(3)\n", "exited 3"),
])
def test_a_proxy_that_fails_is_named_and_the_others_still_count(tmp_path, body, reason):
    folder = _proxies(tmp_path, alpha=GOOD["alpha"], broken=body)
    rc, out, err = _run(folder)
    assert rc == 1 and reason in out["failed"]["broken"], (out, err)
    assert out["alpha.ops"] == 1200 and not any(k.startswith("broken.") for k in out)


def test_the_shipped_folder_holds_only_proxies_that_keep_the_contract():
    """Whatever modules ``bench/proxies/`` holds: each is listed and has a ``measure``; none is run here (each
    proxy's own test runs it)."""
    import ast
    import importlib.util

    spec = importlib.util.spec_from_file_location("step_proxies", SCRIPT)
    step_proxies = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(step_proxies)
    for name in step_proxies.proxy_names(step_proxies.PROXIES):
        tree = ast.parse((step_proxies.PROXIES / f"{name}.py").read_text())
        assert any(isinstance(n, ast.FunctionDef) and n.name == "measure" for n in tree.body), name
