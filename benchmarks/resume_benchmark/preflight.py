"""Cheap checks that decide, before any download or heavy work, whether the benchmark can run."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

#: Exit status when this machine cannot run the benchmark (no CUDA GPU or no Transformer Engine).
EXIT_CANNOT_RUN: Final = 2

_WHY = (
    "This benchmark measures a GPU memory peak (torch.cuda.max_memory_allocated) while "
    "Transformer Engine's FusedAdam state is restored on a CUDA GPU, so it cannot run here."
)


def cannot_run_message(missing: str) -> str:
    """The single message printed before exiting with :data:`EXIT_CANNOT_RUN`."""
    return f"resume_benchmark: {missing}. {_WHY}"


def check_cuda() -> str | None:
    """``None`` when torch imports and sees a CUDA device, else what is missing."""
    try:
        import torch
    except ImportError as exc:
        return f"PyTorch is not importable ({exc})"
    if not torch.cuda.is_available():
        built = torch.version.cuda or "none (CPU-only build)"
        return f"no CUDA device is available (torch {torch.__version__}, CUDA runtime {built})"
    return None


def check_gpu_count(needed: int) -> str | None:
    """``None`` when this node has at least ``needed`` CUDA devices, else what is missing."""
    import torch

    count = torch.cuda.device_count()
    if count < needed:
        return f"{needed} CUDA devices are needed for the requested ranks, {count} are visible"
    return None


def check_transformer_engine(probe: Mapping[str, Any]) -> str | None:
    """``None`` when the build side's worker could import Transformer Engine, else why not."""
    te = probe.get("transformer_engine") or {}
    if te.get("error"):
        return f"Transformer Engine is not importable for the build side ({te['error']})"
    if not probe.get("cuda_available", False):
        return "no CUDA device is available to the worker process"
    return None
