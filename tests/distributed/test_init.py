"""Launch-environment parsing, backend choice and the one-owner rule for parallel_state."""

import pathlib
import re

import pytest

from hpa.distributed.init import choose_backend, first_slurm_host, read_launch_env

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_torchrun_variables():
    env = {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "MASTER_ADDR": "node7", "MASTER_PORT": "1234",
           "SLURM_PROCID": "0", "SLURM_NTASKS": "2"}
    launch = read_launch_env(env)
    assert (launch.rank, launch.world_size, launch.local_rank) == (5, 8, 1)
    assert (launch.master_addr, launch.master_port, launch.launcher) == ("node7", 1234, "torchrun")


def test_slurm_variables_without_torchrun():
    env = {"SLURM_PROCID": "9", "SLURM_NTASKS": "16", "SLURM_LOCALID": "1",
           "SLURM_JOB_NODELIST": "gpu[003-004,010],cpu1", "SLURM_JOB_ID": "4242"}
    launch = read_launch_env(env)
    assert (launch.rank, launch.world_size, launch.local_rank) == (9, 16, 1)
    assert launch.master_addr == "gpu003"
    assert launch.master_port == 20000 + 4242 % 20000
    assert launch.launcher == "slurm"


def test_slurm_master_port_from_env():
    env = {"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_JOB_NODELIST": "a1", "MASTER_PORT": "4000"}
    assert read_launch_env(env).master_port == 4000


def test_single_process_default():
    launch = read_launch_env({})
    assert (launch.rank, launch.world_size, launch.launcher) == (0, 1, "single")


def test_bad_integer_names_the_variable():
    with pytest.raises(ValueError, match="RANK='x'"):
        read_launch_env({"RANK": "x", "WORLD_SIZE": "2"})


@pytest.mark.parametrize("nodelist,first", [
    ("node001", "node001"),
    ("node[001-004]", "node001"),
    ("node[7,9-12]", "node7"),
    ("gpu-a[01-02]-ib,gpu-b[05]", "gpu-a01-ib"),
    ("cpu1,cpu2", "cpu1"),
])
def test_first_slurm_host(nodelist, first):
    assert first_slurm_host(nodelist) == first


def test_backend_choice_on_cpu():
    import torch

    if torch.cuda.is_available():
        pytest.skip("CPU-only check")
    assert choose_backend("auto") == "gloo"
    with pytest.raises(RuntimeError, match="nccl needs CUDA"):
        choose_backend("nccl")


def test_parallel_state_is_imported_only_by_hpa_distributed():
    pattern = re.compile(r"^\s*(from|import)\s+megatron\.core(\.parallel_state|\s+import\s+.*\bparallel_state\b|\.mpu)",
                         re.M)
    offenders = [str(p.relative_to(ROOT)) for p in (ROOT / "hpa").rglob("*.py")
                 if pattern.search(p.read_text()) and "distributed" not in p.relative_to(ROOT / "hpa").parts[:1]]
    assert offenders == []
    # and the rule does see the owner's import, so it cannot pass vacuously
    assert pattern.search((ROOT / "hpa" / "distributed" / "init.py").read_text())


def test_algorithms_do_not_touch_torch_distributed():
    offenders = [p.name for p in (ROOT / "hpa" / "algorithms").rglob("*.py")
                 if re.search(r"^\s*(import torch\.distributed|from torch import distributed|from torch\.distributed|"
                              r"import hpa\.config|from hpa\.config|.*\bdist\.)", p.read_text(), re.M)]
    assert offenders == []


# The layers, top to bottom (the README's Layout section lists them in this order): a module may import
# from its own layer and from the layers below it, never from a layer above.
LAYERS = (
    ("data_tools", "hpa.cli", "hpa.train", "hpa.ablate", "hpa.doctor", "hpa.serve"),
    ("hpa.trainer", "hpa.generate", "hpa.inference", "hpa.plan"),
    ("hpa.reward",),
    ("hpa.rollout",),
    ("hpa.engine",),
    ("hpa.models",),
    ("hpa.algorithms", "hpa.ops", "hpa.data"),
    ("hpa.distributed", "megatron_patches"),
    ("hpa.config", "hpa.registry", "hpa.__init__"),
)


def _unit(module: str):
    """The LAYERS entry a dotted module name belongs to (None outside the project)."""
    parts = module.split(".")
    if parts[0] in ("data_tools", "megatron_patches"):
        return parts[0]
    if parts[0] != "hpa":
        return None
    return "hpa.__init__" if len(parts) == 1 else f"hpa.{parts[1]}"


