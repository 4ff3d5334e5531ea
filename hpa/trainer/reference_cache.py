"""The reference's summed response log-probs of the offline preference pairs, computed once and reused by
every step, epoch and resume (``data.cache_reference_log_probs``): the pairs are fixed and the reference is
frozen, so a reference forward over each step's pairs repeats the same work.

Layout of ``<trainer.run_dir>/reference_log_probs/``::

    key.json         what the values depend on (``cache_key``)
    shard_00001.pt   {"indices": [n], "log_probs": [n, 2]}: the pairs DP rank 1 computed, (chosen, rejected)
    manifest.json    every file with its size and sha256 (``checkpoint.seal``); written last

DP rank ``r`` of ``dp`` computes the pairs ``i`` with ``i % dp == r``; its rank with TP rank 0 on the first
pipeline stage writes them (forward passes hand every stage the last stage's results), and every rank then
holds the whole table ``[N, 2]``, gathered over DP: across epochs the pair sampler hands any pair to any rank.
Like a checkpoint, the directory is written as ``.tmp`` and renamed when complete. At start-up the main rank
verifies the manifest and compares the key: a match is reused (whatever the DP size); a changed key rebuilds
it, and so does a corrupt or truncated file, with a warning naming it (the reference's fingerprint in the key,
``weights_digest``: a cache built by an hpa that fingerprinted otherwise is rebuilt once). The values are those of
``phases.reference_pair_log_probs``, the live path's own function, so cached and live are the same bits.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Callable, Dict, Optional, Sequence, Tuple

import torch

from hpa.distributed import comm
from hpa.distributed.groups import ParallelGroups
from hpa.models.heads import unwrap
from hpa.models.lora import is_adapter_key
from hpa.trainer.checkpoint import CheckpointError, file_sha256, seal, verify

logger = logging.getLogger("hpa")

DIRECTORY = "reference_log_probs"
KEY = "key.json"


def cache_key(pairs: Sequence, reference, groups: ParallelGroups, *, preference_path: str, model_cfg,
              parallel_cfg, vocab_size: int, pad_id: int, packed: bool = False) -> Dict:
    """Everything the cached values depend on.

    The pairs' token ids stand for the tokenizer and every data setting that shapes them (lengths,
    truncation, chat template, EOS); the reference's weights are hashed as loaded (``model.reference_path``,
    the initial policy, or a seeded initialisation alike); the model section (dtype, architecture) and the
    TP/PP layout and the packing of the pair (``trainer.sequence_packing``) change the rounding. The DP size
    does not: each pair is computed alone.
    """
    import megatron.core

    path = Path(preference_path)
    return {"pairs_sha256": _pairs_digest(pairs), "num_pairs": len(pairs),
            "preference_file_sha256": file_sha256(path) if path.is_file() else None,
            "reference_sha256": weights_digest(reference, groups),
            "model": {k: v for k, v in dataclasses.asdict(model_cfg).items() if not k.endswith("_path")},
            "tensor_model_parallel_size": parallel_cfg.tensor_model_parallel_size,
            "pipeline_model_parallel_size": parallel_cfg.pipeline_model_parallel_size,
            "sequence_parallel": parallel_cfg.sequence_parallel, "vocab_size": vocab_size, "pad_id": pad_id,
            "sequence_packing": packed, "device": groups.device.type, "torch": torch.__version__, "megatron_core": megatron.core.__version__}


def _pairs_digest(pairs: Sequence) -> str:
    h = hashlib.sha256()
    for e in pairs:
        h.update(json.dumps([e.prompt_ids, e.chosen_ids, e.rejected_ids]).encode())
    return h.hexdigest()


def weights_digest(model, groups: ParallelGroups) -> str:
    """sha256 of a model's weights under its layout: each rank hashes its shard, the digests of the
    (pipeline stage, TP rank) shards are hashed together (DP replicas hold the same shards).

    Each tensor is reduced to two 64-bit sums on its own device (``_word_sums``); the shard's ``[T, 2]`` sums
    come to the host in one copy and are hashed with every tensor's name, dtype and shape."""
    weights = [(name, tensor) for name, tensor in sorted(unwrap(model).state_dict().items())
               # a LoRA reference is the base with the adapters off: the (trained) adapters are not its weights
               if isinstance(tensor, torch.Tensor) and not name.endswith("_extra_state") and not is_adapter_key(name)]
    h = hashlib.sha256("\n".join(f"{name} {t.dtype} {tuple(t.shape)}" for name, t in weights).encode())
    if weights:
        tables: Dict[torch.device, torch.Tensor] = {}  # the factors, as many as the longest chunk needs
        longest = min(_CHUNK, max(t.numel() * t.element_size() for _, t in weights) // 4 + 3)
        sums = [_word_sums(t, tables, longest) for _, t in weights]
        h.update(torch.stack([s.to(sums[0].device) for s in sums]).cpu().numpy().tobytes())  # [T, 2]: one copy
    shards = sorted(set(comm.all_gather_objects((groups.pp_rank, groups.tp_rank, h.hexdigest()), None)))
    return hashlib.sha256(json.dumps(shards).encode()).hexdigest()


_CHUNK = 1 << 20  # words a step: the int64 temporaries of one tensor stay at a few times 8 MiB
_SEEDS = (0x1F83D9ABFB41BD6B, 0x5BE0CD19137E2179)  # one per sum (sha512's initial words, as int64)
_MIX = (-0x40A7B892E31B1A47, -0x6B2FB644ECCEEE15)  # splitmix64's multipliers, as int64


def _to_int64(x: int) -> int:
    x &= (1 << 64) - 1
    return x - (1 << 64) if x >> 63 else x


def _odd_mix(x: int) -> int:
    """splitmix64's finaliser of a host integer, made odd, as int64."""
    x &= (1 << 64) - 1
    for shift, multiplier in zip((30, 27), _MIX):
        x = ((x ^ (x >> shift)) * multiplier) & ((1 << 64) - 1)
    return _to_int64((x ^ (x >> 31)) | 1)


def _factor_table(length: int, device: torch.device) -> torch.Tensor:
    """``[len(_SEEDS), length]`` int64: the same finaliser of ``position + seed`` on the device (int64 wraps;
    torch's ``>>`` is arithmetic, the masks make it logical)."""
    rows = []
    for seed in _SEEDS:
        x = torch.arange(length, dtype=torch.int64, device=device) + seed
        for shift, multiplier in zip((30, 27), _MIX):
            x = (x ^ ((x >> shift) & ((1 << (64 - shift)) - 1))) * multiplier
        rows.append((x ^ ((x >> 31) & ((1 << 33) - 1))) | 1)
    return torch.stack(rows)


def _word_sums(tensor: torch.Tensor, tables: Dict[torch.device, torch.Tensor], table_length: int) -> torch.Tensor:
    """``[2]`` int64 on the tensor's device, no read back to the host: the tensor's bytes read as int32 words
    (its last ``nbytes % 4`` bytes one word each, a chunk of their own) in chunks of ``_CHUNK`` words;
    ``sum_j g_j * sum_i word_ji * f_i`` modulo 2**64 for each of two seeds, with odd factors ``f_i`` by place
    in the chunk (``tables[device]``, built once a digest, ``table_length`` of them) and ``g_j`` by chunk. A
    product of odd numbers is odd, so a change of any one word changes both sums."""
    data = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
    if data.device not in tables:
        tables[data.device] = _factor_table(table_length, data.device)
    table = tables[data.device]
    whole = data.numel() // 4 * 4
    if data.storage_offset() % 4:  # a view at an odd place in its storage: int32 words need an aligned copy
        data = data.clone()
    words = data[:whole].view(torch.int32)
    parts = [words[i:i + _CHUNK] for i in range(0, words.numel(), _CHUNK)] + [data[whole:]]
    sums = torch.zeros(len(_SEEDS), dtype=torch.int64, device=data.device)
    for j, part in enumerate(parts):
        if part.numel():
            chunk = (part.to(torch.int64) * table[:, :part.numel()]).sum(dim=1)  # [2]
            sums = sums + chunk * _odd_mix(j)
    return sums


def load_or_build(directory: Path, key: Dict, pairs: Sequence, compute: Callable[[list], torch.Tensor],
                  groups: ParallelGroups) -> torch.Tensor:
    """The reference's log-probs of every pair ``[N, 2]`` (chosen, rejected), on every rank: read from
    ``directory`` when it verifies and holds ``key``, else computed with ``compute(examples) -> [m, 2]``
    (a collective of every rank) and written there."""
    start = time.perf_counter()
    table, reason = _stored(directory, key, len(pairs)) if groups.is_main else (None, None)
    reason = comm.broadcast_object(reason, src=0)
    if reason is None:
        if groups.is_main:  # it keeps the table it checked
            logger.info("reference log-prob cache: reused %s (%d pairs) in %.2f s", directory, len(pairs),
                        time.perf_counter() - start)
        else:
            table = _read(directory, len(pairs))
        return table
    table = _build(directory, key, pairs, compute, groups)
    if groups.is_main:
        logger.info("reference log-prob cache: built %s (%d pairs; %s) in %.2f s", directory, len(pairs), reason,
                    time.perf_counter() - start)
    return table


def _stored(directory: Path, key: Dict, num_pairs: int) -> Tuple[Optional[torch.Tensor], Optional[str]]:
    """``(table, None)`` when ``directory`` verifies, holds ``key`` and every pair; else ``(None, why not)``
    (main rank). Reading the shards is part of the check, so the table it read is returned rather than read
    again."""
    if not directory.is_dir():
        return None, "none was there"
    try:
        verify(directory)
        stored = json.loads((directory / KEY).read_text())
        key = json.loads(json.dumps(key))  # as stored: a tuple in the key (model.lora.target_modules) reads back a list
        changed = sorted(k for k in key.keys() | stored.keys() if key.get(k) != stored.get(k))
        if changed:
            return None, f"changed: {', '.join(changed)}"
        return _read(directory, num_pairs), None
    except Exception as exc:  # a manifest, key or shard that does not read back means: build it again
        logger.warning("reference log-prob cache unusable, rebuilding it: %s", exc)
        return None, f"the old one was unusable: {exc}"


def _read(directory: Path, num_pairs: int) -> torch.Tensor:
    table = torch.full((num_pairs, 2), float("nan"))
    seen = torch.zeros(num_pairs, dtype=torch.bool)
    for shard in sorted(directory.glob("shard_*.pt")):
        data = torch.load(shard, weights_only=True)
        table[data["indices"]] = data["log_probs"]
        seen[data["indices"]] = True
    if not seen.all():
        raise CheckpointError(f"{directory}: the shards hold {int(seen.sum())} of the {num_pairs} pairs")
    return table


def _build(directory: Path, key: Dict, pairs: Sequence, compute: Callable[[list], torch.Tensor],
           groups: ParallelGroups) -> torch.Tensor:
    tmp = directory.with_name(directory.name + ".tmp")
    if groups.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    comm.barrier()
    dp, n = groups.data_parallel_size, len(pairs)
    mine = torch.arange(groups.dp_rank, n, dp)  # [n_r]
    values = compute([pairs[i] for i in mine.tolist()]).float()  # [n_r, 2]
    if groups.tp_rank == 0 and groups.pp_rank == 0 and groups.cp_rank == 0:
        torch.save({"indices": mine, "log_probs": values}, tmp / f"shard_{groups.dp_rank:05d}.pt")
    width = -(-n // dp)  # ranks hold n // dp or n // dp + 1 pairs; all_gather wants equal shapes
    indices = comm.all_gather_cat(torch.cat([mine, mine.new_full((width - len(mine),), -1)]), groups.dp_group)
    gathered = comm.all_gather_cat(torch.cat([values, values.new_zeros(width - len(mine), 2)]), groups.dp_group)
    table = torch.empty(n, 2)
    table[indices[indices >= 0]] = gathered[indices >= 0]
    comm.barrier()
    if groups.is_main:
        (tmp / KEY).write_text(json.dumps(key, indent=1, sort_keys=True))
        seal(tmp, {"num_pairs": n, "num_shards": dp})
        shutil.rmtree(directory, ignore_errors=True)
        os.replace(tmp, directory)
    comm.barrier()
    return table
