"""Process layout of a run: how many ranks each phase uses, its validation, the worker command.

Pure Python (no torch): the driver and the CPU tests use it on any machine.

A phase on one rank is the plain process ``python -m benchmarks.resume_benchmark.worker ...``;
on N > 1 ranks it is one ``python -m torch.distributed.run --standalone --nproc-per-node N
-m benchmarks.resume_benchmark.worker ...`` launch whose console lines carry their rank
(``[rank<r>]: ``). Either way every rank writes its own result file (:func:`rank_result_path`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from benchmarks.resume_benchmark.cases import (
    MOE_CASE,
    BenchmarkCase,
    ModelSize,
)

#: The worker module every phase runs.
WORKER_MODULE: Final = "benchmarks.resume_benchmark.worker"

#: How ``torch.distributed.run`` prefixes each console line of a rank (``--tee 3``), set through
#: the environment (:data:`RANK_LINE_PREFIX_ENV`): torch 2.11 reads the variable but has no
#: command-line flag for it.
RANK_LINE_PREFIX_TEMPLATE: Final = "[rank${rank}]: "
RANK_LINE_PREFIX_ENV: Final = {"TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE": RANK_LINE_PREFIX_TEMPLATE}
#: Matches that prefix, or torch's default ``[default<local rank>]:`` (one node: the global
#: rank); group 1 is the rank.
RANK_LINE_PREFIX: Final = re.compile(r"^\[(?:rank|default)(\d+)\]: ?")

#: Sharding formats whose ``torch_dist`` checkpoint Megatron-Core can load at another
#: data-parallel size (read from 0.19.2, see docs/multi-gpu.md; 0.16.1 and 0.18.2 have the same
#: formats and load branches):
#:
#: * ``fully_reshardable``: model-space tensors, every rank loads and slices its range
#:   (``DistributedOptimizer.checkpoint_fully_reshardable_formats``; TP/PP may change too);
#: * ``dp_reshardable``: one ShardedTensor per bucket of global size ``numel_unpadded``; only
#:   the DP-dependent bucket-end padding is dropped, so the DP size may change (TP/PP may not);
#: * ``dp_zero_gather_scatter``: unpadded world tensors in one ShardedObject per TP x PP
#:   rank, scattered on load by DP rank 0 with the *current* DP size (TP/PP may not change).
DP_RESHARDABLE_FORMATS: Final[frozenset[str]] = frozenset(
    {"dp_reshardable", "fully_reshardable", "dp_zero_gather_scatter"}
)

#: Why the remaining format is refused for a resume at another DP size.
_NOT_DP_RESHARDABLE_WHY: Final[Mapping[str, str]] = {
    "fully_sharded_model_space": "megatron-core 0.19.2 cannot save it at all "
    "(CheckpointingException: ShardedTensor.flattened_range is not supported; 0.16.1 and "
    "0.18.2 have the same check), so there is no checkpoint to reshard",
}


class LayoutError(ValueError):
    """The requested process layout is invalid for the cases or the model size."""


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

    @property
    def single_rank(self) -> bool:
        """Whether every phase runs on one rank (plain worker processes, no launcher)."""
        return self.nproc_per_node == 1 and self.resume_nproc_per_node == 1

    @property
    def resharded(self) -> bool:
        """Whether the resume runs at a different data-parallel size than the save."""
        return self.resume_nproc_per_node != self.nproc_per_node

    def data_parallel_size(self, nproc: int) -> int:
        """Dense data-parallel size at ``nproc`` ranks (world / TP)."""
        return nproc // self.tensor_model_parallel_size

    def phase_nproc(self, phase: str) -> int:
        """Ranks that run ``phase`` (``train`` or ``resume``)."""
        return self.resume_nproc_per_node if phase == "resume" else self.nproc_per_node

    @property
    def gpus_needed(self) -> int:
        """GPUs the largest phase needs (one per rank)."""
        return max(self.nproc_per_node, self.resume_nproc_per_node)

    def to_json(self) -> dict[str, Any]:
        """JSON form (worker spec and report settings)."""
        return {
            "nproc_per_node": self.nproc_per_node,
            "tensor_model_parallel_size": self.tensor_model_parallel_size,
            "expert_model_parallel_size": self.expert_model_parallel_size,
            "resume_nproc_per_node": self.resume_nproc_per_node,
            "data_parallel_size": self.data_parallel_size(self.nproc_per_node),
            "resume_data_parallel_size": self.data_parallel_size(self.resume_nproc_per_node),
            "resharded": self.resharded,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> ParallelLayout:
        """Inverse of :meth:`to_json` (derived fields are ignored)."""
        return cls(
            nproc_per_node=int(data["nproc_per_node"]),
            tensor_model_parallel_size=int(data["tensor_model_parallel_size"]),
            expert_model_parallel_size=int(data["expert_model_parallel_size"]),
            resume_nproc_per_node=int(data["resume_nproc_per_node"]),
        )


def _check_world(what: str, nproc: int, tp: int, ep: int) -> None:
    if nproc < 1:
        raise LayoutError(f"{what} must be at least 1, got {nproc}")
    if nproc % tp:
        raise LayoutError(
            f"{what} {nproc} is not divisible by --tensor-model-parallel-size {tp} "
            "(Megatron-Core requires world size % (TP x PP x CP) == 0; PP = CP = 1 here)"
        )
    if nproc % (tp * ep):
        raise LayoutError(
            f"{what} {nproc} is not divisible by TP x EP = {tp} x {ep} = {tp * ep} "
            "(Megatron-Core requires world size % (expert TP x EP x PP) == 0; expert TP = TP)"
        )


def _check_size(size: ModelSize, tp: int, ep: int, moe: bool) -> None:
    for name, value in (
        ("--num-attention-heads", size.num_attention_heads),
        ("--ffn-hidden-size", size.ffn_hidden_size),
        ("--vocab-size", size.vocab_size),
    ):
        if value % tp:
            raise LayoutError(
                f"{name} {value} is not divisible by --tensor-model-parallel-size {tp}"
            )
    if moe and size.num_experts % ep:
        raise LayoutError(
            f"--num-experts {size.num_experts} is not divisible by "
            f"--expert-model-parallel-size {ep}"
        )
    if moe and size.moe_ffn_hidden_size % tp:
        raise LayoutError(
            f"the expert FFN width {size.moe_ffn_hidden_size} (FFN / experts) is not divisible "
            f"by --tensor-model-parallel-size {tp}"
        )


def _check_cases(layout: ParallelLayout, cases: Sequence[BenchmarkCase]) -> None:
    ep = layout.expert_model_parallel_size
    if ep > 1:
        dense = [c.name for c in cases if not c.moe]
        if dense:
            raise LayoutError(
                f"--expert-model-parallel-size {ep} applies to the {MOE_CASE} case only; "
                f"drop {', '.join(dense)} from --cases (e.g. --cases {MOE_CASE})"
            )
        if any(c.moe_fold_experts for c in cases):
            raise LayoutError(
                "--moe-fold-experts cannot be combined with --expert-model-parallel-size > 1 "
                "(expert-parallel experts always get their own DistributedOptimizer)"
            )
    if layout.resharded:
        for case in cases:
            refuse_dp_resharding(case.sharding_format, case.name)
    with_loader = [c.name for c in cases if c.instance_loader is not None and c.precision_aware]
    if with_loader:
        raise LayoutError(
            f"--instance-loader emulates a loader for FusedAdam with FP32 moments; drop "
            f"{', '.join(with_loader)} from --cases (PyTorch's loader alone would not convert "
            "its BF16 moments)"
        )


def refuse_dp_resharding(sharding_format: str, case_name: str) -> None:
    """Raise :class:`LayoutError` unless ``sharding_format`` may be loaded at another DP size."""
    if sharding_format in DP_RESHARDABLE_FORMATS:
        return
    why = _NOT_DP_RESHARDABLE_WHY.get(sharding_format, "it is not known to be DP-reshardable")
    raise LayoutError(
        f"case {case_name}: sharding format {sharding_format} cannot be resumed at another "
        f"data-parallel size ({why}); --resume-nproc-per-node differing from --nproc-per-node "
        f"is supported for {', '.join(sorted(DP_RESHARDABLE_FORMATS))}"
    )


def validate_layout(
    nproc_per_node: int,
    tensor_model_parallel_size: int,
    expert_model_parallel_size: int,
    resume_nproc_per_node: int | None,
    cases: Sequence[BenchmarkCase],
    size: ModelSize,
) -> ParallelLayout:
    """The :class:`ParallelLayout` for the flags, or :class:`LayoutError` saying what is wrong.

    ``resume_nproc_per_node`` ``None`` means the same as ``nproc_per_node``.
    """
    tp, ep = tensor_model_parallel_size, expert_model_parallel_size
    if tp < 1 or ep < 1:
        raise LayoutError(
            f"--tensor-model-parallel-size and --expert-model-parallel-size must be at least 1, "
            f"got {tp} and {ep}"
        )
    resume = nproc_per_node if resume_nproc_per_node is None else resume_nproc_per_node
    _check_world("--nproc-per-node", nproc_per_node, tp, ep)
    _check_world("--resume-nproc-per-node", resume, tp, ep)
    _check_size(size, tp, ep, any(c.moe for c in cases))
    layout = ParallelLayout(nproc_per_node, tp, ep, resume)
    _check_cases(layout, cases)
    return layout


def worker_command(
    python: str,
    phase: str,
    result_path: Path,
    spec_path: Path | None,
    nproc: int = 1,
) -> list[str]:
    """The command of one phase on ``nproc`` ranks of this node.

    One rank: the plain process ``python -m benchmarks.resume_benchmark.worker ...``. More:
    ``torch.distributed.run --standalone``, every rank's output on the launcher's console with
    its rank prefixed (:data:`RANK_LINE_PREFIX_TEMPLATE`, given in the environment).
    """
    if nproc < 1:
        raise ValueError(f"a phase needs at least one rank, got {nproc}")
    launcher = [python]
    if nproc > 1:
        launcher += [
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            str(nproc),
            "--tee",
            "3",
        ]
    command = [*launcher, "-m", WORKER_MODULE, "--phase", phase, "--result", str(result_path)]
    if spec_path is not None:
        command += ["--spec", str(spec_path)]
    return command


def rank_result_path(result_path: Path, rank: int) -> Path:
    """Where rank ``rank`` writes its result: ``X.result.json`` -> ``X.result.rank<r>.json``."""
    return result_path.with_name(f"{result_path.stem}.rank{rank}{result_path.suffix}")
