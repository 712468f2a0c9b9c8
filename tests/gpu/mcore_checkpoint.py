"""The GPU tests' Megatron-Core checkpointing: save, load and state fingerprints.

Moved from the resume benchmark (``benchmarks/resume_benchmark``: ``checkpoint.py``,
``fingerprint.py``), which now runs Megatron-LM's ``pretrain_gpt.py`` instead;
only what the GPU tests use came along. The model and optimizer are :mod:`mcore_gpt`'s.

Fingerprints are bitwise (SHA-256 per named tensor) over model parameters and optimizer state:
each tensor is hashed over its dtype, shape and raw bytes, copied to the CPU one at a time.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections import deque
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from mcore_gpt import distributed_optimizers
from megatron.core.distributed import DistributedDataParallel
from megatron.core.utils import unwrap_model

from megatron.core import dist_checkpointing, parallel_state
from megatron.core.optimizer import MegatronOptimizer

# ``torch_dist`` save and load of model + distributed optimizer, as Megatron's training does
# (from the benchmark's checkpoint.py).


def sharded_state_dict_metadata(sharding_format: str) -> dict[str, Any]:
    """Metadata passed to ``sharded_state_dict`` (as Megatron's training loop builds it)."""
    metadata: dict[str, Any] = {
        "distrib_optim_sharding_type": sharding_format,
        "singleton_local_shards": False,
        "chained_optim_avoid_prefix": True,
        "dp_cp_group": parallel_state.get_data_parallel_group(with_context_parallel=True),
    }
    if sharding_format == "fully_reshardable":
        metadata["distrib_optim_fully_reshardable_mem_efficient"] = False
    return metadata


def serializable_metadata(metadata: dict[str, Any]) -> dict[str, Any]:
    """The metadata without process groups, as stored in the checkpoint's content metadata."""
    return {k: v for k, v in metadata.items() if k != "dp_cp_group"}


def build_sharded_state_dict(
    model_chunks: list[DistributedDataParallel],
    optimizer: MegatronOptimizer,
    sharding_format: str,
    is_loading: bool,
) -> dict[str, Any]:
    """``{"model": ..., "optimizer": ...}`` sharded state dict for one model chunk."""
    if len(model_chunks) != 1:
        raise ValueError("these helpers use exactly one model chunk")
    metadata = sharded_state_dict_metadata(sharding_format)
    # As Megatron does: the unwrapped GPTModel's keys (no DDP / Float16Module prefixes).
    model_sd = unwrap_model(model_chunks)[0].sharded_state_dict(metadata=metadata)
    optimizer_sd = optimizer.sharded_state_dict(model_sd, is_loading=is_loading, metadata=metadata)
    return {"model": model_sd, "optimizer": optimizer_sd}


def save_checkpoint(
    model_chunks: list[DistributedDataParallel],
    optimizer: MegatronOptimizer,
    sharding_format: str,
    checkpoint_dir: Path,
) -> None:
    """Save model + optimizer as a ``torch_dist`` checkpoint into the empty ``checkpoint_dir``."""
    checkpoint_dir.mkdir(parents=True, exist_ok=True)
    state_dict = build_sharded_state_dict(model_chunks, optimizer, sharding_format, False)
    dist_checkpointing.save(
        state_dict,
        str(checkpoint_dir),
        content_metadata=serializable_metadata(sharded_state_dict_metadata(sharding_format)),
    )


def load_checkpoint(
    model_chunks: list[DistributedDataParallel],
    optimizer: MegatronOptimizer,
    sharding_format: str,
    checkpoint_dir: Path,
) -> None:
    """Load model + optimizer from ``checkpoint_dir`` the way Megatron's training loop does.

    The whole load happens here, so it can be measured as one. Nothing loaded stays referenced.
    """
    sharded = build_sharded_state_dict(model_chunks, optimizer, sharding_format, True)
    state_dict = dist_checkpointing.load(sharded, str(checkpoint_dir))
    del sharded
    model_chunks[0].load_state_dict(state_dict["model"], strict=True)
    optimizer.load_state_dict(state_dict["optimizer"])


# Bitwise fingerprints of this rank's model parameters and optimizer state (from the
# benchmark's fingerprint.py).

#: SHA-256 digest per tensor or record name.
Digests = dict[str, str]


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
