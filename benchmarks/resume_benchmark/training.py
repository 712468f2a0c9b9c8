"""Deterministic synthetic batches and one Megatron training step."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from megatron.core.distributed import DistributedDataParallel, finalize_model_grads

from benchmarks.resume_benchmark.cases import BenchmarkCase
from megatron.core import parallel_state
from megatron.core.optimizer import MegatronOptimizer

#: Mixes the case seed into the per-step batch seed; the batch depends on (seed, step) only.
_STEP_SEED_STRIDE = 1_000_003
#: Mixes the data-parallel rank in (0 on one rank: the single-rank batches are unchanged).
_DP_RANK_SEED_STRIDE = 1 << 40


@dataclass(frozen=True)
class Batch:
    """One micro-batch of token ids, next-token labels and positions, on the GPU."""

    tokens: torch.Tensor
    labels: torch.Tensor
    position_ids: torch.Tensor


@dataclass(frozen=True)
class StepResult:
    """What one training step reports."""

    step: int
    loss: float
    grad_norm: float | None
    update_successful: bool


def synthetic_batch(case: BenchmarkCase, step: int, dp_rank: int = 0) -> Batch:
    """The batch for 1-based ``step``: random tokens from a generator seeded by (seed, step).

    Each data-parallel rank ``dp_rank`` gets its own batch; tensor-parallel peers share it.
    """
    size = case.size
    seed = case.seed * _STEP_SEED_STRIDE + step + dp_rank * _DP_RANK_SEED_STRIDE
    generator = torch.Generator(device="cpu").manual_seed(seed)
    ids = torch.randint(
        0, size.vocab_size, (size.micro_batch_size, size.seq_length + 1), generator=generator
    )
    device = torch.device("cuda", torch.cuda.current_device())
    positions = torch.arange(size.seq_length, dtype=torch.long).unsqueeze(0)
    return Batch(
        tokens=ids[:, :-1].contiguous().to(device),
        labels=ids[:, 1:].contiguous().to(device),
        position_ids=positions.expand(size.micro_batch_size, -1).contiguous().to(device),
    )


def train_step(
    model_chunks: list[DistributedDataParallel],
    optimizer: MegatronOptimizer,
    case: BenchmarkCase,
    step: int,
) -> StepResult:
    """Forward, backward, gradient finalisation and optimizer step on ``synthetic_batch(step)``.

    The reported loss is the mean token loss computed before the update.
    """
    model = model_chunks[0]
    batch = synthetic_batch(case, step, parallel_state.get_data_parallel_rank())
    model.zero_grad_buffer()
    optimizer.zero_grad()
    per_token_loss = model(batch.tokens, batch.position_ids, None, labels=batch.labels)
    loss = per_token_loss.float().mean()
    loss.backward()
    finalize_model_grads(model_chunks)
    update_successful, grad_norm, _ = optimizer.step()
    torch.cuda.synchronize()
    return StepResult(
        step=step,
        loss=float(loss.detach().item()),
        grad_norm=None if grad_norm is None else float(grad_norm),
        update_successful=bool(update_successful),
    )
