"""The GPU tests' Megatron-Core GPT: cases, model, distributed optimizer, training step.

Moved from the resume benchmark (``benchmarks/resume_benchmark``: ``cases.py``, ``launch.py``,
``runtime.py``, ``model.py``), which now runs Megatron-LM's ``pretrain_gpt.py`` instead; only
what the GPU tests use came along. Save, load, fingerprints and outcome recording are in
:mod:`mcore_checkpoint`.

A ``GPTModel`` (local layer spec, BF16 ``Float16Module``) in ``DistributedDataParallel`` with the
distributed optimizer of ``get_megatron_optimizer`` (inner optimizer: TE's ``FusedAdam``).
:func:`build_gpt_and_optimizer` initialises NCCL and the parallel state on first use. The module
imports torch and Megatron-Core's model code: the GPU tests import it inside their tests.
"""

from __future__ import annotations

import dataclasses
import os
import random
import socket
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Final

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

from megatron.core import parallel_state
from megatron.core.optimizer import MegatronOptimizer, OptimizerConfig, get_megatron_optimizer

# Cases: model sizes, presets and optimizer modes (from the benchmark's cases.py).

#: Optimizer sharding formats Megatron-Core's DistributedOptimizer offers for ``torch_dist``
#: (the same in 0.16.1, 0.18.2 and 0.19.2).
SHARDING_FORMATS: Final[tuple[str, ...]] = (
    "dp_reshardable",
    "fully_reshardable",
    "fully_sharded_model_space",
    "dp_zero_gather_scatter",
)

#: A GPT with MoE layers: a ChainedOptimizer of a dense and an expert DistributedOptimizer.
MOE_CASE: Final = "moe"

#: Precision-aware optimizer (BF16 moments, TE master weights): must fall back to TE's loader.
PRECISION_AWARE_CASE: Final = "precision_aware_bf16"

#: The precision-aware optimizer with MoE: a ChainedOptimizer of two precision-aware FusedAdams.
MOE_PRECISION_AWARE_CASE: Final = "moe_precision_aware_bf16"

#: The precision-aware optimizer with the other sharding formats (the load reads through
#: other paths than ``dp_reshardable``'s), and with FP16 moments (TE scales them per tensor).
#: The format cases keep FP32 master weights: with int16 remainders, megatron-core 0.19.2 cannot
#: resume them at all (its FP32 world buffers reach TE's ``set_scaled_state``, which asserts
#: int16 for remainders).
PRECISION_AWARE_FORMAT_CASES: Final[Mapping[str, str]] = {
    "precision_aware_bf16_fully_reshardable": "fully_reshardable",
    "precision_aware_bf16_dp_zero_gather_scatter": "dp_zero_gather_scatter",
}
PRECISION_AWARE_FP16_CASE: Final = "precision_aware_fp16"

#: Every case, in the order they run by default.
CASE_NAMES: Final[tuple[str, ...]] = (
    *SHARDING_FORMATS,
    MOE_CASE,
    PRECISION_AWARE_CASE,
    MOE_PRECISION_AWARE_CASE,
)

#: Cases that run only when named in ``--cases``.
OPT_IN_CASE_NAMES: Final[tuple[str, ...]] = (
    *PRECISION_AWARE_FORMAT_CASES,
    PRECISION_AWARE_FP16_CASE,
)


