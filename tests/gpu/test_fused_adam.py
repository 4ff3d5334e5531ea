"""``hpa.engine.optimizer.use_multi_tensor_adam`` on CUDA: torch's fused Adam, close to the foreach one, and a
load whose ``step`` states are host tensors (the distributed optimizer's ``restore_steps``) moved to the device.
Run by ``bench/gpu_check.sh`` (``pytest -m gpu tests/gpu``); skipped without CUDA."""

import pytest
import torch

import adam_steps
from hpa.engine.optimizer import use_multi_tensor_adam

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_fused_on_cuda_close_to_foreach_and_resumes_from_host_steps():
    ref_params, params = adam_steps.parameters("cuda"), adam_steps.parameters("cuda")
    ref, opt = adam_steps.wrapped(ref_params, foreach=True), adam_steps.wrapped(params)
    use_multi_tensor_adam(opt)
    assert [g["fused"] for g in opt.optimizer.param_groups] == [True, True]
    for seed in range(3):
        adam_steps.step(ref, ref_params, seed)
        adam_steps.step(opt, params, seed)
    assert all(opt.optimizer.state[p]["step"].device.type == "cuda" for p in params)
    for a, b in zip(ref_params, params):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    # a load whose steps are host tensors (the distributed optimizer's restore_steps makes them so)
    saved = ref.optimizer.state_dict()
    for p in params:
        opt.optimizer.state[p]["step"] = torch.tensor(3.0)
    use_multi_tensor_adam(opt)
    assert all(opt.optimizer.state[p]["step"].device.type == "cuda" for p in params)
    adam_steps.step(opt, params, 3)
    adam_steps.step(ref, ref_params, 3)
    for a, b in zip(ref_params, params):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert saved["param_groups"][0]["foreach"] is True
