"""``model.transformer_impl``: auto takes Transformer Engine only when its PyTorch layers import."""

import sys

import pytest
import torch

from hpa.models import specs

TE_MODULES = ("transformer_engine", "transformer_engine.pytorch")


@pytest.fixture
def fake_te_modules():
    """The fake packages the tests import must not outlive them: a ``transformer_engine`` left in
    ``sys.modules`` makes later code (``hpa plan``'s find_spec) believe TE is installed."""
    saved = {name: sys.modules.pop(name) for name in TE_MODULES if name in sys.modules}
    yield
    for name in TE_MODULES:
        sys.modules.pop(name, None)
    sys.modules.update(saved)


@pytest.fixture
def broken_te(tmp_path, monkeypatch, fake_te_modules):
    """A ``transformer_engine`` that is installed (find_spec sees it) but whose PyTorch part fails to
    import, as a TE built against another torch does; and a machine that says it has CUDA."""
    pkg = tmp_path / "transformer_engine"
    (pkg / "pytorch").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "pytorch" / "__init__.py").write_text(
        "raise ImportError('transformer_engine_torch.so: undefined symbol: _ZN3c10fake')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)


def test_auto_falls_back_to_local_when_te_does_not_import(broken_te):
    assert specs.use_transformer_engine("auto") is False
    assert "undefined symbol" in specs.transformer_engine_import_error()


def test_explicit_te_names_the_import_error(broken_te):
    with pytest.raises(RuntimeError, match="transformer_impl=transformer_engine.*undefined symbol.*hpa doctor"):
        specs.use_transformer_engine("transformer_engine")


def test_working_te_is_used(tmp_path, monkeypatch, fake_te_modules):
    pkg = tmp_path / "transformer_engine"
    (pkg / "pytorch").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "pytorch" / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert specs.use_transformer_engine("auto") is True
    assert specs.use_transformer_engine("local") is False


def test_no_cuda_means_local(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert specs.use_transformer_engine("auto") is False
    with pytest.raises(RuntimeError, match="CUDA is not available"):
        specs.use_transformer_engine("transformer_engine")


def test_the_transformer_config_raises_no_deprecation_of_megatrons_own_default():
    """megatron 0.16 defaults ``cuda_graph_scope`` to "full", then warns that "full" is deprecated (once per
    config built) and turns it into ``[]``; hpa passes ``[]``, the same scope (the whole layer)."""
    import types
    import warnings

    from hpa.config import load_config
    from hpa.models.builders import transformer_config

    cfg = load_config(None, [])
    groups = types.SimpleNamespace(device=torch.device("cpu"), tensor_model_parallel_size=1,
                                   pipeline_model_parallel_size=1, context_parallel_size=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        config = transformer_config(cfg.model, cfg.parallel, groups)
    assert config.cuda_graph_scope == []
    assert not [w for w in caught if "cuda_graph_scope" in str(w.message)]
