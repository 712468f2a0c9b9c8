"""Train, save and resume a small real Megatron-Core GPT on the GPU (helpers for the GPU tests).

The model, optimizer and training step are :mod:`mcore_gpt`'s, the checkpoint save/load and
the state fingerprint :mod:`mcore_checkpoint`'s (both moved from the resume benchmark, which now
runs Megatron-LM's ``pretrain_gpt.py``).
"""

import gc
import logging
from pathlib import Path
from typing import Any, Dict, List, Tuple

import pytest
import torch

ADOPTION_LOGGER = "megatron.core.optimizer.state_adoption"


def digests(model_chunks: Any, optimizer: Any) -> Dict[str, str]:
    """SHA-256 of every model parameter, optimizer state tensor and param-group setting."""
    from mcore_checkpoint import fingerprint_state

    return fingerprint_state(model_chunks, optimizer)


def free_cuda() -> None:
    """Drop unreferenced CUDA memory so the next measurement starts clean."""
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def adoption_messages(caplog: pytest.LogCaptureFixture, text: str) -> List[str]:
    """The state-adoption log messages containing ``text``."""
    return [
        r.getMessage()
        for r in caplog.records
        if r.name.startswith(ADOPTION_LOGGER) and text in r.getMessage()
    ]


def step_with_peak(model_chunks: Any, optimizer: Any, case: Any, start: int) -> Tuple[Any, int]:
    """Take step N+1; return its result and its peak over ``start``.

    ``start`` is the memory allocated before the model was built. The control and the resumed
    run share this process, so absolute peaks would include what earlier tests and the control
    left allocated (seen with MoE), and a peak over the memory allocated right before the step
    would miss what the control allocated lazily during its first steps; absolute training
    peaks of fresh processes are compared by the resume benchmark (docs/gpu-report.md).
    """
    from mcore_gpt import train_step

    free_cuda()
    torch.cuda.reset_peak_memory_stats()
    result = train_step(model_chunks, optimizer, case, case.train_steps + 1)
    return result, torch.cuda.max_memory_allocated() - start


def allocated_now() -> int:
    """Memory allocated right now, after dropping what is unreferenced."""
    free_cuda()
    return torch.cuda.memory_allocated()


def train_save_control(case: Any, checkpoint_dir: Path, layout: Any = None) -> Dict[str, Any]:
    """Train ``case.train_steps`` steps, save, take the next step; return the control's record.

    ``layout`` (a ``ParallelLayout``; None: one rank) for a run on several ranks, where every
    rank calls this with the same ``checkpoint_dir``.
    """
    from mcore_checkpoint import save_checkpoint
    from mcore_gpt import build_gpt_and_optimizer, train_step

    start = allocated_now()
    model_chunks, optimizer = build_gpt_and_optimizer(case, layout)
    for step in range(1, case.train_steps + 1):
        train_step(model_chunks, optimizer, case, step)
    save_checkpoint(model_chunks, optimizer, case.sharding_format, checkpoint_dir)
    saved = digests(model_chunks, optimizer)
    result, peak = step_with_peak(model_chunks, optimizer, case, start)
    control = {"saved": saved, "loss": result.loss, "step_peak": peak}
    control["after_step"] = digests(model_chunks, optimizer)
    del model_chunks, optimizer
    free_cuda()
    return control


def load_with_peak(
    model_chunks: Any, optimizer: Any, case: Any, checkpoint_dir: Path, caplog: pytest.LogCaptureFixture
) -> int:
    """Load the checkpoint (adoption log captured); return the load peak over the baseline."""
    from mcore_checkpoint import load_checkpoint

    free_cuda()
    torch.cuda.reset_peak_memory_stats()
    baseline = torch.cuda.memory_allocated()
    with caplog.at_level(logging.INFO, logger=ADOPTION_LOGGER):
        load_checkpoint(model_chunks, optimizer, case.sharding_format, checkpoint_dir)
    return torch.cuda.max_memory_allocated() - baseline
