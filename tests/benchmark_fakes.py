"""CPU stand-ins for the GPU parts of the resume benchmark's worker, for end-to-end CPU tests.

The benchmark's own code runs unchanged: ``worker.main``/``run_train``/``run_resume``, its
fingerprints, the driver's orchestration, the summary and the report. Replaced (with
``monkeypatch``, in tests only) are exactly the parts that need CUDA, NCCL or a real Megatron
model:

* ``torch.cuda``'s memory counters -> :class:`FakeDevice`, driven by what the phases allocate;
* the GPT build -> a real ``DistributedOptimizer`` (or ``ChainedOptimizer`` of two) *object*,
  created without its constructor, whose inner optimizer is the FusedAdam stand-in, and a small
  model; the model total (an all-reduce on a GPU) is the rank's own count;
* one training step -> deterministic gradients and a stand-in step (moments allocated on the
  first step, activations as a transient);
* the ``torch_dist`` save and load -> ``torch.save`` of the state into the checkpoint directory,
  and a load that goes through the inner optimizer exactly as ``DistributedOptimizer`` does:
  a scaffold pass and a payload pass, each reading the inner state dict and loading the
  assembled one -- with the build, through the real ``export_inner_optimizer_state_dict`` and
  ``load_inner_optimizer_state_dict``; with upstream (``megatron.core.optimizer.state_adoption``
  not importable), through ``state_dict()`` and ``load_state_dict()`` themselves. Whenever an
  inner optimizer allocates a copy of its moments (the stand-in counts it), that copy stays
  alive next to the scaffold until the load ends (8 B/param more at the peak), as with TE's
  loader on a GPU;
* the parallel coordinates and the gathered (resharded) fingerprint.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import pytest
import torch
from fused_adam_standin import FusedAdamStandIn

from benchmarks.resume_benchmark import checkpoint, fingerprint, model, runtime
from benchmarks.resume_benchmark.model import StepResult
from megatron.core.distributed import DistributedDataParallelConfig
from megatron.core.optimizer import OptimizerConfig
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
from megatron.core.optimizer.optimizer import ChainedOptimizer

MIB = 1 << 20
#: What the model and its grad buffers take before any optimizer state exists.
BASE_BYTES = 300 * MIB
#: One FP32 exp_avg + exp_avg_sq element.
MOMENT_BYTES = 8
#: Activations of one step, per optimizer parameter (so the training peak exceeds the load peak
#: of by-reference adoption, but not the peak of a second copy of the moments).
ACTIVATION_BYTES = 4
_CHECKPOINT_FILE = "fake-checkpoint.pt"
#: Where the fake upstream side's megatron-core lives.
UPSTREAM_FILE = "/upstream/megatron/core/__init__.py"
_UNSAVEABLE = {"fully_sharded_model_space": "ShardedTensor.flattened_range is not supported."}


@dataclass
class FakeDevice:
    """``torch.cuda``'s allocator counters for one process."""

    allocated: int = BASE_BYTES
    peak: int = BASE_BYTES

    def reset_peak(self) -> None:
        self.peak = self.allocated

    def allocate(self, nbytes: int) -> None:
        self.allocated += nbytes
        self.peak = max(self.peak, self.allocated)

    def transient(self, nbytes: int) -> None:
        self.peak = max(self.peak, self.allocated + nbytes)

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        for name in ("synchronize", "empty_cache", "set_device"):
            monkeypatch.setattr(torch.cuda, name, lambda *a, **k: None)
        monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda *a, **k: self.reset_peak())
        monkeypatch.setattr(torch.cuda, "memory_allocated", lambda *a, **k: self.allocated)
        monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a, **k: self.peak)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)


@dataclass
class FakeRank:
    """What one rank of the fake world holds: its shard sizes and its coordinates."""

    rank: int = 0
    world_size: int = 1
    params_per_optimizer: tuple[int, ...] = (4096,)
    device: FakeDevice = field(default_factory=FakeDevice)

    @property
    def optimizer_params(self) -> int:
        return sum(self.params_per_optimizer)


