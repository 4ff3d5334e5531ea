"""The edges of a model in the test device mode (``hpa/distributed/device_mode.py``).

A GPTModel built while ``groups.device`` is the test device computes on the CPU; ``install`` makes it refuse
input tensors that are not on the test device and hand its outputs back there, as a CUDA model does.
"""

from __future__ import annotations

import dataclasses

import torch

from hpa.distributed.device_mode import enter_model, is_device_tensor, leave_model, on_device, on_host


def _require(tensor: torch.Tensor, device: torch.device, what: str) -> torch.Tensor:
    if not is_device_tensor(tensor):
        raise RuntimeError(f"{what}: a tensor on cpu reached a model on {device} "
                           f"(move every batch to the model's device before the forward)")
    return on_host(tensor)


def _packed(value, device: torch.device, what: str):
    """megatron's ``PackedSeqParams`` with its tensors checked and taken to the host, like any input."""
    if not dataclasses.is_dataclass(value) or isinstance(value, type):
        return value
    changes, seen = {}, {}  # one tensor in two fields (cu_seqlens_q and _kv) stays one tensor
    for f in dataclasses.fields(value):
        tensor = getattr(value, f.name)
        if torch.is_tensor(tensor):
            if id(tensor) not in seen:
                seen[id(tensor)] = _require(tensor, device, f"{what}.{f.name}")
            changes[f.name] = seen[id(tensor)]
    out = dataclasses.replace(value, **changes)
    if hasattr(value, "hpa_chunks"):  # the attention's chunk layout (``hpa.models.specs.ChunkLayout``), an input too
        out.hpa_chunks = value.hpa_chunks.moved(lambda x: _require(x, device, f"{what}.hpa_chunks"))
    return out


def install(gpt, device: torch.device):
    """Put ``device`` at the edges of the CPU GPTModel ``gpt`` (see the module docstring); returns ``gpt``."""
    name = type(gpt).__name__

    def inputs(_module, args, kwargs):
        args = tuple(_require(a, device, f"{name} input {i}") if torch.is_tensor(a) else a
                     for i, a in enumerate(args))
        kwargs = {k: _require(v, device, f"{name} input {k}") if torch.is_tensor(v) else
                  _packed(v, device, f"{name} input {k}") for k, v in kwargs.items()}
        enter_model()
        return args, kwargs

    def outputs(_module, _args, _kwargs, output):
        leave_model()
        return on_device(output) if torch.is_tensor(output) else output

    def decoder_output(_module, _args, output):
        # the final hidden states are a model output too (hpa captures them for pooling)
        if isinstance(output, tuple):
            return (on_device(output[0]), *output[1:])
        return on_device(output)

    def head_input(_module, args, kwargs):
        return tuple(on_host(a) if torch.is_tensor(a) else a for a in args), kwargs

    gpt.register_forward_pre_hook(inputs, with_kwargs=True)
    gpt.register_forward_hook(outputs, with_kwargs=True)
    gpt.decoder.register_forward_hook(decoder_output)
    if gpt.post_process:
        gpt.output_layer.register_forward_pre_hook(head_input, with_kwargs=True)
    return gpt