@dataclass(frozen=True)
class ModelSize:
    """Shape of the GPT model and of one micro-batch."""

    hidden_size: int
    num_layers: int
    num_attention_heads: int
    ffn_hidden_size: int
    seq_length: int
    micro_batch_size: int
    vocab_size: int
    num_experts: int
    moe_router_topk: int

    @property
    def moe_ffn_hidden_size(self) -> int:
        """FFN width of one expert: the dense FFN split across experts (same parameter count)."""
        return max(self.ffn_hidden_size // self.num_experts, 16)


#: Named size presets. ``tiny`` is for smoke runs and tests.
PRESETS: Final[Mapping[str, ModelSize]] = {
    "tiny": ModelSize(
        hidden_size=128,
        num_layers=2,
        num_attention_heads=4,
        ffn_hidden_size=512,
        seq_length=64,
        micro_batch_size=2,
        vocab_size=1024,
        num_experts=4,
        moe_router_topk=2,
    )
}


@dataclass(frozen=True)
class BenchmarkCase:
    """One measured configuration: model size, optimizer mode and checkpoint sharding format."""

    name: str
    sharding_format: str
    size: ModelSize
    moe: bool = False
    precision_aware: bool = False
    train_steps: int = 2
    seed: int = 1234
    moe_fold_experts: bool = False
    moment_dtype: str = "bfloat16"
    param_remainders: bool = True
    adoption: bool = True  # OptimizerConfig.optimizer_state_adoption (False: upstream's path)


def make_case(
    name: str,
    size: ModelSize,
    train_steps: int = 2,
    seed: int = 1234,
    moe_fold_experts: bool = False,
) -> BenchmarkCase:
    """Build the :class:`BenchmarkCase` called ``name`` (one of :data:`CASE_NAMES`).

    ``moe_fold_experts`` (moe case only) keeps experts in the dense DistributedOptimizer, as
    Megatron-Core does by default on one rank, instead of a separate expert optimizer.
    """
    formats = {
        MOE_CASE: "dp_reshardable",
        PRECISION_AWARE_CASE: "dp_reshardable",
        MOE_PRECISION_AWARE_CASE: "dp_reshardable",
        PRECISION_AWARE_FP16_CASE: "dp_reshardable",
        **PRECISION_AWARE_FORMAT_CASES,
    }
    if name not in SHARDING_FORMATS and name not in formats:
        known = ", ".join((*CASE_NAMES, *OPT_IN_CASE_NAMES))
        raise ValueError(f"unknown case {name!r}; expected one of {known}")
    case = BenchmarkCase(name, formats.get(name, name), size, train_steps=train_steps, seed=seed)
    if name in (MOE_CASE, MOE_PRECISION_AWARE_CASE):
        case = dataclasses.replace(case, moe=True, moe_fold_experts=moe_fold_experts)
    if name in (PRECISION_AWARE_CASE, MOE_PRECISION_AWARE_CASE):
        case = dataclasses.replace(case, precision_aware=True)
    if name in PRECISION_AWARE_FORMAT_CASES:
        case = dataclasses.replace(case, precision_aware=True, param_remainders=False)
    if name == PRECISION_AWARE_FP16_CASE:
        case = dataclasses.replace(case, precision_aware=True, moment_dtype="float16")
    return case


# The process layout (from the benchmark's launch.py: the layout only).


@dataclass(frozen=True)
class ParallelLayout:
    """Ranks per phase and the model-parallel sizes (pipeline and context parallel are 1).

    ``nproc_per_node`` ranks train, save and run the control; ``resume_nproc_per_node`` ranks
    run each resume (equal unless the resume is at another data-parallel size).
    """

    nproc_per_node: int = 1
    tensor_model_parallel_size: int = 1
    expert_model_parallel_size: int = 1
    resume_nproc_per_node: int = 1


# Process setup: determinism, ``torch.distributed`` (NCCL), Megatron parallel state (from the
# benchmark's runtime.py).

#: Environment every process needs before CUDA (cuBLAS) and TE are initialised.
DETERMINISM_ENV: Final[dict[str, str]] = {
    "CUBLAS_WORKSPACE_CONFIG": ":4096:8",
    "NVTE_ALLOW_NONDETERMINISTIC_ALGO": "0",
}


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


# The model and its distributed optimizer (from the benchmark's model.py).

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
        optimizer_state_adoption=case.adoption,
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
    case: BenchmarkCase, layout: ParallelLayout | None = None
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


# The training step (from the benchmark's model.py).

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
