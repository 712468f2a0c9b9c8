"""The factory merge of pieces read in place (megatron/core/dist_checkpointing/in_place_merge.py).

SwiGLU's ``linear_fc1`` is saved through a ShardedTensorFactory as two halves; on load MCore reads
the halves into views of the parameter and merges them with ``cat_with_oom_fallback``. Upstream,
the merge allocates a second copy of the parameter (``torch.cat``), held until the load returns;
with the build, the merge is a view of the parameter. These tests save and load real
``torch_dist`` checkpoints with Megatron-Core's own ``dist_checkpointing`` and SwiGLU factory on a
one-rank gloo group (the CPU stands in for the GPU: MCore's saver synchronises CUDA and asks for
the current CUDA device, both made CPU no-ops here), and would fail against upstream.
"""

import os
from dataclasses import replace
import socket
from pathlib import Path
from typing import Any, Dict, Iterator, List

import pytest
import torch
import torch.distributed as dist

from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.in_place_merge import concatenated_view
from megatron.core.dist_checkpointing.mapping import ShardedTensor
from megatron.core.transformer.mlp import apply_swiglu_sharded_factory
from megatron.core.transformer.utils import cat_with_oom_fallback


@pytest.fixture(scope="module")
def gloo_rank() -> Iterator[None]:
    """A one-rank gloo process group (MCore's dist_checkpointing needs one)."""
    created = not dist.is_initialized()
    if created:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=0, world_size=1)
    yield
    if created:
        dist.destroy_process_group()


@pytest.fixture
def cpu_saver(monkeypatch: pytest.MonkeyPatch) -> None:
    """MCore's torch_dist saver synchronises CUDA and asks for the current device: on the CPU."""
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *args, **kwargs: None)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")


def _swiglu_state_dict(weight: torch.Tensor, bias: torch.Tensor) -> Dict[str, Any]:
    """linear_fc1's weight and bias as MLP.sharded_state_dict gives them (one rank, no TP)."""
    return {
        name: apply_swiglu_sharded_factory(
            ShardedTensor.from_rank_offsets(f"mlp.linear_fc1.{name}", tensor, replica_id=0), ()
        )
        for name, tensor in (("weight", weight), ("bias", bias))
    }


@pytest.mark.usefixtures("gloo_rank", "cpu_saver")
def test_swiglu_fc1_loads_into_the_parameter_without_a_copy(tmp_path: Path) -> None:
    torch.manual_seed(0)
    saved = {"weight": torch.randn(16, 8), "bias": torch.randn(16)}
    dist_checkpointing.save(_swiglu_state_dict(saved["weight"], saved["bias"]), str(tmp_path))

    model = torch.nn.Linear(8, 16)
    params = {"weight": model.weight, "bias": model.bias}
    loaded = dist_checkpointing.load(_swiglu_state_dict(model.weight, model.bias), str(tmp_path))

    for name, param in params.items():
        # upstream: a new tensor from torch.cat; the build: the parameter itself, as a view
        assert loaded[name].data_ptr() == param.data_ptr(), name
        assert (loaded[name].shape, loaded[name].stride()) == (param.shape, param.stride())
        assert not loaded[name].requires_grad
        assert torch.equal(loaded[name], saved[name]) and torch.equal(param, saved[name])
    # the caller's copy back into the module is a copy of the parameter onto itself
    model.load_state_dict(loaded)
    assert torch.equal(model.weight, saved["weight"]) and torch.equal(model.bias, saved["bias"])


@pytest.mark.usefixtures("gloo_rank", "cpu_saver")
def test_mamba_in_proj_split_in_five_loads_into_the_parameter(tmp_path: Path) -> None:
    """Mamba's in_proj is saved through the same merge, as five sections [z|x|B|C|dt]."""
    from megatron.core.ssm.utils import _split_tensor_factory

    def state_dict(weight: torch.Tensor) -> Dict[str, Any]:
        sharded = ShardedTensor.from_rank_offsets("mixer.in_proj.weight", weight, replica_id=0)
        return {"in_proj": _split_tensor_factory(sharded, [4, 4, 2, 2, 3], list("zxBCd"), 0)}

    torch.manual_seed(2)
    saved = torch.randn(15, 6)
    dist_checkpointing.save(state_dict(saved), str(tmp_path))
    weight = torch.nn.Parameter(torch.zeros(15, 6))
    loaded = dist_checkpointing.load(state_dict(weight), str(tmp_path))
    assert loaded["in_proj"].data_ptr() == weight.data_ptr()
    assert torch.equal(loaded["in_proj"], saved) and torch.equal(weight, saved)