def _inner(params: int, seed: int) -> FusedAdamStandIn:
    generator = torch.Generator().manual_seed(seed)
    return FusedAdamStandIn([torch.nn.Parameter(torch.randn(params, generator=generator))], lr=1e-3)


def fake_optimizer(params_per_optimizer: tuple[int, ...], seed: int) -> Any:
    """A real ``DistributedOptimizer`` object (chained when there are several) over stand-ins.

    Built without the constructor: only what the benchmark and the state-adoption loader read
    is set (the inner optimizer and the owner's configs).
    """
    dist_opts = []
    for index, params in enumerate(params_per_optimizer):
        dist_opt = DistributedOptimizer.__new__(DistributedOptimizer)
        dist_opt.optimizer = _inner(params, seed + index)
        dist_opt.config = OptimizerConfig()
        dist_opt.ddp_config = DistributedDataParallelConfig()
        dist_opt.is_stub_optimizer = False
        dist_opts.append(dist_opt)
    if len(dist_opts) == 1:
        return dist_opts[0]
    chained = ChainedOptimizer.__new__(ChainedOptimizer)
    chained.chained_optimizers = dist_opts
    return chained


def _fake_step(model_chunks: Any, optimizer: Any, case: Any, step: int) -> StepResult:
    """Deterministic gradients from (seed, step, rank), one stand-in step per inner optimizer."""
    rank = FAKE_WORLD.current
    device = rank.device
    device.transient(ACTIVATION_BYTES * rank.optimizer_params)
    generator = torch.Generator().manual_seed(case.seed * 1000 + step * 10 + rank.rank)
    for inner in model.inner_optimizers(optimizer):
        fresh_moments = not inner.state
        for group in inner.param_groups:
            for param in group["params"]:
                param.grad = torch.randn(param.shape, generator=generator)
        inner.step()
        if fresh_moments:  # TE allocates the moments on the first step
            device.allocate(MOMENT_BYTES * sum(p.numel() for g in inner.param_groups for p in g["params"]))
    loss = sum(float(p.detach().sum()) for inner in model.inner_optimizers(optimizer) for p in inner.param_groups[0]["params"])
    return StepResult(step=step, loss=loss, grad_norm=0.0, update_successful=True)


def _fake_save(model_chunks: Any, optimizer: Any, sharding_format: str, checkpoint_dir: Path) -> None:
    if sharding_format in _UNSAVEABLE:
        raise RuntimeError(f"CheckpointingException: {_UNSAVEABLE[sharding_format]}")
    checkpoint_dir.mkdir(parents=True, exist_ok=True)
    state = {
        "model": {name: p.detach().clone() for name, p in model_chunks[0].named_parameters()},
        "optimizers": [inner.state_dict() for inner in model.inner_optimizers(optimizer)],
        "main_params": [[p.detach().clone() for p in _main_params(inner)] for inner in model.inner_optimizers(optimizer)],
    }
    torch.save(state, checkpoint_dir / f"{_CHECKPOINT_FILE}.rank{FAKE_WORLD.current.rank}")


def _main_params(inner: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The inner optimizer's parameters (MCore's FP32 main-param shards), in group order."""
    return [p for group in inner.param_groups for p in group["params"]]


def _scaffold(saved: dict[str, Any]) -> dict[str, Any]:
    """What MCore's first load pass offers: the saved structure with freshly allocated moments."""
    return {
        "state": {k: {n: torch.zeros_like(t) if isinstance(t, torch.Tensor) else t for n, t in s.items()}
                  for k, s in saved["state"].items()},
        "param_groups": [dict(g) for g in saved["param_groups"]],
    }  # fmt: skip


def _inner_load(dist_opt: Any, state_dict: dict[str, Any]) -> None:
    """One ``DistributedOptimizer.load_state_dict`` call's use of the inner optimizer."""
    try:
        from megatron.core.optimizer.state_adoption import (
            export_inner_optimizer_state_dict,
            load_inner_optimizer_state_dict,
        )
    except ImportError:  # upstream: the inner optimizer's own methods
        dist_opt.optimizer.state_dict()
        dist_opt.optimizer.load_state_dict(state_dict)
        return
    export_inner_optimizer_state_dict(dist_opt)
    load_inner_optimizer_state_dict(dist_opt, state_dict)


