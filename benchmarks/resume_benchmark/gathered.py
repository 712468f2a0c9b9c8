"""Fingerprint of the *unsharded* state, comparable across data-parallel sizes.

Used only when a checkpoint saved at one DP size is resumed at another (``--resume-nproc-per-node``
differing from ``--nproc-per-node``): then the per-rank shards of the control and of the resumed
run cover different ranges and cannot be compared rank by rank.

What is hashed (every rank calls :func:`gathered_fingerprint`; the calls are collective):

* every model parameter this rank holds, named by its *model-parallel* coordinates, not by the
  global rank: ``model.tp<t>.pp<p>.<name>`` for dense parameters (replicated over DP and EP) and
  ``model.etp<t>.ep<e>.pp<p>.<name>`` for expert parameters -- ranks that hold the same shard
  produce the same name, and :func:`merge_rank_digests` (pure, in :mod:`.results`) checks they
  agree;
* for every DistributedOptimizer (chain order ``i``) the output of Megatron-Core's own
  ``DistributedOptimizer.get_parameter_state_dp_zero()``: per grad buffer, the FP32 ``param``
  (main parameters) and each optimizer state (``exp_avg``, ``exp_avg_sq``) gathered over the
  optimizer's data-parallel group into one *unpadded* world tensor (the DP-dependent bucket-end
  padding removed, gaps between parameters zero), hashed on DP rank 0 of that group as
  ``opt<i>.mp<k>.gbuf<g>.<dtype>.<key>``, where ``k`` is the optimizer's
  ``data_parallel_group_idx`` (its tensor/expert-model-parallel rank: the identity MCore keys
  its checkpoint objects with, independent of the DP size);
* each inner param group's hyper-parameters (including TE's ``step``) as
  ``opt<i>.mp<k>.group<j>.hparams`` on the same rank.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from typing import Any

import torch
from megatron.core.distributed import DistributedDataParallel

from benchmarks.resume_benchmark.fingerprint import (
    Digests,
    fingerprint_tensors,
    optimizer_group_records,
)
from benchmarks.resume_benchmark.model import distributed_optimizers
from megatron.core import parallel_state as ps
from megatron.core.optimizer import MegatronOptimizer


def _is_expert(param: torch.nn.Parameter) -> bool:
    return not getattr(param, "allreduce", True)


def model_tensors_by_coordinates(
    model_chunks: list[DistributedDataParallel],
) -> Iterator[tuple[str, torch.Tensor]]:
    """Model parameters named by model-parallel coordinates (see the module docstring)."""
    pp = ps.get_pipeline_model_parallel_rank()
    dense = f"tp{ps.get_tensor_model_parallel_rank()}.pp{pp}"
    etp, ep = ps.get_expert_tensor_parallel_rank(), ps.get_expert_model_parallel_rank()
    expert = f"etp{etp}.ep{ep}.pp{pp}"
    for chunk_index, chunk in enumerate(model_chunks):
        for name, param in chunk.named_parameters():
            where = expert if _is_expert(param) else dense
            yield f"model.{where}.chunk{chunk_index}.{name}", param


def _world_tensors(state: dict[Any, Any], prefix: str) -> Iterator[tuple[str, torch.Tensor]]:
    """The world tensors of one ``get_parameter_state_dp_zero()`` result, named."""
    for gbuf_index, per_dtype in state.items():
        if not isinstance(gbuf_index, int):
            continue  # "buckets_coalesced"
        for dtype, world in per_dtype.items():
            for key in sorted(world):
                value = world[key]
                if isinstance(value, torch.Tensor):
                    yield f"{prefix}.gbuf{gbuf_index}.{dtype}.{key}", value


def optimizer_world_digests(optimizer: MegatronOptimizer) -> Digests:
    """Digests of every DistributedOptimizer's gathered world tensors and param groups.

    Collective over each optimizer's data-parallel group; non-empty only on its DP rank 0.
    """
    digests: Digests = {}
    hparams = dict(optimizer_group_records(optimizer))
    for index, dist_opt in enumerate(distributed_optimizers(optimizer)):
        use_gloo = dist_opt.data_parallel_group_gloo is not None
        state = dist_opt.get_parameter_state_dp_zero(use_gloo_comm=use_gloo)
        if dist_opt.data_parallel_group.rank() != 0 or state is None:
            continue
        prefix = f"opt{index}.mp{dist_opt.data_parallel_group_idx}"
        digests.update(fingerprint_tensors(_world_tensors(state, prefix)))
        del state
        for name, record in hparams.items():
            if name.startswith(f"opt{index}."):
                group = name.split(".", 1)[1]
                digests[f"{prefix}.{group}"] = hashlib.sha256(record.encode()).hexdigest()
    return digests


def gathered_fingerprint(
    model_chunks: list[DistributedDataParallel], optimizer: MegatronOptimizer
) -> Digests:
    """This rank's part of the DP-size-independent fingerprint (collective; see module docs)."""
    torch.cuda.synchronize()
    digests = fingerprint_tensors(model_tensors_by_coordinates(model_chunks))
    digests.update(optimizer_world_digests(optimizer))
    return digests
