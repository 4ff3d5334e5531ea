"""The HF config directory an inference engine (vLLM) builds a policy from.

A megatron checkpoint has no ``config.json``; vLLM needs one to build the model it then fills with
weights synced from megatron (``load_format="dummy"``). ``write_hf_config_dir`` writes it from the
policy's ``ModelConfig``:

* the family is the one the checkpoint was imported from (``hpa convert`` leaves ``hpa_convert.json``
  next to it, with the original HF config, whose extra keys are kept), else ``qwen2`` for a model with
  q/k/v biases and ``llama`` otherwise;
* ``vocab_size`` is the tokenizer's when given: the embedding and LM-head rows beyond it (megatron's
  padding, or a Qwen2-style ``model.vocab_size`` larger than the tokenizer) are left out of the synced
  weights (``truncate_vocab``), so the engine can neither sample those ids nor normalise over them,
  the convention of ``hpa.rollout.base``;
* ``eos_token_id``/``pad_token_id`` are the tokenizer's (for readers of the file; the vLLM engine
  still passes EOS with every request, since vLLM built without a tokenizer knows no EOS).
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
from pathlib import Path
from typing import Iterable, Iterator, Optional, Tuple, Union

import torch

from hpa.config.schema import ModelConfig

from .convert import META_FILE, hf_config_from_model_config

# the HF tensors whose first dimension is the vocabulary
VOCAB_TENSORS = ("model.embed_tokens.weight", "lm_head.weight")


def checkpoint_family(path: Optional[Union[str, os.PathLike]], model_cfg: ModelConfig) -> Tuple[str, Optional[dict]]:
    """``(family, original HF config or None)`` of a policy checkpoint directory (see the module docstring)."""
    meta_file = Path(path) / META_FILE if path else None
    if meta_file is not None and meta_file.is_file():
        meta = json.loads(meta_file.read_text())
        return meta["family"], meta.get("hf_config")
    return ("qwen2" if model_cfg.add_qkv_bias else "llama"), None


def write_hf_config_dir(model_cfg: ModelConfig, out_dir: Optional[Union[str, os.PathLike]] = None, *,
                        vocab_size: Optional[int] = None, eos_token_id: Optional[int] = None,
                        pad_token_id: Optional[int] = None, checkpoint_path: Optional[str] = None,
                        dtype: Optional[str] = None) -> Path:
    """Write ``config.json`` for ``model_cfg``.

    Args:
        model_cfg: the policy's ``ModelConfig``.
        out_dir: where to write; default a new temporary directory (one per call, so ranks never share
            a file).
        vocab_size: the tokenizer's vocabulary (default ``model_cfg.vocab_size``); must not exceed it.
        eos_token_id, pad_token_id: the tokenizer's ids.
        checkpoint_path: the policy checkpoint (``model.policy_path``), for its family and HF config.
        dtype: the config's dtype (default ``model_cfg.params_dtype``).

    Returns:
        The directory.
    """
    vocab_size = vocab_size or model_cfg.vocab_size
    if vocab_size > model_cfg.vocab_size:
        raise ValueError(f"the tokenizer's vocabulary ({vocab_size}) is larger than model.vocab_size="
                         f"{model_cfg.vocab_size}; raise model.vocab_size")
    family, base = checkpoint_family(checkpoint_path, model_cfg)
    base = dict(base or {})
    for key, value in (("eos_token_id", eos_token_id), ("pad_token_id", pad_token_id)):
        if value is not None:
            base[key] = value
    config = hf_config_from_model_config(dataclasses.replace(model_cfg, vocab_size=vocab_size), family,
                                         dtype=dtype, base=base)
    out = Path(out_dir) if out_dir is not None else Path(tempfile.mkdtemp(prefix="hpa-hf-config-"))
    out.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(str(out))
    return out


def truncate_vocab(tensors: Iterable[Tuple[str, torch.Tensor]], vocab_size: int
                   ) -> Iterator[Tuple[str, torch.Tensor]]:
    """``(hf_name, tensor)`` with the embedding and LM-head rows cut to ``vocab_size``."""
    for name, tensor in tensors:
        if name in VOCAB_TENSORS and tensor.shape[0] > vocab_size:
            tensor = tensor[:vocab_size]
        yield name, tensor


__all__ = ["VOCAB_TENSORS", "checkpoint_family", "truncate_vocab", "write_hf_config_dir"]