def _fake_load(
    model_chunks: Any,
    optimizer: Any,
    sharding_format: str,
    checkpoint_dir: Path,
    on_phase: Optional[Callable[[str], None]] = None,
) -> None:
    rank = FAKE_WORLD.current
    saved = torch.load(checkpoint_dir / f"{_CHECKPOINT_FILE}.rank{rank.rank}", weights_only=False)
    with torch.no_grad():
        for name, param in model_chunks[0].named_parameters():
            param.copy_(saved["model"][name])
    pairs = zip(model.distributed_optimizers(optimizer), saved["optimizers"], saved["main_params"])
    copies = 0
    for dist_opt, state, main_params in pairs:
        inner = dist_opt.optimizer
        with torch.no_grad():
            for param, value in zip(_main_params(inner), main_params):
                param.copy_(value)
        moments = MOMENT_BYTES * sum(p.numel() for g in inner.param_groups for p in g["params"])
        rank.device.allocate(moments)  # the scaffold: the state the checkpoint is read into
        allocations = inner.allocations
        for offered in (_scaffold(state), state):
            _inner_load(dist_opt, offered)
        if inner.allocations > allocations:  # the loader copied: a second copy until the end
            rank.device.allocate(moments)
            copies += moments
    rank.device.allocated -= copies  # the load's references are dropped


class FakeWorld:
    """The rank the worker currently runs as (several ranks run one after another)."""

    def __init__(self) -> None:
        self.current = FakeRank()

    def run_as(self, rank: FakeRank, monkeypatch: pytest.MonkeyPatch) -> None:
        self.current = rank
        rank.device = FakeDevice()
        rank.device.install(monkeypatch)
        if rank.world_size > 1:
            for key, value in (("RANK", rank.rank), ("WORLD_SIZE", rank.world_size), ("LOCAL_RANK", rank.rank)):
                monkeypatch.setenv(key, str(value))
        else:
            for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
                monkeypatch.delenv(key, raising=False)


FAKE_WORLD = FakeWorld()


def _fake_build(case: Any, layout: Any = None) -> tuple[list[torch.nn.Module], Any]:
    rank = FAKE_WORLD.current
    torch.manual_seed(case.seed)
    chunk = torch.nn.Linear(8, 4)
    return [chunk], fake_optimizer(rank.params_per_optimizer, case.seed + 100 * rank.rank)


def _coordinates() -> dict[str, int]:
    rank = FAKE_WORLD.current
    return {"rank": rank.rank, "world_size": rank.world_size, "tp_rank": 0, "pp_rank": 0,
            "dp_rank": rank.rank, "ep_rank": 0, "expert_tp_rank": 0, "expert_dp_rank": rank.rank}  # fmt: skip


def _gathered_fingerprint(model_chunks: Any, optimizer: Any) -> dict[str, str]:
    """The unsharded state as the same names on any DP size (rank 0 holds the world tensors)."""
    digest = "|".join(f"{float(p.sum()):.17g}" for p in model_chunks[0].parameters())
    if FAKE_WORLD.current.rank != 0:
        return {"model.tp0.pp0.chunk0": digest}
    return {"model.tp0.pp0.chunk0": digest, "opt0.mp0.gbuf0.world": "world-state"}


def install_fake_gpu(monkeypatch: pytest.MonkeyPatch) -> FakeWorld:
    """Replace the GPU parts of the worker (see the module docstring); return the fake world."""
    monkeypatch.setattr(model, "build_gpt_and_optimizer", _fake_build)
    monkeypatch.setattr(model, "model_parameter_total", model.model_parameter_count)
    monkeypatch.setattr(model, "train_step", _fake_step)
    monkeypatch.setattr(checkpoint, "save_checkpoint", _fake_save)
    monkeypatch.setattr(checkpoint, "load_checkpoint", _fake_load)
    monkeypatch.setattr(runtime, "rank_coordinates", _coordinates)
    monkeypatch.setattr(runtime, "shutdown", lambda: None)
    monkeypatch.setattr(fingerprint, "gathered_fingerprint", _gathered_fingerprint)
    FAKE_WORLD.run_as(FakeRank(), monkeypatch)
    return FAKE_WORLD


