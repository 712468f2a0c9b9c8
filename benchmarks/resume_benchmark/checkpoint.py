"""``torch_dist`` save and load of model + distributed optimizer, as Megatron's training does."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from megatron.core.distributed import DistributedDataParallel
from megatron.core.utils import unwrap_model

from megatron.core import dist_checkpointing, parallel_state
from megatron.core.optimizer import MegatronOptimizer

from benchmarks.resume_benchmark.memory_timeline import (
    PHASE_MODEL,
    PHASE_PAYLOAD,
    PHASE_READ,
    PHASE_SCAFFOLD,
)


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
        raise ValueError("the benchmark uses exactly one model chunk")
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
    on_phase: Callable[[str], None] | None = None,
) -> None:
    """Load model + optimizer from ``checkpoint_dir`` the way Megatron's training loop does.

    The whole load happens here, so it can be measured as one; ``on_phase(label)`` is called as
    each phase begins (labels from :mod:`.memory_timeline`). Nothing loaded stays referenced.
    """
    mark = on_phase or (lambda label: None)
    mark(PHASE_SCAFFOLD)
    sharded = build_sharded_state_dict(model_chunks, optimizer, sharding_format, True)
    mark(PHASE_READ)
    state_dict = dist_checkpointing.load(sharded, str(checkpoint_dir))
    del sharded
    mark(PHASE_MODEL)
    model_chunks[0].load_state_dict(state_dict["model"], strict=True)
    mark(PHASE_PAYLOAD)
    optimizer.load_state_dict(state_dict["optimizer"])
