"""``bench/proxies/layer_compile.py`` keeps the compiled layers whole (issue: compiled transformer layers): no graph
break and no recompile over three packed and three padded lengths, one graph per layout.

Two inductor compilations (forward and backward) of a 2-layer model: about a minute and a half of CPU."""

import pytest

from proxy_loader import load_proxy

pytestmark = pytest.mark.e2e


def test_layer_compile_has_no_graph_break_and_no_recompile_per_length():
    result = load_proxy("layer_compile").measure()
    assert result["layer_compile.graph_breaks"] == 0, result
    assert result["layer_compile.recompiles"] <= 2, result
    assert result["layer_compile.graphs"] == 2, result  # one per layout: the lengths are dynamic from the first call