def _upward_imports(root: pathlib.Path):
    import ast

    rank = {unit: i for i, layer in enumerate(LAYERS) for unit in layer}
    found = []
    files = [*root.glob("hpa/**/*.py"), *root.glob("data_tools/*.py"), *root.glob("megatron_patches/*.py")]
    for path in files:
        src = _unit(".".join(path.relative_to(root).with_suffix("").parts))
        assert src in rank, f"{path.relative_to(root)}: its package is in no layer of LAYERS; add it"
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module] if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 else []
            for name in names:
                dst = _unit(name)
                assert dst is None or dst in rank, f"{path.relative_to(root)} imports {name}: {dst} is in no layer"
                if dst is not None and rank[dst] < rank[src]:
                    found.append(f"{path.relative_to(root)}:{node.lineno} imports {name} ({dst} is above {src})")
    return found


def test_no_module_imports_a_higher_layer():
    assert _upward_imports(ROOT) == []


def test_layer_check_catches_an_upward_import(tmp_path):
    (tmp_path / "hpa" / "models").mkdir(parents=True)
    (tmp_path / "hpa" / "models" / "x.py").write_text("from hpa.trainer.loop import HPATrainer\nimport hpa.ops\n")
    assert _upward_imports(tmp_path) == ["hpa/models/x.py:1 imports hpa.trainer.loop (hpa.trainer is above hpa.models)"]


