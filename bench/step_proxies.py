"""The CPU proxies of the GPU step as one JSON line: every module of ``bench/proxies/`` (the contract:
``bench/proxies/README.md``), its ``measure()`` keys merged.

Usage::

    python bench/step_proxies.py                 # every proxy, each in a fresh process
    python bench/step_proxies.py --only head     # one, in this process
    python bench/step_proxies.py --dir DIR       # the proxies of another folder (the tests')

A proxy is ``DIR/<name>.py`` (a file whose name starts with ``_`` is a helper, not a proxy), loaded by its file path
with ``DIR`` on the import path, as when it runs as a script;
its ``measure()`` returns ``{key: number}`` with every key ``<name>.…`` (``head.bytes_per_token``). By default each
proxy runs in a process of its own (this script with ``--only``), so what one leaves behind (torch.distributed
and megatron's state, torch.compile's caches, threads) cannot change another's counts, and the order does not
matter. Prints the keys of every proxy that ran, sorted; a proxy that fails, returns something else or a key
outside its name is named in ``failed`` (``{name: reason}``) and the exit status is 1.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Dict, List

ROOT = Path(__file__).resolve().parents[1]
PROXIES = ROOT / "bench" / "proxies"


class ProxyError(Exception):
    """A proxy that did not give its keys (the message says why)."""


def proxy_names(directory: Path) -> List[str]:
    """The proxies of ``directory``: its ``*.py`` files but the helpers (``_*.py``), by name."""
    return sorted(p.stem for p in Path(directory).glob("*.py") if not p.name.startswith("_"))


def measure(directory: Path, name: str) -> Dict[str, float]:
    """Loads ``directory/name.py`` by its path, calls its ``measure()`` and checks what it returned."""
    path = Path(directory) / f"{name}.py"
    for folder in (str(ROOT), str(Path(directory).resolve())):  # as when it runs as a script: its helpers import
        if folder not in sys.path:
            sys.path.insert(0, folder)
    spec = importlib.util.spec_from_file_location(f"hpa_proxy_{name}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses (and pickling) look their module up there
    spec.loader.exec_module(module)
    if not callable(getattr(module, "measure", None)):
        raise ProxyError(f"{path} has no measure() (bench/proxies/README.md)")
    return check_keys(name, module.measure())


def check_keys(name: str, keys) -> Dict[str, float]:
    """``keys`` if it maps ``<name>.…`` strings to finite ints or floats; a ``ProxyError`` saying what is wrong
    otherwise."""
    if not isinstance(keys, dict) or not keys:
        raise ProxyError(f"measure() returned {type(keys).__name__} {keys!r:.80}, not a dict of its keys")
    for key, value in keys.items():
        if not isinstance(key, str) or not key.startswith(f"{name}."):
            raise ProxyError(f"key {key!r} is not under {name}. (a proxy's keys start with its file's name)")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ProxyError(f"{key} = {value!r}: not a finite int or float")
    return keys


def run_isolated(directory: Path, name: str) -> Dict[str, float]:
    """``measure(directory, name)`` in a fresh process (this script with ``--only``); its stderr goes to ours."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--only", name, "--dir", str(directory)],
                          stdout=subprocess.PIPE, text=True, env=env)
    lines = proc.stdout.strip().splitlines()
    try:
        out = json.loads(lines[-1]) if lines else {}
    except ValueError:
        out = {}
    if proc.returncode != 0 or not isinstance(out, dict):
        reason = out.get("failed", {}).get(name) if isinstance(out, dict) and isinstance(out.get("failed"), dict) \
            else None
        raise ProxyError(reason or f"exited {proc.returncode} (its stderr above)")
    return check_keys(name, out)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", metavar="NAME", help="run this proxy only, in this process")
    parser.add_argument("--dir", default=str(PROXIES), help="the folder of proxy modules (default bench/proxies)")
    args = parser.parse_args(argv)
    directory = Path(args.dir)
    names = proxy_names(directory)
    if args.only is not None and args.only not in names:
        parser.error(f"--only {args.only}: no proxy of that name in {directory} (there: {', '.join(names) or 'none'})")
    merged: Dict[str, float] = {}
    failed: Dict[str, str] = {}
    for name in [args.only] if args.only else names:
        try:
            merged.update(measure(directory, name) if args.only else run_isolated(directory, name))
        except Exception as err:  # noqa: BLE001 -- named in the JSON; the others still run
            failed[name] = str(err) if isinstance(err, ProxyError) else f"{type(err).__name__}: {err}"
            print(f"step_proxies: {name}: {failed[name]}", file=sys.stderr)
    out = dict(sorted(merged.items()))
    if failed:
        out["failed"] = failed
    print(json.dumps(out))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
