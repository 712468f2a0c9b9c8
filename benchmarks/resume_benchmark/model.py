"""The benchmark's Megatron-Core GPT model, its distributed optimizer and its training step.

A ``GPTModel`` (local layer spec, BF16 ``Float16Module``) in ``DistributedDataParallel`` with the
distributed optimizer of ``get_megatron_optimizer`` (inner optimizer: TE's ``FusedAdam``).
:func:`build_gpt_and_optimizer` initialises NCCL and the parallel state on first use.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed
from megatron.core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
from megatron.core.optimizer.optimizer import ChainedOptimizer
from megatron.core.transformer.module import Float16Module
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.transformer_config import TransformerConfig

from benchmarks.resume_benchmark.cases import BenchmarkCase
from benchmarks.resume_benchmark.launch import ParallelLayout
from benchmarks.resume_benchmark.runtime import initialize_rank, seed_everything
from megatron.core import parallel_state
from megatron.core.optimizer import MegatronOptimizer, OptimizerConfig, get_megatron_optimizer

#: Optimizer hyper-parameters shared by every case (constant LR, no scheduler).
LEARNING_RATE = 1.0e-4
WEIGHT_DECAY = 0.1
ADAM_BETAS = (0.9, 0.95)
ADAM_EPS = 1.0e-8
CLIP_GRAD = 1.0


def transformer_config(case: BenchmarkCase, layout: ParallelLayout) -> TransformerConfig:
    """The GPT's ``TransformerConfig``: BF16, no dropout, deterministic, the layout's TP/EP."""
    size = case.size
    extra_kwargs: dict[str, object] = {
        "tensor_model_parallel_size": layout.tensor_model_parallel_size,
        "expert_model_parallel_size": layout.expert_model_parallel_size,
    }
    if case.moe:
        extra_kwargs |= {
            "num_moe_experts": size.num_experts,
            "moe_ffn_hidden_size": size.moe_ffn_hidden_size,
            "moe_router_topk": size.moe_router_topk,
            "moe_token_dispatcher_type": "allgather",
            "moe_grouped_gemm": False,
            "moe_aux_loss_coeff": 0.0,
            # MCore 0.19.2's local-spec SequentialMLP experts with biases fail in backward
            # (in-place bias add to a custom-Function view), so the MoE model has no biases.
            "add_bias_linear": False,
        }
    return TransformerConfig(
        num_layers=size.num_layers,
        hidden_size=size.hidden_size,
        num_attention_heads=size.num_attention_heads,
        ffn_hidden_size=size.ffn_hidden_size,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bf16=True,
        params_dtype=torch.bfloat16,
        init_method_std=0.02,
        deterministic_mode=True,
        use_cpu_initialization=False,
        perform_initialization=True,
        **extra_kwargs,  # type: ignore[arg-type,unused-ignore]
    )


def ddp_config(case: BenchmarkCase) -> DistributedDataParallelConfig:
    """Distributed-data-parallel config: distributed optimizer, no overlap, BF16 grad buffers."""
    del case  # every case uses the same DDP settings
    return DistributedDataParallelConfig(
        use_distributed_optimizer=True,
        overlap_grad_reduce=False,
        overlap_param_gather=False,
        grad_reduce_in_fp32=False,
    )


def optimizer_config(case: BenchmarkCase) -> OptimizerConfig:
    """Adam on a BF16 model with the distributed optimizer; precision-aware for that case."""
    precision_kwargs: dict[str, object] = {}
    if case.precision_aware:
        precision_kwargs = {
            "use_precision_aware_optimizer": True,
            "exp_avg_dtype": getattr(torch, case.moment_dtype),
            "exp_avg_sq_dtype": getattr(torch, case.moment_dtype),
            "main_params_dtype": torch.float32,
            "main_grads_dtype": torch.float32,
            "store_param_remainders": case.param_remainders,
        }
    return OptimizerConfig(
        optimizer="adam",
        lr=LEARNING_RATE,
        weight_decay=WEIGHT_DECAY,
        adam_beta1=ADAM_BETAS[0],
        adam_beta2=ADAM_BETAS[1],
        adam_eps=ADAM_EPS,
        clip_grad=CLIP_GRAD,
        bf16=True,
        params_dtype=torch.bfloat16,
        use_distributed_optimizer=True,
        **precision_kwargs,  # type: ignore[arg-type,unused-ignore]
    )


def tag_expert_parameters(model: torch.nn.Module) -> int:
    """Mark every MoE expert parameter as expert-parallel (``allreduce = False``); return the count.

    Megatron-Core tags experts only when they are sharded, never on one rank; with the tag, as in
    an expert-parallel run, the optimizer chains a dense and an expert DistributedOptimizer.
    Call before wrapping in DDP.
    """
    count = 0
    for module in model.modules():
        if isinstance(module, MoELayer) and module.experts is not None:
            for param in module.experts.parameters():
                param.allreduce = False  # the data tag MCore's own MoE layers set; read by DDP
                count += 1
    return count


def build_gpt_and_optimizer(
    case: BenchmarkCase,
    layout: ParallelLayout | None = None,
) -> tuple[list[DistributedDataParallel], MegatronOptimizer]:
    """Build the case's GPT model chunks (one, DDP-wrapped) and its Megatron optimizer.

    Initialises the rank with the layout (``None``: one rank) if needed and re-seeds every RNG
    with ``case.seed``, so every process builds bit-identical weights. For ``case.moe`` experts
    get their own DistributedOptimizer (:func:`tag_expert_parameters`) unless
    ``case.moe_fold_experts``.
    """
    layout = layout or ParallelLayout()
    initialize_rank(case.seed, layout.tensor_model_parallel_size, layout.expert_model_parallel_size)
    seed_everything(case.seed)
    config = transformer_config(case, layout)
    spec = get_gpt_layer_local_spec(
        num_experts=case.size.num_experts if case.moe else None, moe_grouped_gemm=False
    )
    gpt = GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=case.size.vocab_size,
        max_sequence_length=case.size.seq_length,
        pre_process=True,
        post_process=True,
        parallel_output=True,
        share_embeddings_and_output_weights=False,
        position_embedding_type="learned_absolute",
    )
    gpt.cuda(torch.cuda.current_device())
    if case.moe and not case.moe_fold_experts and tag_expert_parameters(gpt) == 0:
        raise RuntimeError("the MoE model has no expert parameters to tag")
    wrapped = Float16Module(config, gpt)
    ddp = DistributedDataParallel(config=config, ddp_config=ddp_config(case), module=wrapped)
    ddp.broadcast_params()
    model_chunks = [ddp]
    optimizer = get_megatron_optimizer(optimizer_config(case), model_chunks)
    return model_chunks, optimizer


def distributed_optimizers(optimizer: MegatronOptimizer) -> Iterator[DistributedOptimizer]:
    """Yield every ``DistributedOptimizer`` inside ``optimizer``, in chain order."""
    if isinstance(optimizer, ChainedOptimizer):
        for inner in optimizer.chained_optimizers:
            yield from distributed_optimizers(inner)
    elif isinstance(optimizer, DistributedOptimizer):
        yield optimizer
    else:
        raise TypeError(f"expected a (Chained)DistributedOptimizer, got {type(optimizer).__name__}")


def inner_optimizers(optimizer: MegatronOptimizer) -> list[torch.optim.Optimizer]:
    """The inner optimizer (TE's ``FusedAdam``) of every DistributedOptimizer, in chain order."""
    return [dist_opt.optimizer for dist_opt in distributed_optimizers(optimizer)]


def optimizer_parameter_count(optimizer: MegatronOptimizer) -> int:
    """Elements of every inner-optimizer parameter on this rank (the FP32 main-param shards)."""
    return sum(
        int(param.numel())
        for inner in inner_optimizers(optimizer)
        for group in inner.param_groups
        for param in group["params"]
    )


def model_parameter_count(model_chunks: list[DistributedDataParallel]) -> int:
    """Elements of the model parameters this rank holds (its shards and its replicas)."""
    return sum(int(p.numel()) for chunk in model_chunks for p in chunk.parameters())


def _counts_toward_total(param: torch.nn.Parameter) -> bool:
    """Whether this rank counts ``param`` in the model total (one replica of every shard)."""
    expert = not getattr(param, "allreduce", True)
    if expert:
        dp_rank = parallel_state.get_expert_data_parallel_rank()
        tp_rank = parallel_state.get_expert_tensor_parallel_rank()
    else:
        dp_rank = parallel_state.get_data_parallel_rank()
        tp_rank = parallel_state.get_tensor_model_parallel_rank()
    return dp_rank == 0 and (bool(getattr(param, "tensor_model_parallel", False)) or tp_rank == 0)


def model_parameter_total(model_chunks: list[DistributedDataParallel]) -> int:
    """The model's parameter count over all ranks (collective; one rank: its own count)."""
    owned = sum(
        int(p.numel()) for chunk in model_chunks for p in chunk.parameters() if _counts_toward_total(p)
    )
    total = torch.tensor([owned], dtype=torch.int64, device=torch.cuda.current_device())
    torch.distributed.all_reduce(total)
    return int(total.item())


def inner_optimizer_class_names(optimizer: MegatronOptimizer) -> list[str]:
    """Qualified class names of the inner optimizers (expect TE's ``FusedAdam``)."""
    return [f"{type(o).__module__}.{type(o).__qualname__}" for o in inner_optimizers(optimizer)]


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
    """The batch of 1-based ``step`` on ``dp_rank``: random tokens seeded by (seed, step, rank)."""
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
    """One training step on ``synthetic_batch(step)``; the loss is from before the update."""
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
