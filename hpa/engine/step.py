"""Micro-batches through megatron's pipeline schedule, and the optimizer step.

Loss normalisation contract: a ``loss_fn`` returns a loss that is already normalised by *global*
counts (tokens or sequences over all DP ranks and all micro-batches of the step), so that summing
it over micro-batches and ranks gives the intended objective exactly. megatron's schedule divides
each micro-batch loss by the number of micro-batches, and its DDP averages gradients over DP; the
closure here multiplies by ``num_microbatches · dp`` to undo both.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch

from hpa.distributed.device_mode import is_device_tensor, on_device
from hpa.distributed.groups import ParallelGroups
from hpa.engine.head import HeadInput, deferrable, defer_output_layer
from hpa.engine.micro_batch import MicroBatch, host_to_device
from hpa.models.builders import compute_device
from hpa.models.heads import capture_final_hidden, unwrap

# loss_fn(batch, output [b, s, v/tp | K] or HeadInput, hidden [b, s, h] | None) -> (loss [], metrics)
LossFn = Callable[[dict, Union[torch.Tensor, HeadInput], Optional[torch.Tensor]], Tuple[torch.Tensor, Dict]]


def forward_backward(model, micro_batches: Sequence[dict], loss_fn: LossFn, groups: ParallelGroups, *,
                     forward_only: bool = False, capture_hidden: bool = False,
                     hidden_head: bool = False) -> List[Dict]:
    """Run ``micro_batches`` through ``get_forward_backward_func`` (1F1B under PP).

    Args:
        model: a GPTModel, possibly DDP-wrapped.
        micro_batches: ``MicroBatch``es (padded or packed), or dicts with ``input_ids [b, s]`` and
            ``position_ids [b, s]`` plus whatever ``loss_fn`` reads, on any device (each enters the model's device here, ``to_model_device``,
            so ``loss_fn`` sees it there); every rank of a model replica passes the same list.
        loss_fn: called on the last stage only.
        capture_hidden: also hand the final hidden states ``[b, s, h]`` to ``loss_fn``.
        hidden_head: hand ``loss_fn`` the LM head's input (``hpa.engine.head.HeadInput``) in place of the
            logits, which are then never formed whole (for a loss that reads the model only through
            ``hpa.engine.head``); a model whose output layer is not megatron's LM head gives its output.

    Under sequence parallelism each micro-batch enters the model right-padded to a multiple of TP
    positions (megatron splits the sequence evenly); ``loss_fn`` sees the outputs and hidden states
    of the real ``s`` positions only. A packed micro-batch enters as ``[1, T]`` with megatron's THD
    ``packed_seq_params``; ``loss_fn`` sees its outputs in that layout (``MicroBatch.unpack``).

    Returns:
        The metrics dict of every micro-batch on the last pipeline stage; ``[]`` on other stages.
    """
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

    if not micro_batches:
        return []
    num_microbatches = len(micro_batches)
    scale = float(num_microbatches * groups.data_parallel_size)
    multiple = sequence_multiple(model)
    device = compute_device(groups)

    def forward_step(data_iterator, module):
        batch = to_model_device(next(data_iterator), groups.device)
        input_ids, position_ids, packed_seq_params, s = model_inputs(batch, multiple)
        kwargs = {"packed_seq_params": packed_seq_params} if packed_seq_params is not None else {}
        defer = hidden_head and groups.is_last_stage and deferrable(module)
        with contextlib.ExitStack() as stack:
            weight = stack.enter_context(defer_output_layer(module)) if defer else None
            if capture_hidden and groups.is_last_stage:
                box = stack.enter_context(capture_final_hidden(module))
            output = module(input_ids, position_ids, None, **kwargs)  # [b, s_pad, v/tp | K | h (deferred)]
        if capture_hidden and groups.is_last_stage:
            hidden = box[0].transpose(0, 1)  # [s_pad, b, h] -> [b, s_pad, h]
            hidden = hidden[:, :s] if hidden.shape[1] != s else hidden
        else:
            hidden = None

        def loss_func(output_tensor):
            if output_tensor.shape[1] != s:  # [b, s_pad, ...] -> [b, s, ...]
                output_tensor = output_tensor[:, :s]
            if defer:
                head_weight = weight[0]
                if is_device_tensor(output_tensor) and not is_device_tensor(head_weight):
                    head_weight = on_device(head_weight)  # the test device mode: it leaves the model as outputs do
                output_tensor = HeadInput(output_tensor, head_weight)
            loss, metrics = loss_fn(batch, output_tensor, hidden)
            # megatron's schedule scales the loss with its own tensors, on the parameters' device
            return loss.to(device) * scale, metrics

        return output, loss_func

    first = model_inputs(micro_batches[0], multiple)[0]
    fb = get_forward_backward_func(pp_size=groups.pipeline_model_parallel_size)
    return fb(
        forward_step_func=forward_step,
        data_iterator=iter(micro_batches),
        model=model,
        num_microbatches=num_microbatches,
        seq_length=first.shape[1],
        micro_batch_size=first.shape[0],
        forward_only=forward_only,
        pg_collection=groups.pg_collection,
        **({"p2p_communicator": P2PCommunicator(pp_group=groups.pp_group, config=_config(model))}
           if groups.pipeline_model_parallel_size > 1 else {}),
    )


def to_model_device(batch: Union[MicroBatch, dict], device: torch.device) -> Union[MicroBatch, dict]:
    """The one host-to-device point of every micro-batch that enters a model: each tensor of ``batch`` on
    ``device`` (batches are built on the host; a CUDA model refuses CPU token ids, and the loss combines
    the model's outputs with the batch's masks and targets)."""
    if isinstance(batch, MicroBatch):
        return batch.to(device)
    return {k: host_to_device(v, device) if torch.is_tensor(v) else v for k, v in batch.items()}


def model_inputs(batch: Union[MicroBatch, dict], multiple: int):
    """What a micro-batch hands the model: ``(input_ids, position_ids, packed_seq_params, s)``, the ids
    and positions right-padded to a multiple of ``multiple`` columns; ``s`` is the width before that
    padding. A plain dict is a padded micro-batch with ``input_ids`` and ``position_ids`` ``[b, s]``."""
    if isinstance(batch, MicroBatch):
        ids, positions = batch.input_ids, batch.position_ids()
    else:
        ids, positions = batch["input_ids"], batch["position_ids"]
    s = ids.shape[1]
    ids, positions = pad_sequence(ids, positions, multiple)
    packed = batch.packed_seq_params(pad=ids.shape[1] - s) if isinstance(batch, MicroBatch) else None
    return ids, positions, packed, s


def sequence_multiple(model) -> int:
    """The multiple a micro-batch's width is padded to: TP under sequence parallelism (megatron
    splits the sequence evenly over the TP ranks), else 1."""
    config = _config(model)
    return config.tensor_model_parallel_size if config.sequence_parallel else 1


def pad_sequence(input_ids: torch.Tensor, position_ids: torch.Tensor, multiple: int):
    """Right-pad ``[b, s]`` ids and positions to a multiple of ``multiple`` columns.

    The attention is causal, so the padded positions change nothing at the real ones; their outputs
    are cut off before the loss sees them.
    """
    pad = -input_ids.shape[1] % multiple
    if pad == 0:
        return input_ids, position_ids
    step = torch.arange(1, pad + 1, dtype=position_ids.dtype, device=position_ids.device)
    return (torch.nn.functional.pad(input_ids, (0, pad), value=0),
            torch.cat([position_ids, position_ids[:, -1:] + step], dim=1))


def _config(model):
    return unwrap(model).config


def zero_grad(ddp_model, optimizer) -> None:
    ddp_model.zero_grad_buffer()
    optimizer.zero_grad()


def optimizer_step(optimizer, lr_scheduler=None) -> Tuple[bool, float]:
    """One megatron optimizer step (grad clipping inside). Returns (updated, grad_norm).

    ``updated`` is False when megatron skipped the step (fp16 overflow).
    """
    updated, grad_norm, _ = optimizer.step()
    if updated and lr_scheduler is not None:
        lr_scheduler.step(increment=1)
    return bool(updated), float(grad_norm) if grad_norm is not None else float("nan")


def guarded_optimizer_step(optimizer, lr_scheduler, action_for: Callable[[float], str],
                           spike_clip: Callable[[], float]) -> Tuple[bool, float]:
    """megatron's optimizer step, split so a guard can look at the grad norm first.

    Args:
        action_for: grad_norm -> ``"step"``, ``"skip"`` (parameters and optimizer state stay exactly
            as they are) or ``"clip"`` (scale the gradients down to ``spike_clip()`` first).

    Returns:
        (updated, grad_norm before clipping).
    """
    from megatron.core.optimizer import clip_grads

    if optimizer.prepare_grads():  # fp16 overflow
        return False, float("inf")
    grad_norm = float(optimizer.get_grad_norm())
    action = action_for(grad_norm)
    if action == "skip":
        return False, grad_norm
    limit = optimizer.config.clip_grad
    if action == "clip":
        limit = min(limit, spike_clip()) if limit > 0 else spike_clip()
    if limit > 0:
        for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
            params = opt.get_parameters()
            if params:
                clip_grads.clip_grad_by_total_norm_fp32(params, limit, grad_norm)
    updated = bool(optimizer.step_with_ready_grads())
    if updated and lr_scheduler is not None:
        lr_scheduler.step(increment=1)
    return updated, grad_norm


def gradient_norm(optimizer) -> float:
    """The norm of the gradients in the model's grad buffers, as gradient clipping measures it (megatron's
    ``prepare_grads`` then ``get_grad_norm``: over the optimizer's main grads, reduced across TP, PP and,
    with the distributed optimizer, DP shards); inf on an fp16 overflow."""
    if optimizer.prepare_grads():
        return float("inf")
    return float(optimizer.get_grad_norm())


def snapshot_grads(ddp_model) -> List[torch.Tensor]:
    """A copy of the model's (already DP-reduced) grad buffers; with the distributed optimizer only each
    rank's shard of a buffer is reduced, and ``add_grads`` is linear, so the copy stays exact there."""
    return [buffer.grad_data.clone() for buffer in ddp_model.buffers + ddp_model.expert_parallel_buffers]


def add_grads(ddp_model, snapshot: Sequence[torch.Tensor], *, scale: float = 1.0) -> None:
    """``grads = scale · grads + snapshot``, buffer by buffer."""
    buffers = ddp_model.buffers + ddp_model.expert_parallel_buffers
    if len(buffers) != len(snapshot):
        raise ValueError(f"a snapshot of {len(snapshot)} grad buffers for a model with {len(buffers)}")
    for buffer, saved in zip(buffers, snapshot):
        if scale != 1.0:
            buffer.grad_data.mul_(scale)
        buffer.grad_data.add_(saved)
