"""Process setup: determinism, ``torch.distributed`` (NCCL), Megatron parallel state."""

from __future__ import annotations

import gc
import os
import random
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Final

#: Environment every benchmark process needs before CUDA (cuBLAS) and TE are initialised.
DETERMINISM_ENV: Final[dict[str, str]] = {
    "CUBLAS_WORKSPACE_CONFIG": ":4096:8",
    "NVTE_ALLOW_NONDETERMINISTIC_ALGO": "0",
}


#: Variables ``torch.distributed.run`` sets; the driver removes them from every worker's
#: environment, so a plain worker is a one-rank world even when the driver runs under a launcher.
LAUNCHER_ENV_VARS: Final[tuple[str, ...]] = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_NAME",
    "ROLE_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS",
)


def apply_determinism_env() -> None:
    """Set :data:`DETERMINISM_ENV` in this process (call before importing torch's CUDA state)."""
    for key, value in DETERMINISM_ENV.items():
        os.environ[key] = value


def _free_tcp_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def seed_everything(seed: int) -> None:
    """Seed Python, torch (CPU and CUDA) and Megatron's tensor-parallel CUDA RNG tracker."""
    import torch

    from megatron.core import tensor_parallel

    random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def launched_rank() -> tuple[int, int, int]:
    """``(RANK, WORLD_SIZE, LOCAL_RANK)`` under ``torch.distributed.run``, else ``(0, 1, 0)``."""
    if "RANK" not in os.environ:
        return 0, 1, 0
    try:
        return (
            int(os.environ["RANK"]),
            int(os.environ["WORLD_SIZE"]),
            int(os.environ["LOCAL_RANK"]),
        )
    except KeyError as exc:
        raise RuntimeError(
            f"RANK is set but {exc.args[0]} is not: launch several ranks with "
            "python -m torch.distributed.run"
        ) from None


def initialize_rank(
    seed: int, tensor_model_parallel_size: int = 1, expert_model_parallel_size: int = 1
) -> None:
    """Initialise this rank (idempotent; needs CUDA): determinism, GPU, NCCL, parallel state."""
    apply_determinism_env()
    import torch
    import torch.distributed as dist

    from megatron.core import parallel_state

    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    torch.use_deterministic_algorithms(True, warn_only=True)
    rank, world_size, local_rank = launched_rank()
    torch.cuda.set_device(local_rank)
    if not dist.is_initialized():
        launched = "RANK" in os.environ
        dist.init_process_group(
            backend="nccl",
            init_method="env://" if launched else f"tcp://127.0.0.1:{_free_tcp_port()}",
            world_size=world_size,
            rank=rank,
        )
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=tensor_model_parallel_size,
            expert_model_parallel_size=expert_model_parallel_size,
        )
    seed_everything(seed)


def shutdown() -> None:
    """Tear down Megatron's parallel state and the process group, if they exist."""
    import torch.distributed as dist

    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def rank_coordinates() -> dict[str, int]:
    """This rank's global rank, world size and Megatron parallel ranks (after initialisation)."""
    import torch.distributed as dist

    from megatron.core import parallel_state as ps

    return {
        "rank": dist.get_rank(),
        "world_size": dist.get_world_size(),
        "tp_rank": ps.get_tensor_model_parallel_rank(),
        "pp_rank": ps.get_pipeline_model_parallel_rank(),
        "dp_rank": ps.get_data_parallel_rank(),
        "ep_rank": ps.get_expert_model_parallel_rank(),
        "expert_tp_rank": ps.get_expert_tensor_parallel_rank(),
        "expert_dp_rank": ps.get_expert_data_parallel_rank(),
    }


@dataclass
class Peak:
    """What :func:`measured_peak` read: allocated bytes before, the peak, the time taken."""

    baseline_bytes: int
    peak_bytes: int = 0
    seconds: float = 0.0


@contextmanager
def measured_peak() -> Iterator[Peak]:
    """Measure the CUDA allocator's baseline, peak and seconds over the ``with`` block."""
    import torch

    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    peak = Peak(torch.cuda.memory_allocated())
    started = time.perf_counter()
    yield peak
    torch.cuda.synchronize()
    peak.peak_bytes = torch.cuda.max_memory_allocated()
    peak.seconds = time.perf_counter() - started