def without_state_adoption(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make this process look like upstream: no ``megatron.core.optimizer.state_adoption``."""
    monkeypatch.setitem(sys.modules, "megatron.core.optimizer.state_adoption", None)


def standin_is_te_fused_adam(monkeypatch: pytest.MonkeyPatch) -> None:
    """Let the build's registered default adopter recognise the FusedAdam stand-in on the CPU.

    The registration itself (name, origin, position) stays as the build made it; only what its
    adopter recognises -- TE's class on CUDA -- is pointed at the stand-in on the CPU, and
    ``monkeypatch`` restores it.
    """
    from megatron.core.optimizer.state_adoption import registered_state_adopters

    (default,) = [r for r in registered_state_adopters() if r.name == "te_fused_adam_fp32"]
    monkeypatch.setattr(default.adopter, "_fused_adam_class", FusedAdamStandIn)
    monkeypatch.setattr(default.adopter, "_param_device_type", "cpu")


def split_params(total: int, world_size: int, chained: bool) -> tuple[int, ...]:
    """One rank's optimizer parameters with data parallelism over ``world_size`` ranks: the
    dense optimizer's (and, chained, an expert optimizer's of half that size) share."""
    dense = total // world_size
    return (dense, dense // 2) if chained else (dense,)


def run_phases_in_process(
    monkeypatch: pytest.MonkeyPatch, total_params: int = 1 << 19, upstream_version: str | None = None
) -> list[tuple[str, str, int]]:
    """Make the driver run every phase in this process: ``worker.main`` once per rank, as that
    rank; upstream without the state-adoption subsystem, reporting the build's public release
    (or ``upstream_version``) installed elsewhere. Returns the launches ``(phase, side, nproc)``."""
    from benchmarks.resume_benchmark import cli, driver, worker
    from benchmarks.resume_benchmark.cases import BenchmarkCase
    from benchmarks.resume_benchmark.launch import rank_result_path
    from benchmarks.resume_benchmark.results import read_json, write_json

    launches: list[tuple[str, str, int]] = []
    monkeypatch.setattr(worker, "_configure_logging", lambda: None)  # keep pytest's logging

    def run_phase(
        workspace: Any, side: Any, phase: str, name: str, spec: Any, timeout_s: float, nproc: int = 1
    ) -> Any:
        launches.append((phase, side.label, nproc))
        result = workspace.path(f"{name}.result.json")
        log = workspace.path(f"{name}.log")
        log.write_text(f"# in-process fake launch of {phase} on {nproc} rank(s)\n")
        argv = ["--phase", phase, "--result", str(result)]
        chained = False
        if spec is not None:
            write_json(workspace.path(f"{name}.spec.json"), spec)
            argv += ["--spec", str(workspace.path(f"{name}.spec.json"))]
            case = BenchmarkCase.from_json(spec["case"])
            chained = case.moe and not case.moe_fold_experts
        build_info = worker.megatron_core_info

        def upstream_info() -> dict[str, Any]:
            """The build's megatron-core as upstream shows it: its public release, elsewhere."""
            info = build_info()
            version = upstream_version or info["version"].split("+")[0]
            return {**info, "version": version, "file": UPSTREAM_FILE}

        returncode = 0
        for r in range(nproc):
            with monkeypatch.context() as scoped:
                FAKE_WORLD.run_as(FakeRank(r, nproc, split_params(total_params, nproc, chained)), scoped)
                if side.label == "upstream":
                    without_state_adoption(scoped)
                    scoped.setattr(worker, "megatron_core_info", upstream_info)
                returncode = max(returncode, worker.main(argv))
        paths = [rank_result_path(result, r) for r in range(nproc)]
        results = tuple(read_json(p) if p.is_file() else None for p in paths)
        return driver.PhaseOutcome(returncode, results, log, 0.0)

    monkeypatch.setattr(driver, "run_phase", run_phase)
    monkeypatch.setattr(cli, "run_phase", run_phase)
    return launches
