# Copyright (c) 2026 NVIDIA CORPORATION & AFFILIATES. All rights reserved.

"""Merging the loaded pieces of a ShardedTensorFactory without a copy.

A factory saves one tensor as several pieces (SwiGLU's ``linear_fc1``: its two halves) and merges
the loaded pieces with a concatenation. The pieces are read into views of the tensor the caller
passed in (a parameter, an optimizer state), so when that read happened in place their
concatenation is already in memory: a view of it gives the same values as ``torch.cat`` without
allocating a second copy of the tensor, which the caller would only copy back into itself.
"""

from typing import Optional, Sequence

import torch


def concatenated_view(pieces: Sequence[torch.Tensor]) -> Optional[torch.Tensor]:
    """Return ``torch.cat(pieces)`` as a view, when the pieces lie back to back in one storage.

    Every piece must be a plain, non-empty, contiguous tensor with the first piece's dtype, device
    and trailing shape, starting in the same storage where the previous piece ends. The view
    aliases the pieces: it is the tensor the checkpoint was read into.

    Args:
        pieces (Sequence[torch.Tensor]): the loaded pieces, in concatenation order (dim 0).

    Returns:
        Optional[torch.Tensor]: a view (that does not require grad) equal to the concatenation,
        or None where the pieces are not adjacent, and a concatenation must copy them.
    """
    if not pieces or not all(type(piece) in (torch.Tensor, torch.nn.Parameter) for piece in pieces):
        return None
    first = pieces[0]
    if first.dim() == 0 or first.layout != torch.strided:
        return None
    storage = first.untyped_storage().data_ptr()
    offset = first.storage_offset()
    for piece in pieces:
        if (
            piece.numel() == 0
            or piece.dtype != first.dtype
            or piece.device != first.device
            or piece.shape[1:] != first.shape[1:]
            or piece.is_conj()
            or piece.is_neg()
            or not piece.is_contiguous()
            or piece.untyped_storage().data_ptr() != storage
            or piece.storage_offset() != offset
        ):
            return None
        offset += piece.numel()
    shape = (sum(piece.shape[0] for piece in pieces), *first.shape[1:])
    strides = torch.empty(shape, device="meta").stride()
    return first.detach().as_strided(shape, strides, first.storage_offset())
