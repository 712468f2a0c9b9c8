"""Benchmark cases: model sizes, presets and the optimizer modes that are measured.

This module imports neither torch nor Megatron, so the driver can use it on any machine.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Final

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

#: Instance-level loaders a resume can run with (:mod:`.instance_loader`): ``bridge-like`` sets,
#: on each inner FusedAdam, a ``load_state_dict`` that runs PyTorch's loader only.
BRIDGE_LIKE: Final = "bridge-like"
INSTANCE_LOADERS: Final[tuple[str, ...]] = (BRIDGE_LIKE,)

#: One FP32 ``exp_avg`` plus one FP32 ``exp_avg_sq`` element: what the build avoids per parameter.
FP32_MOMENT_PAIR_BYTES: Final = 8

#: The state adopters the ``+stateadoption`` build registers by itself (no plugin installed).
#: The expected savings assume that only these handle the state; any other one that does on the
#: build side (an opt-in plugin such as ``te_fused_adam_precision_aware`` in the precision-aware
#: case) makes the saving measured, not predicted.
DEFAULT_ADOPTERS: Final[tuple[str, ...]] = ("te_fused_adam_fp32",)


def extra_adopters(adopters: Iterable[str] | None) -> tuple[str, ...]:
    """The adopters in ``adopters`` beyond :data:`DEFAULT_ADOPTERS`, in order, without repeats.

    ``None`` (not recorded, or no state-adoption subsystem) has none.
    """
    return tuple(dict.fromkeys(a for a in adopters or () if a not in DEFAULT_ADOPTERS))


def unpredicted_saving_note(extra: Iterable[str], handled: bool = True) -> str:
    """Why a case has no expected saving: the extra adopters on the build side, which handled
    the state (``handled``, per the recorded outcomes) or were registered there."""
    how = "handled the state" if handled else "registered"
    return (
        f"not predicted: adopters {', '.join(extra)} {how} on the build side; "
        "the saving is measured, not predicted"
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

    def approx_parameter_count(self, moe: bool) -> int:
        """Rough parameter count (weights and biases, untied embeddings, learned positions)."""
        h = self.hidden_size
        attention = 4 * h * h + 4 * h
        if moe:
            f = self.moe_ffn_hidden_size
            mlp = self.num_experts * (2 * h * f + f + h) + h * self.num_experts
        else:
            f = self.ffn_hidden_size
            mlp = 2 * h * f + f + h
        layer = attention + mlp + 4 * h
        embeddings = self.vocab_size * h + self.seq_length * h
        return self.num_layers * layer + embeddings + self.vocab_size * h + 2 * h


#: Named size presets. ``default`` is a ~1.1 B-parameter GPT (training peak ~23 GB on an H200);
#: ``small`` (~0.26 B) keeps several cases of a multi-GPU layout within one 10-minute call while
#: 8 B x params on a rank stays far above the 1 MiB tolerance; ``tiny`` is for smoke runs and
#: tests (its saving is too small for ``--check``'s +-1 %).
PRESETS: Final[Mapping[str, ModelSize]] = {
    "default": ModelSize(
        hidden_size=2048,
        num_layers=18,
        num_attention_heads=16,
        ffn_hidden_size=8192,
        seq_length=1024,
        micro_batch_size=2,
        vocab_size=50304,
        num_experts=8,
        moe_router_topk=2,
    ),
    "small": ModelSize(
        hidden_size=1024,
        num_layers=12,
        num_attention_heads=16,
        ffn_hidden_size=4096,
        seq_length=1024,
        micro_batch_size=2,
        vocab_size=50304,
        num_experts=8,
        moe_router_topk=2,
    ),
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
    ),
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
    instance_loader: str | None = None
    moment_dtype: str = "bfloat16"
    param_remainders: bool = True

    @property
    def expected_saving_bytes_per_param(self) -> int:
        """Bytes per optimizer parameter the build should avoid versus upstream at load time.

        0 for the precision-aware fallback, and with an instance-level loader, which installs
        the moments by reference on both sides.
        """
        if self.precision_aware or self.instance_loader is not None:
            return 0
        return FP32_MOMENT_PAIR_BYTES

    @property
    def load_peak_within_training_peak_expected(self) -> bool:
        """Whether the build's load peak should stay within the training peak on every rank.

        True with FP32 moments (the build's load peak is the final state plus transients);
        the precision-aware case keeps TE's loader, whose peak exceeds training on both sides.
        """
        return not self.precision_aware

    def expected_saving_given(self, build_adopters: Iterable[str] | None) -> int | None:
        """:attr:`expected_saving_bytes_per_param` when only :data:`DEFAULT_ADOPTERS` (or none
        recorded) took part on the build side; None (not predicted) when others did."""
        if extra_adopters(build_adopters):
            return None
        return self.expected_saving_bytes_per_param

    def to_json(self) -> dict[str, Any]:
        """A JSON-serialisable form, read back by :meth:`from_json`."""
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> BenchmarkCase:
        """Inverse of :meth:`to_json`."""
        fields = dict(data)
        fields["size"] = ModelSize(**fields["size"])
        return cls(**fields)


def make_case(
    name: str,
    size: ModelSize,
    train_steps: int = 2,
    seed: int = 1234,
    moe_fold_experts: bool = False,
    instance_loader: str | None = None,
) -> BenchmarkCase:
    """Build the :class:`BenchmarkCase` called ``name`` (one of :data:`CASE_NAMES`).

    ``moe_fold_experts`` (moe case only) keeps experts in the dense DistributedOptimizer, as
    Megatron-Core does by default on one rank, instead of a separate expert optimizer.
    ``instance_loader`` (one of :data:`INSTANCE_LOADERS`) resumes with an instance-level
    ``load_state_dict`` on every inner FusedAdam.
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
    case = BenchmarkCase(
        name,
        formats.get(name, name),
        size,
        train_steps=train_steps,
        seed=seed,
        instance_loader=instance_loader,
    )
    if name in (MOE_CASE, MOE_PRECISION_AWARE_CASE):
        case = dataclasses.replace(case, moe=True, moe_fold_experts=moe_fold_experts)
    if name in (PRECISION_AWARE_CASE, MOE_PRECISION_AWARE_CASE):
        case = dataclasses.replace(case, precision_aware=True)
    if name in PRECISION_AWARE_FORMAT_CASES:
        case = dataclasses.replace(case, precision_aware=True, param_remainders=False)
    if name == PRECISION_AWARE_FP16_CASE:
        case = dataclasses.replace(case, precision_aware=True, moment_dtype="float16")
    return case
