"""An SFT micro-batch (what TRL's ``DataCollatorForLanguageModeling`` hands the model) as the
sequences a tree call takes, and the per-token loss mask in the same layout as their scores.

Stock ``SFTTrainer`` runs ``model(input_ids, attention_mask | position_ids, labels)`` with its fused
LM head, which scores position ``t`` of a row wherever ``labels[t + 1] != -100``. The tree needs
each sample's real tokens: a padded row's unmasked run (right-padded), or, padding-free (and under
``packing``), each segment of the flat row whose ``position_ids`` restart at 0. A sample is cut after
its last labelled token (later tokens are never attended to by a scored one) and scored from its
first labelled token on; the labelled positions in between carry weight 1, the others 0 — so a
multi-turn ``assistant_only_loss`` sample keeps its user turns out of the loss, as stock does.

An MoE model's load-balancing loss is the exception (``every_token``): stock's counts the router
logits of every real token of the batch, labelled or not, so there a sample keeps its tokens after
the last label (scored with weight 0) and a sample with no label at all stays in, scored at its
last token with weight 0 — every token the batch holds is in the tree, once per sample through it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ...engine._device import upload
from ...engine.rows import PaddedRows


@dataclass
class SFTRows:
    """The labelled samples of one micro-batch, laid out for the tree.

    ``rows`` places each sample's scored tokens in a ``(samples, longest scored run)`` grid
    (``PaddedRows.from_sequences``); ``mask`` is 1.0 on that grid where stock's loss counts the
    token. Samples with no labelled token are dropped (they add nothing to the loss or metrics).
    """

    rows: PaddedRows
    mask: torch.Tensor
    #: per kept sample: its batch row and the column of its first scored prediction in the batch's
    #: ``(B, L - 1)`` next-token layout (TRL's fused head's), for ``to_batch``
    batch_rows: np.ndarray | None = None
    batch_cols: np.ndarray | None = None

    @property
    def empty(self) -> bool:
        return not self.rows.sequences

    @classmethod
    def from_batch(cls, inputs: dict, name: str = "TreeSFTTrainer", every_token: bool = False) -> SFTRows:
        """``every_token``: keep every real token in the rows (see the module docstring), for a loss
        that counts tokens no label covers (the MoE load-balancing loss)."""
        input_ids, labels = inputs.get("input_ids"), inputs.get("labels")
        if input_ids is None or labels is None:
            raise ValueError(f"{name}: the batch needs 'input_ids' and 'labels' (TRL's SFT collators give both); got "
                             f"{sorted(inputs)}")
        if input_ids.shape != labels.shape or input_ids.dim() != 2:
            raise ValueError(f"{name}: input_ids {tuple(input_ids.shape)} and labels {tuple(labels.shape)} must be "
                             "one (batch, length) shape")
        ids = input_ids.detach().cpu().numpy()
        lab = labels.detach().cpu().numpy()
        if "attention_mask" in inputs:
            spans = _padded_spans(inputs["attention_mask"].detach().cpu().numpy(), name)
        elif "position_ids" in inputs:
            spans = _segment_spans(inputs["position_ids"].detach().cpu().numpy(), name)
        else:
            raise ValueError(f"{name}: the batch has neither 'attention_mask' nor 'position_ids'")
        sequences, score_from, masks, where = [], [], [], []
        for r, start, stop in spans:
            seg_ids, seg_lab = ids[r, start:stop], lab[r, start:stop]
            scored = np.flatnonzero(seg_lab[1:] != -100) + 1  # label t is predicted from position t - 1
            if scored.size == 0:
                if not every_token:
                    continue
                if stop - start < 2:
                    raise ValueError(
                        f"{name}: row {r} holds a one-token sample at position {start} with no label; the MoE "
                        "load-balancing loss counts its router logits, which a tree row (a token and the "
                        "prediction after it) cannot hold. Drop such samples or use tree_mode='off'")
                sequences.append(input_ids.new_tensor(seg_ids))
                score_from.append(stop - start - 1)
                masks.append(np.zeros(1, dtype=bool))
                where.append((r, stop - 2))
                continue
            wrong = seg_lab[scored] != seg_ids[scored]
            if wrong.any():
                t = int(scored[np.flatnonzero(wrong)[0]])
                raise ValueError(
                    f"{name}: row {r} has label {int(seg_lab[t])} at position {start + t} where its input token is "
                    f"{int(seg_ids[t])}. The tree scores each sample's own next token (what TRL's collators put in "
                    "'labels'); labels that differ from the inputs need tree_mode='off'")
            first, last = int(scored[0]), int(scored[-1]) if not every_token else stop - start - 1
            sequences.append(input_ids.new_tensor(seg_ids[: last + 1]))
            score_from.append(first)
            masks.append(seg_lab[first : last + 1] != -100)
            where.append((r, start + first - 1))  # label t is scored at column t - 1
        rows = PaddedRows.from_sequences(sequences, score_from)
        mask = np.zeros(rows.shape, dtype=np.float32)
        for i, m in enumerate(masks):
            mask[i, : m.size] = m
        batch_rows, batch_cols = (np.array(x, dtype=np.int64) for x in zip(*where)) if where else (None, None)
        return cls(rows=rows, mask=torch.from_numpy(mask).to(input_ids.device), batch_rows=batch_rows,
                   batch_cols=batch_cols)

    def to_batch(self, grid: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
        """A ``(samples, scored)`` grid (masked: zero where stock scores nothing) in the batch's
        ``(B, L - 1)`` next-token layout, zeros elsewhere — where TRL's fused head puts its outputs.
        Differentiable (``index_put`` on zeros)."""
        flat = grid[self.rows.rows, self.rows.cols]
        return flat.new_zeros(shape).index_put(self._batch_index(grid.device), flat)

    def _batch_index(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Each scored cell's ``(row, column)`` in the batch layout, uploaded once per batch without
        waiting for the GPU (a plain ``.to(device)`` would, between a forward and its loss)."""
        cached = getattr(self, "_index", None)
        if cached is None or cached[0].device != device:
            counts = self.rows.scored_counts
            cols = np.concatenate([c + np.arange(n) for c, n in zip(self.batch_cols, counts)])
            cached = self._index = tuple(upload([np.repeat(self.batch_rows, counts), cols], torch.int64, device))
        return cached


