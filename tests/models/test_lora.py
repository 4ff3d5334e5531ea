"""LoRA over one frozen base (hpa/models/lora.py, docs/lora.md): step 0 is the base, the reference (adapters off)
is the base, only the adapters train, merged = unmerged, TP1 = TP2+SP = PP2, exact resume from an adapter-only
checkpoint, and clear errors for the wrong kind of checkpoint."""

from pathlib import Path

import numpy as np
import pytest
import torch

import lora_workers as W
from multirank import layout_id, run_ranks

ATOL = 1e-5


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("lora") / "base"
    run_ranks(W.save_base_worker, args=(str(directory),))
    return str(directory)


@pytest.fixture(scope="module")
def core(base_dir):
    return run_ranks(W.core_worker, args=(base_dir,))[0]


@pytest.mark.multirank
def test_step0_equals_base_exactly_tp1_pp1_dp1(core):
    assert torch.equal(core["step0_logp"], core["base_logp"])


@pytest.mark.multirank
def test_training_moves_the_adapters_and_the_output_tp1_pp1_dp1(core):
    """Guards the comparisons below: the adapters did train, so adapters on differs from the base."""
    assert core["B_norm"] > 0
    assert (core["trained_logp"] - core["base_logp"]).abs().max() > 1e-3
    losses = [loss for loss, _ in core["steps"]]
    assert losses[-1] < losses[0]


@pytest.mark.multirank
def test_reference_view_is_the_frozen_base_tp1_pp1_dp1(core):
    assert torch.equal(core["reference_logp"], core["base_logp"])


@pytest.mark.multirank
def test_only_adapters_get_grads_and_optimizer_state_tp1_pp1_dp1(core):
    assert core["num_adapter_params"] == 4 * 4 * 2  # layers x targets x (A, B)
    assert core["num_requires_grad"] == core["num_adapter_params"]
    assert core["num_grad_buffer_params"] == core["num_adapter_params"]
    assert core["grad_buffer_params_are_adapters"]
    assert core["optimizer_params_are_adapters"]
    assert core["optimizer_state_are_adapters"]


@pytest.mark.multirank
def test_base_bit_identical_after_training_tp1_pp1_dp1(core):
    assert core["base_unchanged"]


@pytest.mark.multirank
def test_merged_equals_unmerged_tp1_pp1_dp1(core):
    np.testing.assert_allclose(core["merged_logp"], core["trained_logp"], atol=ATOL, rtol=0)
    np.testing.assert_allclose(core["merged_in_place_logp"], core["trained_logp"], atol=ATOL, rtol=0)


# (tp, pp, dp, sequence_parallel, distributed_optimizer)
LAYOUTS = [(2, 1, 1, True, False), (1, 2, 1, False, False), (2, 1, 1, False, False), (1, 1, 2, False, True)]


def _layout_name(tp, pp, dp, sp, dist):
    return layout_id(tp, pp, dp) + ("_sp" if sp else "") + ("_distopt" if dist else "")


@pytest.fixture(scope="module")
def tp1_run(base_dir):
    return run_ranks(W.layout_worker, args=(base_dir, False, False))[0]


@pytest.mark.multirank
@pytest.mark.parametrize("tp,pp,dp,sp,dist", LAYOUTS, ids=[_layout_name(*x) for x in LAYOUTS])
def test_three_lora_steps_match_tp1(base_dir, tp1_run, tp, pp, dp, sp, dist):
    got = run_ranks(W.layout_worker, tp=tp, pp=pp, dp=dp, args=(base_dir, sp, dist))[-1]
    for (ref_loss, ref_norm), (loss, norm) in zip(tp1_run["steps"], got["steps"]):
        if dp == 1:  # with DP each rank's loss is its own micro-batches' part
            assert loss == pytest.approx(ref_loss, abs=ATOL)
        assert norm == pytest.approx(ref_norm, rel=ATOL)
    np.testing.assert_allclose(got["logp"], tp1_run["logp"], atol=ATOL, rtol=0)
    np.testing.assert_allclose(got["reference_logp"], tp1_run["reference_logp"], atol=ATOL, rtol=0)


