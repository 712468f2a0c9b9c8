# Copyright (c) 2026 NVIDIA CORPORATION & AFFILIATES. All rights reserved.

"""Tests for merging the loaded pieces of a ShardedTensorFactory without a copy.

SwiGLU's ``linear_fc1`` (and Mamba's ``in_proj``) are saved through a ShardedTensorFactory whose
pieces torch_dist reads in place into views of the tensor being loaded. ``cat_with_oom_fallback``
returns a view of that tensor when the pieces lie back to back in one storage
(``concatenated_view``) and a concatenation otherwise. On CPU tensors: no process group needed.
"""

from typing import Dict, List

import pytest
import torch

from megatron.core.dist_checkpointing import ShardedTensor
from megatron.core.dist_checkpointing.in_place_merge import concatenated_view
from megatron.core.dist_checkpointing.mapping import apply_factories, apply_factory_merges
from megatron.core.transformer.mlp import apply_swiglu_sharded_factory
from megatron.core.transformer.utils import cat_with_oom_fallback


def _back_to_back() -> Dict[str, List[torch.Tensor]]:
    base = torch.arange(60.0).reshape(12, 5)
    return {
        "two halves (SwiGLU)": list(torch.chunk(base, 2)),
        "five parts (Mamba in_proj)": list(torch.split(base, [2, 3, 1, 4, 2])),
        "one piece": [base],
        "halves of a 1-D tensor": list(torch.chunk(torch.arange(10.0), 2)),
        "not from the start": [base[2:5], base[5:9]],
        "halves of a parameter": list(torch.chunk(torch.nn.Parameter(base.clone()), 2)),
    }


def _copied() -> Dict[str, List[torch.Tensor]]:
    """Pieces that torch.cat concatenates but that are not back to back in one storage."""
    base = torch.arange(60.0).reshape(12, 5)
    halves = list(torch.chunk(base, 2))
    return {
        "reversed": halves[::-1],
        "a gap": [base[:3], base[4:]],
        "an overlap": [base[:4], base[3:]],
        "other storages": [base[:6].clone(), base[6:].clone()],
        "not contiguous (column halves)": list(torch.chunk(base.t(), 2)),
        "another dtype": [halves[0], halves[1].to(torch.float64)],
    }


class _Subclass(torch.Tensor):
    pass


def _not_a_view() -> Dict[str, List[torch.Tensor]]:
    """Pieces concatenated_view leaves to the copy, that torch.cat may refuse too."""
    base = torch.arange(60.0).reshape(12, 5)
    return {
        **_copied(),
        "no pieces": [],
        "another trailing shape": [base[:6], base[6:].reshape(5, 6)],
        "an empty piece": [base[:0], base],
        "0-dim": [base[0, 0]],
        "a subclass": [base.as_subclass(_Subclass)],
        "a conjugate view": [torch.ones(4, dtype=torch.complex64).conj()],
    }


class TestConcatenatedView:
    @pytest.mark.parametrize("name", list(_back_to_back()))
    def test_back_to_back_pieces_merge_into_a_view(self, name):
        pieces = _back_to_back()[name]
        merged = concatenated_view(pieces)
        assert merged is not None
        assert torch.equal(merged, torch.cat(pieces))
        assert merged.data_ptr() == pieces[0].data_ptr()
        assert merged.is_contiguous()
        assert type(merged) is torch.Tensor and not merged.requires_grad

    @pytest.mark.parametrize("name", list(_not_a_view()))
    def test_other_pieces_are_not_merged_into_a_view(self, name):
        assert concatenated_view(_not_a_view()[name]) is None


class TestCatWithOomFallback:
    @pytest.mark.parametrize("name", list(_back_to_back()))
    def test_back_to_back_pieces_are_not_copied(self, name):
        pieces = _back_to_back()[name]
        merged = cat_with_oom_fallback(pieces)
        assert torch.equal(merged, torch.cat(pieces))
        assert merged.data_ptr() == pieces[0].data_ptr()

    @pytest.mark.parametrize("name", list(_copied()))
    def test_other_pieces_are_concatenated(self, name):
        pieces = _copied()[name]
        merged = cat_with_oom_fallback(pieces)
        assert torch.equal(merged, torch.cat(pieces))
        storages = {piece.untyped_storage().data_ptr() for piece in pieces}
        assert merged.untyped_storage().data_ptr() not in storages


class TestSwigluFactoryMerge:
    """The merge of apply_swiglu_sharded_factory, as dist_checkpointing.load runs it."""

    def _load(self, tensor, read_in_place):
        factory = apply_swiglu_sharded_factory(
            ShardedTensor.from_rank_offsets('linear_fc1.weight', tensor, replica_id=0), ()
        )
        sharded_state_dict = {'weight': factory}
        apply_factories(sharded_state_dict)
        halves = [sh_ten.data for sh_ten in sharded_state_dict['weight']]
        if not read_in_place:  # e.g. read into tensors of its own
            halves = [half.clone() for half in halves]
        return apply_factory_merges({'weight': halves}, {'weight': factory})['weight']

    def test_halves_read_in_place_merge_into_the_tensor(self):
        weight = torch.randn(16, 8)
        expected = weight.clone()
        merged = self._load(weight, read_in_place=True)
        assert merged.data_ptr() == weight.data_ptr()
        assert (merged.shape, merged.stride()) == (weight.shape, weight.stride())
        assert torch.equal(merged, expected)

    def test_halves_read_elsewhere_are_concatenated(self):
        weight = torch.randn(16, 8)
        merged = self._load(weight, read_in_place=False)
        assert merged.untyped_storage().data_ptr() != weight.untyped_storage().data_ptr()
        assert torch.equal(merged, weight)
