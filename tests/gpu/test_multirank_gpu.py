"""Real Megatron-Core resume on two GPUs: every rank adopts and is bitwise equal to the control.

Run on a machine with two GPUs, one pytest process per rank::

    python -m torch.distributed.run --standalone --nproc-per-node 2 \\
        -m pytest tests/gpu/test_multirank_gpu.py -q -rA -p no:cacheprovider

Each case trains mcore_gpt's tiny GPT (distributed optimizer, real TE FusedAdam) on both
ranks with its layout (DP 2 for the three DP-reshardable formats, EP 2 for MoE with a
ChainedOptimizer, TP 2), saves a ``torch_dist`` checkpoint into one directory, takes step N+1
as the uninterrupted control, then builds a fresh model and optimizer in the same process and
loads the checkpoint through the installed build. On every rank: the state-adoption outcomes
say ``te_fused_adam_fp32`` installed the state on both load passes of every DistributedOptimizer,
each measured as 8 B x that optimizer's parameters on the rank installed by reference
(``reused_bytes``) and nothing newly allocated; the restored state and step N+1 are bitwise
equal to the control. The ranks exchange their findings before asserting, so a
failure on one rank fails the test on both instead of leaving the other waiting.

Skipped, with the reason, without CUDA and Transformer Engine, or unless launched as exactly
two ranks on a node with at least two GPUs.
"""

import datetime
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterator, List

import pytest
import torch
from gpu_requirements import gpu_only
from mcore_runs import digests, free_cuda, train_save_control

WORLD_SIZE = 2
ADOPTER = "te_fused_adam_fp32"
LAUNCH = (
    "python -m torch.distributed.run --standalone --nproc-per-node 2 -m pytest "
    "tests/gpu/test_multirank_gpu.py"
)


def _missing_ranks() -> str:
    """Why this process is not one of two ranks on a two-GPU node, or ''."""
    if os.environ.get("WORLD_SIZE") != str(WORLD_SIZE):
        return f"needs {WORLD_SIZE} ranks (WORLD_SIZE={os.environ.get('WORLD_SIZE')}); run: {LAUNCH}"
    if torch.cuda.device_count() < WORLD_SIZE:
        return f"needs {WORLD_SIZE} GPUs, {torch.cuda.device_count()} visible"
    return ""


pytestmark = [*gpu_only, pytest.mark.skipif(bool(_missing_ranks()), reason=_missing_ranks() or "-")]

# (case, nproc, tensor-parallel size, expert-parallel size), the same order on every rank.
CASES = [
    ("dp_reshardable", 2, 1, 1),
    ("fully_reshardable", 2, 1, 1),
    ("dp_zero_gather_scatter", 2, 1, 1),
    ("moe", 2, 1, 2),
    ("dp_reshardable", 2, 2, 1),
]


@pytest.fixture(scope="module")
def world() -> Iterator[int]:
    """This rank's NCCL world, with a short timeout: a rank that fails cannot hang the other."""
    import torch.distributed as dist

    from mcore_gpt import shutdown

    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    if not dist.is_initialized():
        dist.init_process_group("nccl", init_method="env://", timeout=datetime.timedelta(minutes=3))
    yield dist.get_rank()
    shutdown()


def _shared_directory(rank: int) -> Path:
    """One new directory for every rank (made by rank 0, its name broadcast)."""
    import torch.distributed as dist

    root = "/dev/shm" if os.path.isdir("/dev/shm") else None
    name: List[Any] = [tempfile.mkdtemp(prefix="multirank-gpu-test-", dir=root) if rank == 0 else None]
    dist.broadcast_object_list(name, src=0)
    return Path(name[0])


def _on_every_rank(problems: List[str]) -> List[str]:
    """Every rank's problems, each prefixed with its rank (collective)."""
    import torch.distributed as dist

    gathered: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, problems)
    return [f"rank {r}: {p}" for r, found in enumerate(gathered) for p in found]


def _outcome_problems(outcomes: Any, params_per_optimizer: List[int]) -> List[str]:
    """What is wrong with this rank's load outcomes (empty: both passes of every optimizer
    adopted by the default adopter, each installing 8 B x that optimizer's parameters by
    reference and allocating nothing)."""
    if outcomes is None:
        return ["the installed megatron-core records no state-adoption outcomes (no register_outcome_hook)"]
    loads = [o for o in outcomes if o["hook_point"] == "load"]
    problems = [
        f"{o['optimizer']} was loaded by {o['adopter'] or 'its own load_state_dict'} "
        f"({o['fallback_reason']}; declines {o['declines']})"
        for o in loads
        if o["adopter"] != ADOPTER
    ]
    reused = sorted(o["reused_bytes"] for o in loads)
    expected = sorted(8 * p for p in params_per_optimizer for _ in range(2))  # two load passes
    if reused != expected:
        problems.append(f"bytes installed by reference {reused}, expected {expected} (8 B x params, per pass)")
    allocated = [o["allocated_bytes"] for o in loads]
    if any(allocated):
        problems.append(f"bytes newly allocated {allocated}, expected none")
    return problems


@pytest.mark.parametrize(("case_name", "nproc", "tp", "ep"), CASES, ids=[f"{c}-tp{t}-ep{e}" for c, _, t, e in CASES])
def test_every_rank_adopts_and_matches_the_control(world: int, case_name: str, nproc: int, tp: int, ep: int) -> None:
    import torch.distributed as dist

    from mcore_checkpoint import load_checkpoint

    from benchmarks.resume_benchmark.results import recording_outcomes
    from mcore_gpt import PRESETS, ParallelLayout, build_gpt_and_optimizer, inner_optimizers
    from mcore_gpt import make_case, train_step
    from megatron.core import parallel_state

    case = make_case(case_name, PRESETS["tiny"])
    layout = ParallelLayout(nproc, tp, ep, nproc)
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()  # the previous case's TP/EP groups
    directory = _shared_directory(world)
    try:
        control = train_save_control(case, directory / "checkpoint", layout)
        model_chunks, optimizer = build_gpt_and_optimizer(case, layout)
        params = [sum(p.numel() for g in o.param_groups for p in g["params"]) for o in inner_optimizers(optimizer)]
        with recording_outcomes() as outcomes:
            load_checkpoint(model_chunks, optimizer, case.sharding_format, directory / "checkpoint")
        problems = _outcome_problems(outcomes, params)
        if digests(model_chunks, optimizer) != control["saved"]:
            problems.append("the restored state differs from the control's")
        result = train_step(model_chunks, optimizer, case, case.train_steps + 1)
        if result.loss != control["loss"]:
            problems.append(f"step N+1 loss {result.loss!r} differs from the control's {control['loss']!r}")
        if digests(model_chunks, optimizer) != control["after_step"]:
            problems.append("the state after step N+1 differs from the control's")
        print(f"rank {world} {case_name} tp{tp} ep{ep}: params per optimizer {params}; outcomes {outcomes}")
        del model_chunks, optimizer
        free_cuda()
        everywhere = _on_every_rank(problems)
    finally:
        dist.barrier()
        if world == 0:
            shutil.rmtree(directory, ignore_errors=True)
    assert not everywhere, "\n".join(everywhere)