@pytest.fixture(scope="module")
def resume(base_dir, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("lora_resume")
    return run_ranks(W.resume_worker, args=(base_dir, str(run_dir)))[0]


@pytest.mark.multirank
def test_adapter_checkpoint_resume_is_exact_tp1_pp1_dp1(resume):
    assert resume["resumed"] == resume["uninterrupted"]
    assert torch.equal(resume["resumed_logp"], resume["uninterrupted_logp"])


@pytest.fixture(scope="module")
def full_checkpoint(base_dir, tmp_path_factory):
    return run_ranks(W.full_checkpoint_worker, args=(base_dir, str(tmp_path_factory.mktemp("full"))))[0]


def _dir_bytes(path):
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())


@pytest.mark.multirank
def test_adapter_checkpoint_holds_adapters_only_tp1_pp1_dp1(resume, full_checkpoint):
    lora_dir, full_dir = Path(resume["checkpoint"]) / "policy", Path(full_checkpoint) / "policy"
    from megatron.core.dist_checkpointing import load_tensors_metadata
    from hpa.models.lora import is_adapter_key

    assert (lora_dir / "lora.json").is_file() and not (full_dir / "lora.json").exists()
    stored = load_tensors_metadata(str(lora_dir))  # model and optimizer tensors, layers stacked on axis 0
    assert stored and all(is_adapter_key(k) for k in stored), sorted(stored)
    assert {k for k in stored if k.startswith("optimizer.state.")} and len(stored) == 3 * 2 * 4
    assert any(not is_adapter_key(k) for k in load_tensors_metadata(str(full_dir)))
    # sizes: the adapters (rank 4) are a small part of the weights, plus a fixed ~100 KB of megatron metadata
    assert _dir_bytes(lora_dir) < 0.5 * _dir_bytes(full_dir)


@pytest.mark.multirank
def test_wrong_kind_of_checkpoint_is_a_clear_error_tp1_pp1_dp1(base_dir, resume, full_checkpoint):
    errors = run_ranks(W.wrong_kind_worker, args=(base_dir, resume["checkpoint"], full_checkpoint))[0]
    for case in ("weights_from_lora", "resume_full_from_lora", "resume_lora_from_full"):
        assert errors[case] is not None, case
        kind, message = errors[case]
        assert kind == "LoRAError", (case, kind, message)
        assert "model.lora.rank" in message
    assert "is a LoRA checkpoint" in errors["weights_from_lora"][1]
    assert "is a full-model checkpoint" in errors["resume_lora_from_full"][1]


@pytest.mark.multirank
def test_adapter_checkpoint_saved_at_tp2_sp_loads_at_tp1(base_dir, tmp_path):
    """The split A/B (and SwiGLU fc1's chunked B) reshard: TP2+SP adapters loaded at TP1 give the same output."""
    saved = run_ranks(W.save_trained_worker, tp=2, args=(base_dir, str(tmp_path), True))[-1]
    loaded = run_ranks(W.load_trained_worker, args=(base_dir, saved["checkpoint"]))[0]
    np.testing.assert_allclose(loaded["logp"], saved["logp"], atol=ATOL, rtol=0)


@pytest.mark.multirank
def test_base_fingerprint_is_the_same_under_tp2_sp_and_pp2(base_dir):
    """lora.json's checksum of the base is layout-free: TP shards, TP-replicated norms counted once, PP stages."""
    tp1 = run_ranks(W.fingerprint_worker, args=(base_dir,))[0]
    assert tp1["config"]["num_layers"] == 4 and tp1["num_elements"] > 0
    for tp, pp, sp in ((2, 1, True), (1, 2, False)):
        assert run_ranks(W.fingerprint_worker, tp=tp, pp=pp, args=(base_dir, sp)) == [tp1] * (tp * pp)
