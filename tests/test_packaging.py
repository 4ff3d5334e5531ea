"""What a built distribution contains: every module directory of the source tree is a package the build
includes, the embedded configs travel with it, and the version is stated once (``setup.py``).

A non-editable install (a wheel for an image) has only what the build put in it; an editable install has
the whole source tree on the path and hides a directory the build leaves out.
"""

import ast
import pathlib
import shutil
import subprocess
import sys
import zipfile

import pytest

from setup_args import setup_kwargs

ROOT = pathlib.Path(__file__).resolve().parents[1]
# the source trees the distribution ships (configs/ travels as the data package hpa.configs)
PACKAGE_ROOTS = ("hpa", "megatron_patches", "data_tools")


def module_dirs():
    """Dotted names of the directories under PACKAGE_ROOTS that hold Python modules."""
    names = set()
    for top in PACKAGE_ROOTS:
        for path in (ROOT / top).rglob("*.py"):
            if "__pycache__" not in path.parts:
                names.add(".".join(path.parent.relative_to(ROOT).parts))
    return names


def setup_version():
    """The version literal in ``setup.py``."""
    tree = ast.parse((ROOT / "setup.py").read_text())
    return next(ast.literal_eval(k.value) for node in ast.walk(tree) if isinstance(node, ast.Call)
                for k in node.keywords if k.arg == "version")


def test_the_source_tree_has_the_packages_it_is_expected_to_have():
    # guards the walk below: it must see the nested packages, not only the top-level ones
    assert {"hpa", "hpa.engine", "hpa.trainer", "hpa.algorithms", "megatron_patches", "data_tools"} <= module_dirs()


def test_every_module_directory_is_a_package_setup_py_includes(monkeypatch):
    kwargs = setup_kwargs(monkeypatch)
    packages = set(kwargs["packages"])
    missing = sorted(module_dirs() - packages)
    assert not missing, (f"directories of Python modules that setup.py's packages leave out of a built wheel: "
                         f"{missing} (each needs an __init__.py, and find_packages' include must match it)")
    for name in module_dirs():
        assert (ROOT / name.replace(".", "/") / "__init__.py").is_file(), f"{name} has no __init__.py"
    assert kwargs["package_dir"]["hpa.configs"] == "configs" and "*.yaml" in kwargs["package_data"]["hpa.configs"]


def test_the_built_wheel_holds_every_module_and_config(tmp_path):
    """Build the wheel (the installed setuptools, no download) from a copy of the distributed files and
    compare its file list with the source tree."""
    src = tmp_path / "src"
    src.mkdir()
    shutil.copy(ROOT / "setup.py", src)
    for top in (*PACKAGE_ROOTS, "configs"):
        shutil.copytree(ROOT / top, src / top, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    out = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                          "--wheel-dir", str(tmp_path / "dist"), str(src)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    (wheel,) = (tmp_path / "dist").glob("hpa-*.whl")
    assert wheel.name.startswith(f"hpa-{setup_version()}-")
    names = set(zipfile.ZipFile(wheel).namelist())
    expected = {p.relative_to(src).as_posix() for top in PACKAGE_ROOTS for p in (src / top).rglob("*.py")}
    expected |= {f"hpa/configs/{p.name}" for p in (src / "configs").glob("*.yaml")}
    assert "hpa/configs/tiny_cpu.yaml" in expected and "hpa/engine/step.py" in expected
    missing = sorted(expected - names)
    assert not missing, f"files of the source tree missing from {wheel.name}: {missing}"


def test_version_is_the_package_metadata_and_stated_once_in_setup_py(capsys):
    from importlib.metadata import version

    import hpa
    from hpa.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.strip() == f"hpa {version('hpa')}"
    assert hpa.__version__ == version("hpa") == setup_version()
    stated = [p.relative_to(ROOT).as_posix() for top in PACKAGE_ROOTS for p in (ROOT / top).rglob("*.py")
              if any(isinstance(node, ast.Constant) and node.value == setup_version()
                     for node in ast.walk(ast.parse(p.read_text())))]
    assert not stated, f"the version is stated outside setup.py, in {stated}; read it from the package metadata"
