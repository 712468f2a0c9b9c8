"""Bitwise fingerprints (SHA-256 per named tensor) of model parameters and optimizer state.

Each tensor is hashed over its dtype, shape and raw bytes, copied to the CPU one at a time.
:func:`fingerprint_state` covers this rank's shards; :func:`gathered_fingerprint` names model
parameters by model-parallel coordinates and hashes the gathered optimizer state, so it is
comparable across data-parallel sizes.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections import deque
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
from megatron.core.distributed import DistributedDataParallel

from benchmarks.resume_benchmark.model import distributed_optimizers
from benchmarks.resume_benchmark.results import Digests
from megatron.core.optimizer import MegatronOptimizer
from megatron.core import parallel_state as ps


def _tensor_bytes_on_cpu(tensor: torch.Tensor) -> tuple[str, torch.Tensor]:
    """A header (dtype, shape) and the tensor's raw bytes as a CPU ``uint8`` tensor."""
    data = tensor.detach()
    header = f"{data.dtype}|{tuple(data.shape)}"
    if not data.is_contiguous():
        data = data.contiguous()
    flat = data.reshape(-1)
    raw = flat.view(torch.uint8) if flat.numel() > 0 else flat.to(torch.uint8)
    return header, raw.cpu()


def _sha256(header: str, raw: torch.Tensor) -> str:
    digest = hashlib.sha256(header.encode())
    digest.update(memoryview(raw.numpy()))  # hashlib releases the GIL for large buffers
    return digest.hexdigest()


def _canonical(value: Any) -> Any:
    """A JSON-stable, bit-exact form of a param-group value (floats as hex)."""
    if isinstance(value, bool) or value is None or isinstance(value, (int, str)):
        return value
    if isinstance(value, float):
        return value.hex()
    if isinstance(value, torch.Tensor):
        header, raw = _tensor_bytes_on_cpu(value)
        return _sha256(header, raw)
    if isinstance(value, (list, tuple)):
        return [_canonical(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _canonical(v) for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))}
    return repr(value)


def model_tensors(
    model_chunks: list[DistributedDataParallel],
) -> Iterator[tuple[str, torch.Tensor]]:
    """Model parameters (BF16) by chunk and name."""
    for chunk_index, chunk in enumerate(model_chunks):
        for name, param in chunk.named_parameters():
            yield f"model{chunk_index}.{name}", param


def optimizer_tensors(optimizer: MegatronOptimizer) -> Iterator[tuple[str, torch.Tensor]]:
    """Inner-optimizer parameters and every state tensor, in a fixed order."""
    for opt_index, dist_opt in enumerate(distributed_optimizers(optimizer)):
        inner = dist_opt.optimizer
        for group_index, group in enumerate(inner.param_groups):
            for param_index, param in enumerate(group["params"]):
                prefix = f"opt{opt_index}.group{group_index}.param{param_index}"
                yield f"{prefix}.param", param
                state = inner.state.get(param, {})
                for key in sorted(state):
                    value = state[key]
                    if isinstance(value, torch.Tensor):
                        yield f"{prefix}.{key}", value


def optimizer_group_records(optimizer: MegatronOptimizer) -> Iterator[tuple[str, str]]:
    """Each inner param group's hyper-parameters (everything but ``params``) as canonical JSON."""
    for opt_index, dist_opt in enumerate(distributed_optimizers(optimizer)):
        for group_index, group in enumerate(dist_opt.optimizer.param_groups):
            record = {k: _canonical(v) for k, v in group.items() if k != "params"}
            yield f"opt{opt_index}.group{group_index}.hparams", json.dumps(record, sort_keys=True)


def fingerprint_tensors(
    tensors: Iterable[tuple[str, torch.Tensor]], max_workers: int | None = None
) -> Digests:
    """SHA-256 digest per named tensor; hashing runs in a thread pool, copies one at a time."""
    workers = max_workers or max(1, min(16, os.cpu_count() or 1))
    digests: Digests = {}
    seen: set[str] = set()
    pending: deque[tuple[str, Future[str]]] = deque()
    with ThreadPoolExecutor(max_workers=workers) as pool:
        for name, tensor in tensors:
            if name in seen:
                raise ValueError(f"duplicate fingerprint name {name}")
            seen.add(name)
            header, raw = _tensor_bytes_on_cpu(tensor)
            pending.append((name, pool.submit(_sha256, header, raw)))
            while len(pending) > 2 * workers:
                done_name, future = pending.popleft()
                digests[done_name] = future.result()
        while pending:
            done_name, future = pending.popleft()
            digests[done_name] = future.result()
    return digests


def fingerprint_state(
    model_chunks: list[DistributedDataParallel], optimizer: MegatronOptimizer
) -> Digests:
    """Digests of model parameters, optimizer parameters and state, and group hyper-parameters."""
    torch.cuda.synchronize()
    digests = fingerprint_tensors([*model_tensors(model_chunks), *optimizer_tensors(optimizer)])
    for name, record in optimizer_group_records(optimizer):
        digests[name] = hashlib.sha256(record.encode()).hexdigest()
    return digests


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
    """Digests of each DistributedOptimizer's gathered state and groups (collective; DP rank 0)."""
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
