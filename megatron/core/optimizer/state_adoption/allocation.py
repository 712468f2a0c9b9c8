# Copyright (c) 2026 NVIDIA CORPORATION & AFFILIATES. All rights reserved.

"""Zeroed state tensors in as few allocations as PyTorch's CUDA caching allocator holds exactly.

Created one by one, as the inner optimizers create their state, each tensor of 10 MiB or more
gets a segment of its own rounded up to 2 MiB, and keeps all of it where 1 MiB or less is left
over: bytes a resumed run holds and a run that never stopped does not (its state is carved out
of cached blocks at the first step).
"""

from typing import Dict, List

import torch

# PyTorch's CUDA caching allocator (c10/cuda/CUDACachingAllocator.cpp): the block alignment
# (kMinBlockSize), the size from which an allocation gets a segment of its own (kMinLargeAlloc),
# the step those segments are rounded up in (kRoundLarge), and the remainder above which a block
# is split (kSmallSize).
_ALIGNMENT, _LARGE_ALLOCATION = 512, 10 << 20
_SEGMENT_ROUNDING, _LEAST_SPLIT = 2 << 20, 1 << 20


def packed_zeros(likes: List[torch.Tensor], dtype: torch.dtype) -> List[torch.Tensor]:
    """Creates zeroed ``dtype`` tensors as views of one allocation per device (two where
    :func:`_tail_length` says so), each on an ``_ALIGNMENT``-byte boundary.

    Args:
        likes (List[torch.Tensor]): for each tensor, one whose shape and device it takes.
        dtype (torch.dtype): the tensors' dtype.

    Returns:
        List[torch.Tensor]: the tensors, in the order of ``likes``.
    """
    step = _ALIGNMENT // dtype.itemsize
    sizes = [-(-like.numel() // step) * step for like in likes]  # elements, aligned
    by_device: Dict[torch.device, List[int]] = {}
    for index, like in enumerate(likes):
        by_device.setdefault(like.device, []).append(index)
    views: Dict[int, torch.Tensor] = {}
    for device, indices in by_device.items():
        indices.sort(key=sizes.__getitem__)
        tail = _tail_length([sizes[index] * dtype.itemsize for index in indices])
        for allocation in filter(None, (indices[:tail], indices[tail:])):
            buffer = torch.zeros(sum(sizes[i] for i in allocation), dtype=dtype, device=device)
            start = 0
            for index in allocation:
                like = likes[index]
                views[index] = buffer[start : start + like.numel()].view(like.shape)
                start += sizes[index]
    return [views[index] for index in range(len(likes))]


def _tail_length(sizes: List[int]) -> int:
    """How many of ``sizes`` (ascending, in bytes) to allocate apart from the rest.

    An allocation of ``_LARGE_ALLOCATION`` or more gets a segment of its own, rounded up to
    ``_SEGMENT_ROUNDING``, and keeps all of it where ``_LEAST_SPLIT`` or less is left over. There
    the fewest smallest sizes after which neither allocation keeps a remainder are split off;
    none where one allocation keeps none, or where a large size would overshoot.
    """
    total = sum(sizes)
    kept = -total % _SEGMENT_ROUNDING
    if total < _LARGE_ALLOCATION or not 0 < kept <= _LEAST_SPLIT:
        return 0
    tail = 0
    for length, size in enumerate(sizes, start=1):
        tail += size
        if tail + kept > _LEAST_SPLIT:  # the rest is left more than _LEAST_SPLIT, or nothing
            return length if tail + kept <= _SEGMENT_ROUNDING else 0
    return 0