def _padded_spans(attention_mask: np.ndarray, name: str) -> list[tuple[int, int, int]]:
    """``(row, start, stop)`` of each row's unmasked run; a hole in it is refused (the positions the
    model gives the tokens after it would differ from the tree's depths)."""
    spans = []
    for r in range(attention_mask.shape[0]):
        real = np.flatnonzero(attention_mask[r])
        if real.size == 0:
            continue
        start, stop = int(real[0]), int(real[-1]) + 1
        if real.size != stop - start:
            raise ValueError(f"{name}: row {r}'s attention mask is not one run of ones; the tree cannot reproduce "
                             "such a row. Use tree_mode='off' for this data")
        spans.append((r, start, stop))
    return spans


def _segment_spans(position_ids: np.ndarray, name: str) -> list[tuple[int, int, int]]:
    """``(row, start, stop)`` of each padding-free segment: a run whose positions count up from 0."""
    spans = []
    for r in range(position_ids.shape[0]):
        pos = position_ids[r]
        starts = np.flatnonzero(pos == 0)
        if starts.size == 0 or starts[0] != 0:
            raise ValueError(f"{name}: row {r}'s position_ids do not start at 0")
        bounds = list(starts) + [pos.size]
        for start, stop in zip(bounds[:-1], bounds[1:]):
            if not np.array_equal(pos[start:stop], np.arange(stop - start)):
                raise ValueError(f"{name}: row {r}'s position_ids are not runs 0, 1, 2, ... (one per sample); the "
                                 "tree cannot place such tokens. Use tree_mode='off' for this data")
            spans.append((r, int(start), int(stop)))
    return spans