@pytest.mark.usefixtures("gloo_rank", "cpu_saver")
def test_optimizer_state_read_through_the_factory_is_the_state_tensor(tmp_path: Path) -> None:
    """Non-distributed optimizers save their state through the parameter's factory with the
    data replaced (make_sharded_optimizer_tensor): the state loads into its own tensor."""
    torch.manual_seed(1)
    saved = torch.randn(12, 4)
    factory = _swiglu_state_dict(torch.zeros(12, 4), torch.zeros(12))["weight"]

    def optimizer_state_dict(exp_avg: torch.Tensor) -> Dict[str, Any]:
        return {"exp_avg": replace(factory, key="state.exp_avg", data=exp_avg)}

    dist_checkpointing.save(optimizer_state_dict(saved), str(tmp_path))
    exp_avg = torch.empty(12, 4)
    loaded = dist_checkpointing.load(optimizer_state_dict(exp_avg), str(tmp_path))
    assert loaded["exp_avg"].data_ptr() == exp_avg.data_ptr()
    assert torch.equal(loaded["exp_avg"], saved) and torch.equal(exp_avg, saved)


def test_the_merge_copies_pieces_that_are_not_back_to_back() -> None:
    base = torch.arange(24.0).reshape(6, 4)
    separate = [torch.ones(2, 4), torch.zeros(2, 4)]
    for pieces in ([base[3:], base[:3]], [base[:2], base[3:]], separate):
        merged = cat_with_oom_fallback(pieces)
        assert torch.equal(merged, torch.cat(pieces))
        assert all(merged.data_ptr() != piece.data_ptr() for piece in pieces)


# concatenated_view on its own: a view exactly where the pieces lie back to back in one storage


def _view_cases() -> Dict[str, List[torch.Tensor]]:
    base = torch.arange(60.0).reshape(12, 5)
    return {
        "two halves (SwiGLU)": list(torch.chunk(base, 2)),
        "five parts (Mamba in_proj)": list(torch.split(base, [2, 3, 1, 4, 2])),
        "one piece": [base],
        "rows of a 1-D tensor": list(torch.chunk(torch.arange(10.0), 2)),
        "not from the start": [base[2:5], base[5:9]],
        "a parameter's halves": list(torch.chunk(torch.nn.Parameter(base.clone()), 2)),
    }


@pytest.mark.parametrize("name", list(_view_cases()))
def test_back_to_back_pieces_merge_into_a_view(name: str) -> None:
    pieces = _view_cases()[name]
    merged = concatenated_view(pieces)
    assert merged is not None
    assert torch.equal(merged, torch.cat(pieces))
    assert merged.data_ptr() == pieces[0].data_ptr() and merged.is_contiguous()
    assert type(merged) is torch.Tensor and not merged.requires_grad


class _Subclass(torch.Tensor):
    pass


def _no_view_cases() -> Dict[str, List[torch.Tensor]]:
    base = torch.arange(60.0).reshape(12, 5)
    halves = list(torch.chunk(base, 2))
    return {
        "no pieces": [],
        "reversed": halves[::-1],
        "a gap": [base[:3], base[4:]],
        "an overlap": [base[:4], base[3:]],
        "other storages": [base[:6].clone(), base[6:].clone()],
        "not contiguous (column halves)": list(torch.chunk(base, 2, dim=1)),
        "another dtype": [halves[0], halves[1].to(torch.float64)],
        "another trailing shape": [base[:6], base[6:].reshape(5, 6)],
        "an empty piece": [base[:0], base],
        "0-dim": [base[0, 0]],
        "a subclass": [base.as_subclass(_Subclass)],
        "a conjugate view": [torch.ones(4, dtype=torch.complex64).conj()],
    }


@pytest.mark.parametrize("name", list(_no_view_cases()))
def test_other_pieces_are_left_to_the_copy(name: str) -> None:
    assert concatenated_view(_no_view_cases()[name]) is None
