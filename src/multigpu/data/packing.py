"""Padding-free packing: documents laid end to end in sequences of at most `capacity` tokens, none seeing another.

`pack` decides which documents share a sequence (a bin): first-fit-decreasing within consecutive windows of
documents, so that it is deterministic (a resume recomputes the same bins from the same lengths), streams (a window
at a time) and keeps the bins in the data's order. `PackedSamples` makes each bin one sample whose position_ids
restart at 0 for each document, and `collate_packed` batches them without an attention mask: given position_ids
and no attention_mask, a Hugging Face decoder (transformers >= 4.53) turns every restart of the positions into a
block-diagonal causal mask under sdpa, eager and flex attention, and flash-attention's varlen call takes the
document boundaries (multigpu.parallel.decoder.packed_attention_kwargs). Labels come aligned per document
(labels[t] is the target of input_ids[t]), so no target ever crosses from one document to the next, and the loss,
summed over the targets and divided by their number over the global batch, is the loss of the same documents
unpacked.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

IGNORE = -100  # cross_entropy's default ignore_index


def pack(lengths: Sequence[int], capacity: int, window: int = 1024) -> list[list[int]]:
    """Bins of document indices whose lengths sum to at most `capacity`: each run of `window` documents is
    packed first-fit-decreasing on its own (the longest first, each into the first of the run's bins with room),
    and its bins follow the previous run's. Each bin lists its documents in the data's order."""
    if capacity < 1 or window < 1:
        raise ValueError(f"pack needs a capacity and a window of 1 or more, not {capacity} and {window}")
    lengths = np.asarray(lengths, dtype=np.int64)
    too_long = np.flatnonzero((lengths > capacity) | (lengths < 1))
    if too_long.size:
        first = int(too_long[0])
        raise ValueError(f"document {first} has {int(lengths[first])} tokens; pack takes 1 to {capacity} a document")
    bins: list[list[int]] = []
    for start in range(0, len(lengths), window):
        run = lengths[start : start + window]
        free = np.empty(len(run), dtype=np.int64)  # room left in each of this run's bins (at most one per document)
        opened: list[list[int]] = []
        for index in np.argsort(-run, kind="stable"):  # longest first; equal lengths in the data's order
            fits = np.flatnonzero(free[: len(opened)] >= run[index])
            if fits.size:
                place = int(fits[0])
            else:
                place = len(opened)
                opened.append([])
                free[place] = capacity
            opened[place].append(start + int(index))
            free[place] -= run[index]
        bins += [sorted(documents) for documents in opened]
    return bins


def packing_efficiency(lengths: Sequence[int], bins: list[list[int]], capacity: int) -> float:
    """The share of the bins' token slots (capacity each) that documents fill: 1 - the padding a batch of full
    rows would add. Padded one document a row, the same share is mean(lengths) / capacity."""
    return float(sum(lengths)) / (len(bins) * capacity) if bins else 0.0


class PackedSamples(Dataset):
    """Sample i is bin i's documents end to end: their input_ids and labels concatenated, and position_ids that
    restart at 0 for each document. `documents[j]` is a dict with equal-length "input_ids" and "labels"."""

    def __init__(self, documents: Dataset, bins: list[list[int]]) -> None:
        self.documents, self.bins = documents, bins

    def __len__(self) -> int:
        return len(self.bins)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        parts = [self.documents[j] for j in self.bins[index]]
        return {
            "input_ids": torch.cat([part["input_ids"] for part in parts]),
            "labels": torch.cat([part["labels"] for part in parts]),
            "position_ids": torch.cat([torch.arange(len(part["input_ids"])) for part in parts]),
        }


def collate_packed(samples: list[dict[str, torch.Tensor]], pad_id: int, multiple: int = 1) -> dict[str, torch.Tensor]:
    """Right-pads a batch of packed samples to its longest, rounded up to a `multiple` (sequence parallelism splits
    the positions over that many processes): input_ids with pad_id, labels with -100, and position_ids from 0, so
    that the padding is a document of its own, which no real token attends to. No attention_mask: the model reads
    the documents from the position_ids (a mask given would hide them)."""
    longest = max(len(s["input_ids"]) for s in samples)
    width = -(-longest // multiple) * multiple
    input_ids = torch.full((len(samples), width), pad_id, dtype=torch.long)
    labels = torch.full_like(input_ids, IGNORE)
    position_ids = torch.arange(width).repeat(len(samples), 1)
    for row, sample in enumerate(samples):
        n = len(sample["input_ids"])
        input_ids[row, :n], labels[row, :n] = sample["input_ids"], sample["labels"]
        position_ids[row, :n] = sample["position_ids"]
        position_ids[row, n:] -= n  # the padding's own positions, from 0
    return {"input_ids": input_ids, "labels": labels, "position_ids": position_ids}


def packed_lengths(documents: Dataset) -> list[int]:
    """Each document's number of input tokens: what `pack` takes."""
    return [len(documents[i]["input_ids"]) for i in range(len(documents))]


def model_inputs(batch: dict[str, Any]) -> dict[str, Any]:
    """What a Hugging Face decoder (or its pipeline stages) takes of a packed batch: the tokens and their positions,
    no attention_mask, and no cache: with a cache (the config's use_cache, on by default even in training)
    transformers ignores the positions when it builds the mask, and every token sees the documents before it."""
    return {"input_ids": batch["input_ids"], "position_ids": batch["position_ids"], "use_cache": False}