def _import_cycle(root: pathlib.Path):
    """One cycle of the package's module import graph (module names, the first repeated at the end), or None.

    Every import counts, a function's included: a function-level import only hides a cycle until the
    function runs. ``from a.b import c`` is an edge to the module ``a.b.c`` when there is one, else to ``a.b``
    (a package's ``__init__``); a parent package run first by Python is not an edge, so a package importing its
    own submodules is no cycle."""
    import ast

    files = {".".join(p.relative_to(root).with_suffix("").parts).removesuffix(".__init__"): p
             for p in root.glob("hpa/**/*.py")}

    def known(name):
        while name and name not in files:
            name = name.rpartition(".")[0]
        return name or None

    edges = {}
    for module, path in files.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets.update(known(a.name) for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join([*package.split(".")[:len(package.split(".")) - node.level + 1], *[base][:bool(base)]])
                targets.update(f"{base}.{a.name}" if f"{base}.{a.name}" in files else known(base) for a in node.names)
        edges[module] = sorted(t for t in targets if t is not None and t != module)
    state, stack = {}, []

    def visit(module):
        state[module] = "open"
        stack.append(module)
        for dst in edges[module]:
            if state.get(dst) == "open":
                return stack[stack.index(dst):] + [dst]
            if dst not in state:
                found = visit(dst)
                if found:
                    return found
        stack.pop()
        state[module] = "done"
        return None

    for module in sorted(files):
        if module not in state:
            found = visit(module)
            if found:
                return found
    return None


def test_the_import_graph_has_no_cycle():
    cycle = _import_cycle(ROOT)
    assert cycle is None, "an import cycle: " + " -> ".join(cycle)


def test_cycle_check_sees_a_function_level_import(tmp_path):
    (tmp_path / "hpa" / "trainer").mkdir(parents=True)
    (tmp_path / "hpa" / "__init__.py").write_text("")
    (tmp_path / "hpa" / "trainer" / "__init__.py").write_text("")
    (tmp_path / "hpa" / "trainer" / "a.py").write_text("from hpa.trainer import b\n")
    (tmp_path / "hpa" / "trainer" / "b.py").write_text("def f():\n    from .a import x\n")
    assert _import_cycle(tmp_path) == ["hpa.trainer.a", "hpa.trainer.b", "hpa.trainer.a"]
    (tmp_path / "hpa" / "trainer" / "b.py").write_text("import hpa.trainer\n")  # its package (empty): no cycle
    assert _import_cycle(tmp_path) is None


MAX_FUNCTION_LINES = 80  # docs/design.md, rule 16: a function fits a screen


def _long_functions(root: pathlib.Path, limit: int = MAX_FUNCTION_LINES):
    import ast

    found = []
    for path in sorted((root / "hpa").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > limit:
                    found.append(f"{path.relative_to(root)}:{node.lineno} {node.name} ({length} lines)")
    return found


def test_no_function_in_the_package_is_longer_than_a_screen():
    assert _long_functions(ROOT) == []


def test_long_function_check_counts_decorators_out_and_the_body_in(tmp_path):
    (tmp_path / "hpa").mkdir()
    body = "".join(f"    x{i} = {i}\n" for i in range(MAX_FUNCTION_LINES))
    (tmp_path / "hpa" / "m.py").write_text("def short():\n    pass\n\n\ndef long():\n" + body)
    assert _long_functions(tmp_path) == [f"hpa/m.py:5 long ({MAX_FUNCTION_LINES + 1} lines)"]


def test_readme_layout_lists_the_layers_in_order():
    text = (ROOT / "README.md").read_text()
    block = text.split("## Layout", 1)[1].split("```", 2)[1]
    listed = []
    for line in block.strip().splitlines():
        names = line.split("  ", 1)[0].strip()
        listed.append(tuple(n.strip().removesuffix(".py").replace("/", ".") for n in names.split(",")))
    assert tuple(listed) == LAYERS


def _cited_documents(root: pathlib.Path):
    """(file:line, document) for every ``*.md`` a code comment or docstring names, and every "STYLE rule"."""
    cited = []
    for path in [*root.glob("hpa/**/*.py"), *root.glob("data_tools/*.py"), *root.glob("megatron_patches/*.py"),
                 *root.glob("bench/*.py"), *root.glob("launch/*"), *root.glob("configs/*.yaml")]:
        for n, line in enumerate(path.read_text().splitlines(), 1):
            where = f"{path.relative_to(root)}:{n}"
            cited += [(where, doc) for doc in re.findall(r"\b(?:docs/[\w./-]+|[A-Z][A-Z_]+)\.md\b", line)]
            if re.search(r"\bSTYLE\b", line) or (re.search(r"\brule \d+", line) and "design.md" not in line):
                cited.append((where, line.strip()))
    return cited


def test_comments_cite_only_documents_in_the_repository():
    missing = [(where, doc) for where, doc in _cited_documents(ROOT)
               if not doc.endswith(".md") or not ((ROOT / doc).is_file() or any(ROOT.glob(f"**/{doc}")))]
    assert missing == []


def test_document_check_catches_an_outside_citation(tmp_path):
    (tmp_path / "hpa").mkdir()
    (tmp_path / "hpa" / "x.py").write_text('"""Defaults are the recipe (HPA_RECIPE.md); see STYLE rule 10."""\n')
    cited = _cited_documents(tmp_path)
    assert ("hpa/x.py:1", "HPA_RECIPE.md") in cited and len(cited) == 2
    assert not any(tmp_path.glob("**/HPA_RECIPE.md"))


def nccl_optimizer_worker(groups):
    """Build megatron's optimizer for a layout whose backend is NCCL (the collectives here stay gloo's: only
    what hpa asks megatron for is under test)."""
    import dataclasses

    from hpa.config.schema import ModelConfig, OptimConfig, ParallelConfig
    from hpa.engine.optimizer import make_trainable
    from hpa.models import build_policy

    nccl = dataclasses.replace(groups, backend="nccl")
    cfg = ModelConfig(num_layers=1, hidden_size=16, num_attention_heads=2, ffn_hidden_size=32, vocab_size=32,
                      max_sequence_length=16, make_vocab_size_divisible_by=16)
    for distributed in (False, True):
        parallel = ParallelConfig(use_distributed_optimizer=distributed)
        trained = make_trainable(build_policy(cfg, parallel, nccl), OptimConfig(), parallel, nccl, 4)
        assert trained is not None
    return True


@pytest.mark.multirank
def test_the_optimizer_builds_under_an_nccl_layout():
    """Red on the first GPU run: hpa asked megatron for gloo groups next to its own process-group collection
    under NCCL, and ``get_megatron_optimizer`` refuses that ("Gloo process groups are not supported when
    pg_collection is provided")."""
    from multirank import run_ranks

    assert run_ranks(nccl_optimizer_worker) == [True]


def test_one_process_needs_no_free_port():
    """Several single-process jobs share a machine (``hpa ablate --parallel``, the re-drawn sweeps): a port
    found free and then bound by another job before this one's rendezvous bound it failed the run with
    EADDRINUSE (seen 2026-11-27 in a sweep). One process has no one to meet: it initialises without a port,
    whatever ports are taken, the one ``MASTER_PORT`` names included."""
    import socket

    import torch.distributed as dist

    from hpa.config.schema import ParallelConfig
    from hpa.distributed import destroy, initialize

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        for env in ({}, {"MASTER_PORT": str(port)}):
            groups = initialize(ParallelConfig(backend="gloo"), launch=read_launch_env(env))
            try:
                assert groups.world_size == 1 and dist.get_world_size() == 1
            finally:
                destroy()
