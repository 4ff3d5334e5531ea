"""One micro-batch and its token layout: padded rows, or rows packed into one sequence.

A micro-batch holds ``n`` rows (training sequences). Two things about it live in different layouts:

- **What enters the model** (``input_ids``, ``labels``, positions): padded, ``[n, s]`` with every row
  right-padded to the longest; or packed, ``[1, T]`` with the rows' real tokens one after the other
  (``T = sum(lengths)``), no pad computed, attention kept inside each row (megatron's THD
  ``PackedSeqParams``, ``packed_seq_params``) and positions restarting at 0 in every row.
- **Per-row data** (loss masks, response indices, old log-probs, advantages...): always in the row
  layout, ``[n, ...]``, with position-aligned tensors ``[n, s]`` as in the padded layout.

A consumer computes per-token quantities on the model's output in the model layout (log-probs, entropy
over the vocabulary: nothing is computed for pads) and calls ``unpack`` to put them in the row layout,
where every per-row reduction (gathers at response positions, masked sums, mean pooling) is the same
code for both layouts. ``response`` is the one gather from positions to response tokens.

Packing changes no number beyond the rounding of a different matmul shape: the padded layout's causal
attention already keeps pads out of every real position.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, List, Sequence, Tuple

import torch

from hpa.engine.sequences import gather_positions
from hpa.models.specs import ChunkLayout


@dataclasses.dataclass
class MicroBatch:
    """A micro-batch of ``n`` training rows (module docstring).

    Attributes:
        kind: what the rows are: ``"rollout"``, ``"pairs"`` (``m`` chosen rows, then their ``m`` rejected
            rows), ``"sft"``, ``"replay"`` (SFT examples replayed in an HPA step) or ``"rows"`` (anything else).
        input_ids, labels: ``[n, s]`` padded or ``[1, T]`` packed; ``labels[t]`` is the token after
            ``input_ids[t]`` within its row (pad after a row's last token).
        lengths: ``[n]`` int64, the positions of each row that enter the model when packed.
        packed: the layout of ``input_ids``/``labels``.
        rows: per-row tensors ``[n, ...]`` in the row layout, by name (``label_mask``, ``response_index``,
            ``pool_mask``, ``mask``, ``old_log_probs``, ``advantages``, ``ref_seq_logp``...).
        row_width: ``s``, the positions of the row layout (when packed; padded, it is ``input_ids``'s
            width); at least the longest row.
        parts: a ``"mixed"`` micro-batch's packed micro-batches of single streams, in the order of its tokens
            (``concat``); the model sees one sequence, each loss its own part (``split``). Empty otherwise.
    """

    kind: str
    input_ids: torch.Tensor
    labels: torch.Tensor
    lengths: torch.Tensor
    packed: bool = False
    rows: Dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    row_width: int = 0
    parts: Tuple["MicroBatch", ...] = ()

    def __post_init__(self):
        n = self.lengths.shape[0]
        if self.packed and self.row_width < (int(self.lengths.max()) if n else 0):
            raise ValueError(f"row_width {self.row_width} is shorter than the longest row {self.lengths.max()}")
        if self.packed:
            if self.input_ids.shape != (1, int(self.lengths.sum())):
                raise ValueError(f"a packed micro-batch of rows {self.lengths.tolist()} has input_ids of shape "
                                 f"{tuple(self.input_ids.shape)}")
        elif self.input_ids.shape[0] != n or (int(self.lengths.max()) if n else 0) > self.input_ids.shape[1]:
            raise ValueError(f"a padded micro-batch of rows {self.lengths.tolist()} has input_ids of shape "
                             f"{tuple(self.input_ids.shape)}")

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_padded(cls, kind: str, input_ids: torch.Tensor, labels: torch.Tensor, lengths: torch.Tensor, *,
                    packed: bool = False, **rows: torch.Tensor) -> "MicroBatch":
        """From right-padded ``[n, s]`` ids and labels whose row ``i`` is real on its first ``lengths[i]``
        positions; ``packed`` lays them out packed (the per-row data stays ``[n, ...]``)."""
        lengths = torch.as_tensor(lengths, dtype=torch.long)
        width = input_ids.shape[1]
        if packed:
            keep = torch.arange(width, device=input_ids.device)[None, :] < lengths.to(input_ids.device)[:, None]  # [n, s]
            input_ids, labels = input_ids[keep][None, :], labels[keep][None, :]
        return cls(kind=kind, input_ids=input_ids, labels=labels, lengths=lengths, packed=packed,
                   rows={k: v for k, v in rows.items() if v is not None}, row_width=width if packed else 0)

    @classmethod
    def of(cls, batch) -> "MicroBatch":
        """``batch`` itself, or a plain dict of padded ``input_ids``/``labels`` ``[n, s]`` (and per-row
        tensors) as a padded ``MicroBatch``."""
        if isinstance(batch, MicroBatch):
            return batch
        ids = batch["input_ids"]
        labels = batch.get("labels", torch.zeros_like(ids))
        rows = {k: v for k, v in batch.items()
                if torch.is_tensor(v) and k not in ("input_ids", "labels", "position_ids")}
        return cls(kind=batch.get("kind", "rows"), input_ids=ids, labels=labels,
                   lengths=torch.full((ids.shape[0],), ids.shape[1], dtype=torch.long), rows=rows)

    @classmethod
    def concat(cls, parts: Sequence["MicroBatch"]) -> "MicroBatch":
        """One packed micro-batch of kind ``"mixed"`` whose model inputs are those of ``parts`` (packed
        micro-batches, mixed ones flattened) one after the other: one forward and backward for all of them, with
        attention kept inside each row as in each part alone."""
        flat = [q for p in parts for q in (p.parts or (p,))]
        if not flat or not all(p.packed for p in flat):
            raise ValueError("only packed micro-batches are concatenated")
        return cls(kind="mixed", input_ids=torch.cat([p.input_ids for p in flat], dim=1),
                   labels=torch.cat([p.labels for p in flat], dim=1), lengths=torch.cat([p.lengths for p in flat]),
                   packed=True, row_width=max(p.width for p in flat), parts=tuple(flat))

    def split(self, *values: torch.Tensor) -> List[Tuple["MicroBatch", List[torch.Tensor]]]:
        """Each part with its slice of every model-layout ``[1, T, ...]`` tensor of ``values`` (outputs, hidden
        states, or a ``HeadInput``, which slices its hidden states; None stays None); a single-stream
        micro-batch is its own one part."""
        if not self.parts:
            return [(self, list(values))]
        out, start = [], 0
        for part in self.parts:
            end = start + part.tokens
            out.append((part, [v if v is None else v[:, start:end] for v in values]))
            start = end
        return out

    # ------------------------------------------------------------------ sizes

    @property
    def num_rows(self) -> int:
        return int(self.lengths.shape[0])

    @property
    def width(self) -> int:
        """``s``: the positions of a row in the row layout."""
        return self.row_width if self.packed else int(self.input_ids.shape[1])

    @property
    def tokens(self) -> int:
        """Real positions (what a packed forward computes)."""
        return int(self.lengths.sum())

    @property
    def computed_tokens(self) -> int:
        """Positions the model computes for this micro-batch (before sequence-parallel padding)."""
        return int(self.input_ids.numel())

    # ------------------------------------------------------------------ the model's side

    def position_ids(self) -> torch.Tensor:
        """Positions ``0..L_i-1`` of every row, in the model layout, on ``input_ids``'s device; computed once
        per micro-batch (packed: on the host from ``lengths``, then one copy)."""
        cache = self.__dict__.setdefault("_model_cache", {})
        if "position_ids" not in cache:
            if not self.packed:
                s = self.input_ids.shape[1]
                positions = torch.arange(s, device=self.input_ids.device).expand(self.input_ids.shape[0], s)
            else:
                starts = torch.cumsum(self.lengths, 0) - self.lengths
                host = torch.arange(self.tokens) - torch.repeat_interleave(starts, self.lengths)
                positions = host_to_device(host[None, :], self.input_ids.device)
            cache["position_ids"] = positions
        return cache["position_ids"]

    def packed_seq_params(self, pad: int = 0):
        """megatron's ``PackedSeqParams`` (THD) of a packed micro-batch, ``None`` when padded.

        ``cu_seqlens`` and the longest row come from the host's ``lengths`` (no read of a device value) and
        are copied to ``input_ids``'s device once per micro-batch and ``pad``.

        Args:
            pad: positions appended after the last row (sequence parallelism splits the sequence evenly);
                they form one more sequence of their own, so no row attends to them.
        """
        if not self.packed:
            return None
        from megatron.core.packed_seq_params import PackedSeqParams

        cache = self.__dict__.setdefault("_model_cache", {})
        if ("packed", pad) not in cache:
            lengths = self.lengths.tolist() + ([pad] if pad else [])
            host = torch.tensor([0] + lengths, dtype=torch.int32).cumsum(0, dtype=torch.int32)
            cu = host_to_device(host, self.input_ids.device)
            longest = max(lengths)
            params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                                     max_seqlen_q=longest, max_seqlen_kv=longest)
            # the chunks of rows of the attention without the varlen kernel: laid out on the host and copied at
            # its first read (the varlen kernel reads none)
            params.hpa_chunks = ChunkLayout(lengths).moved(lambda x: host_to_device(x, self.input_ids.device))
            cache[("packed", pad)] = params
        return cache[("packed", pad)]

    def unpack(self, values: torch.Tensor) -> torch.Tensor:
        """Per-position model outputs -> the row layout.

        Args:
            values: ``[n, s, ...]`` (padded) or ``[1, T, ...]`` (packed) -- log-probs, entropy, values,
                hidden states -- of this micro-batch's positions.

        Returns:
            ``[n, s, ...]``; when packed, 0 beyond each row's length (differentiable).
        """
        if not self.packed:
            return values
        rows, cols = self._positions(values.device)
        out = values.new_zeros((self.num_rows, self.width, *values.shape[2:]))
        return out.index_put((rows, cols), values[0, :rows.shape[0]])

    def pack(self, values: torch.Tensor) -> torch.Tensor:
        """The inverse of ``unpack``: row-layout ``[n, s, ...]`` -> the model layout."""
        if not self.packed:
            return values
        rows, cols = self._positions(values.device)
        return values[rows, cols][None]

    def _positions(self, device) -> tuple:
        """``(rows [T], cols [T])`` of the packed tokens on ``device``."""
        return self._host_cached("positions", device, self._host_positions)

    def _host_positions(self) -> tuple:
        rows = torch.repeat_interleave(torch.arange(self.num_rows), self.lengths)
        cols = torch.cat([torch.arange(int(n)) for n in self.lengths]) if self.num_rows else rows
        return rows, cols

    def row_offsets(self, device) -> tuple:
        """``(first model-layout token [n], length [n])`` of each row on ``device`` (packed)."""
        return self._host_cached("offsets", device, lambda: (torch.cumsum(self.lengths, 0) - self.lengths,
                                                             self.lengths))

    def label_positions(self, device):
        """``(rows [N], cols [N], flat [N])`` of the row-layout positions where ``label_mask`` is nonzero and the
        model computes a token (``flat``: its index in the model layout's tokens), on ``device``; None when the
        mask never was on the host (then the number of positions is known only on the device)."""
        host = self.__dict__.get("_host_rows", self.rows).get("label_mask")
        if host is None or host.device.type != "cpu":
            return None

        def build():
            rows, cols = host.nonzero(as_tuple=True)
            if self.packed:
                keep = cols < self.lengths[rows]
                rows, cols = rows[keep], cols[keep]
                flat = (torch.cumsum(self.lengths, 0) - self.lengths)[rows] + cols
            else:
                flat = rows * self.input_ids.shape[1] + cols
            return rows, cols, flat

        return self._host_cached("labels", device, build)

    def _host_cached(self, name: str, device, build) -> tuple:
        """``build()``'s host tensors on ``device``, built once per micro-batch and copied once per device without
        blocking; shared with every copy ``to`` makes."""
        cache = self.__dict__.setdefault("_position_cache", {})
        if name not in cache:
            cache[name] = {"cpu": tuple(t.contiguous() for t in build())}
        if str(device) not in cache[name]:
            cache[name][str(device)] = tuple(host_to_device(t, device) for t in cache[name]["cpu"])
        return cache[name][str(device)]

    # ------------------------------------------------------------------ the rows' side

    def response(self, per_position: torch.Tensor) -> torch.Tensor:
        """Row-layout ``[n, s, ...]`` -> ``[n, r, ...]`` at the response positions (``response_index``)."""
        return gather_positions(per_position, self.rows["response_index"])

    def to(self, device: torch.device) -> "MicroBatch":
        """A copy with every tensor on ``device`` (the one host-to-device point of a micro-batch)."""
        out = dataclasses.replace(self, input_ids=host_to_device(self.input_ids, device),
                                  labels=host_to_device(self.labels, device), lengths=self.lengths,
                                  rows={k: host_to_device(v, device) for k, v in self.rows.items()},
                                  parts=tuple(p.to(device) for p in self.parts))
        # the host-built positions travel with the copy, and so do the host rows they are built from
        out.__dict__["_position_cache"] = self.__dict__.setdefault("_position_cache", {})
        out.__dict__["_host_rows"] = self.__dict__.get("_host_rows", self.rows)
        return out

    # dict-style access (``batch["mask"]``, ``batch.get("is_weights")``) to fields and rows; writes go to rows
    def __setitem__(self, key: str, value) -> None:
        if key == "kind":
            self.kind = value
        elif torch.is_tensor(value):
            self.rows[key] = value
            if key == "label_mask":  # the label positions are built from it
                self.__dict__.pop("_host_rows", None)
                self.__dict__.get("_position_cache", {}).pop("labels", None)
        else:
            raise TypeError(f"micro-batch rows are tensors; {key!r} got {type(value).__name__}")

    def __getitem__(self, key: str):
        if key in self.rows:
            return self.rows[key]
        if key in ("kind", "input_ids", "labels", "lengths"):
            return getattr(self, key)
        if key == "position_ids":
            return self.position_ids()
        raise KeyError(key)

    def __contains__(self, key: str) -> bool:
        return key in self.rows or key in ("kind", "input_ids", "labels", "lengths", "position_ids")

    def get(self, key: str, default=None):
        return self[key] if key in self else default


def host_to_device(tensor: torch.Tensor, device) -> torch.Tensor:
    """``tensor`` on ``device``: from the host to a device without blocking the host (from pinned memory on
    CUDA, so the copy overlaps the work already queued); an ordinary ``.to`` otherwise."""
    device = torch.device(device)
    if device.type == "cpu" or tensor.device == device or tensor.device.type != "cpu":
        return tensor.to(device)
    tensor = tensor.contiguous()  # a strided view would be staged through pageable memory, a blocking copy
    if device.type == "cuda" and not tensor.is_pinned():
        tensor = tensor.pin_memory()
    return tensor.to(device, non_blocking=True)
