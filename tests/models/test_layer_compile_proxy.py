"""``bench/proxies/layer_compile.py`` keeps the compiled layers whole (issue: compiled transformer layers): no graph
break and no recompile over three packed and three padded lengths, one graph per layout.

Two inductor compilations (forward and backward) of a 2-layer model: about a minute and a half of CPU."""

import importlib.util
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

pytestmark = pytest.mark.e2e


def load_proxy():
    spec = importlib.util.spec_from_file_location("layer_compile_proxy",
                                                  os.path.join(ROOT, "bench", "proxies", "layer_compile.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_layer_compile_has_no_graph_break_and_no_recompile_per_length():
    result = load_proxy().measure()
    assert result["layer_compile.graph_breaks"] == 0, result
    assert result["layer_compile.recompiles"] <= 2, result
    assert result["layer_compile.graphs"] == 2, result  # one per layout: the lengths are dynamic from the first call
