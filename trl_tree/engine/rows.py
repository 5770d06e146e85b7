"""TRL's padded rollout tensors <-> the per-sequence lists the tree engine takes.

TRL keeps a micro-batch as ``prompt_ids`` (left-padded) next to ``completion_ids`` (right-padded),
concatenated into one ``(B, L)`` matrix with an attention mask, and wants per-token log-probs for
the last ``logits_to_keep`` columns. The tree needs each row's real tokens only; this module cuts
them out once and puts the tree's flat result back where TRL's padded computation would have
written it (padding columns get 0, which TRL masks out of every loss and metric).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch

from ._device import upload


@dataclass
class PaddedRows:
    """The real tokens of each row of a padded ``(B, L)`` batch and where their scores go.

    ``sequences[i]`` are row ``i``'s unmasked tokens, ``score_from[i]`` the index (in that list)
    of its first completion token; ``rows``/``cols`` place the tree's flat scores (sequence order)
    into the ``(B, logits_to_keep)`` output.
    """

    sequences: list[torch.Tensor]
    score_from: list[int]
    rows: torch.Tensor
    cols: torch.Tensor
    shape: tuple[int, int]
    #: the sequences on the host (int64 arrays), where the rows were made from host memory or read
    #: back once (``host_sequences``)
    host: list[np.ndarray] | None = None

    @classmethod
    def from_padded(cls, input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int) -> PaddedRows:
        if input_ids.dim() != 2 or attention_mask.shape != input_ids.shape:
            raise ValueError(
                f"expected input_ids and attention_mask of one (batch, length) shape, got "
                f"{tuple(input_ids.shape)} and {tuple(attention_mask.shape)}"
            )
        B, L = input_ids.shape
        if not 0 < logits_to_keep < L:
            raise ValueError(f"logits_to_keep must be in [1, {L - 1}] for rows of length {L}, got {logits_to_keep}")
        first_completion = L - logits_to_keep
        mask = attention_mask.detach().to("cpu", torch.bool).numpy()
        ids = input_ids.detach()
        sequences, score_from, rows, cols = [], [], [], []
        for i in range(B):
            real = np.flatnonzero(mask[i])
            if real.size == 0:
                raise ValueError(f"row {i} of the batch has no unmasked token")
            start, stop = int(real[0]), int(real[-1]) + 1
            if real.size != stop - start:
                # TRL pads prompts on the left and completions on the right; a hole in the middle
                # would make position ids (and so the tree) differ from the padded computation
                raise ValueError(
                    f"row {i}'s attention mask is not one contiguous run of ones (prompt left-padded, completion "
                    "right-padded); the tree cannot reproduce such a row. Use tree_mode='off' for this data."
                )
            if start >= first_completion:
                raise ValueError(f"row {i} has no prompt token before its completion; nothing predicts its first token")
            sequences.append(ids[i, start:stop])
            n_scored = max(stop - first_completion, 0)
            score_from.append(stop - start - n_scored)
            rows.append(np.full(n_scored, i))
            cols.append(np.arange(n_scored))
        rows_t, cols_t = upload([np.concatenate(rows), np.concatenate(cols)], torch.int64, input_ids.device)
        return cls(sequences=sequences, score_from=score_from, rows=rows_t, cols=cols_t, shape=(B, logits_to_keep))

    @classmethod
    def from_sequences(cls, sequences: list[torch.Tensor], score_from: list[int]) -> PaddedRows:
        """Rows given as real tokens (``sequences[i]`` scored from ``score_from[i]`` on), laid out as
        a ``(B, longest scored run)`` output — how a rank holds the rows of the trees it computes
        for others (``trainers.window``)."""
        counts = [len(s) - f for s, f in zip(sequences, score_from)]
        if any(c < 1 or f < 1 for c, f in zip(counts, score_from)):
            raise ValueError("every row needs a prompt token and at least one scored token")
        device = sequences[0].device if sequences else torch.device("cpu")
        rows = np.concatenate([np.full(c, i) for i, c in enumerate(counts)]) if counts else np.zeros(0)
        cols = np.concatenate([np.arange(c) for c in counts]) if counts else np.zeros(0)
        rows_t, cols_t = upload([rows, cols], torch.int64, device)  # queued, no wait for the GPU
        return cls(sequences=list(sequences), score_from=list(score_from), rows=rows_t, cols=cols_t,
                   shape=(len(counts), max(counts, default=0)))

    @classmethod
    def from_host(cls, sequences: list[np.ndarray], score_from: list[int], device: torch.device) -> PaddedRows:
        """``from_sequences`` of rows held on the host: every row travels in one copy (each a view of
        it on ``device``), not one synchronising copy per row, and the host arrays are kept."""
        on_device = upload(sequences, torch.int64, device)
        return dataclasses.replace(cls.from_sequences(on_device, score_from),
                                   host=[np.asarray(s, dtype=np.int64) for s in sequences])

    def host_sequences(self) -> list[np.ndarray]:
        """The sequences as int64 host arrays: read back in one copy the first time (one wait for
        the GPU, not one per row), kept after."""
        if self.host is None:
            lengths = [len(s) for s in self.sequences]
            flat = torch.cat(self.sequences).detach().to("cpu", torch.int64).numpy() if self.sequences \
                else np.zeros(0, np.int64)
            self.host = np.split(flat, np.cumsum(lengths)[:-1]) if lengths else []
        return self.host

    @property
    def scored_counts(self) -> list[int]:
        """Scored tokens of each row."""
        return [len(s) - f for s, f in zip(self.sequences, self.score_from)]

    def flat(self, padded: torch.Tensor) -> torch.Tensor:
        """The scored entries of a ``(B, logits_to_keep)`` tensor, row by row (the inverse of
        ``to_padded`` over all rows in order)."""
        return padded[self.rows, self.cols]

    def subset(self, index: list[int]) -> tuple[list[torch.Tensor], list[int]]:
        """Sequences and score offsets of the rows ``index`` (one tree call)."""
        return [self.sequences[i] for i in index], [self.score_from[i] for i in index]

    def positions(self, calls: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """``(rows, cols)`` in the ``(B, logits_to_keep)`` output of the calls' flat scores, in call
        order (each call's rows in the given order, each row's scored tokens left to right)."""
        counts = self.scored_counts
        starts = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
        order = [i for call in calls for i in call]
        take = np.concatenate([np.arange(starts[i], starts[i] + counts[i]) for i in order]) if order else np.zeros(0)
        (take,) = upload([take], torch.int64, self.rows.device)  # no wait for the queued forward
        return self.rows.index_select(0, take), self.cols.index_select(0, take)

    def call_terms(self, call: list[int]):
        """Where one tree call's terms sit in the ``(B, logits_to_keep)`` output, and the map from the
        engine's ``(seq_idx, pos)`` of a term to its index in the call's flat terms (what a second
        pass needs to read per-token weights ``grad[where][index(seq_idx, pos)]``)."""
        seqs, score_from = self.subset(call)
        counts = [len(s) - f for s, f in zip(seqs, score_from)]
        offsets, first = upload([np.cumsum([0] + counts[:-1]), [f - 1 for f in score_from]], torch.int64,
                                self.rows.device)

        def index(seq_idx: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
            return offsets[seq_idx] + pos - first[seq_idx]

        return self.positions([call]), index

    def to_padded(self, flat_per_call: list[torch.Tensor], calls: list[list[int]]) -> torch.Tensor:
        """Scatter the tree calls' flat scores (each in its rows' order) into ``(B, logits_to_keep)``.

        Differentiable: ``index_put`` on zeros keeps the graph of ``flat``.
        """
        flat = torch.cat(flat_per_call) if len(flat_per_call) > 1 else flat_per_call[0]
        return flat.new_zeros(self.shape).index_put(self.positions(calls), flat)
