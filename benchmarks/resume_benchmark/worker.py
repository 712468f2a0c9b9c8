"""One benchmark phase in one fresh process (``PYTHONPATH`` selects the ``megatron-core``).

Usage::

    python -m benchmarks.resume_benchmark.worker --phase probe --result R.json
    python -m benchmarks.resume_benchmark.worker --phase train|resume --spec S.json --result R.json
    python -m torch.distributed.run --standalone --nproc-per-node N \
        -m benchmarks.resume_benchmark.worker --phase resume --spec S.json --result R.json

Every rank sets up NCCL and Megatron's parallel state with the spec's ``parallel`` layout and
writes ``R.rank<r>.json``: its coordinates, measurements and fingerprints (when resharded, also
the DP-size-independent :func:`.fingerprint.gathered_fingerprint`).

* ``probe``: Python, torch, CUDA, GPU, driver, Transformer Engine and ``megatron-core`` versions.
* ``train``: build, train ``case.train_steps`` steps, save a ``torch_dist`` checkpoint,
  fingerprint, run step N+1 (the uninterrupted control).
* ``resume``: build, load the checkpoint (timed; peak over the pre-load baseline), fingerprint,
  run step N+1. Also records ``state_adoption`` (adopters and hook-point outcomes) and, with
  ``case.instance_loader``, the calls of the instance-level loaders (:mod:`.instance_loader`).

Exit status: 0 when the phase ran (an unsaveable checkpoint format is a result), 1 when it
failed (the result file then holds ``"error"``).
"""

from __future__ import annotations

import argparse
import gc
import importlib.metadata
import importlib.util
import logging
import platform
import shutil
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from benchmarks.resume_benchmark.results import (
    Digests,
    ModelRecord,
    StepRecord,
    WorkerResult,
    adopters_text,
    fallback_text,
    has_outcome_hooks,
    installed_by_text,
    one_line,
    progress,
    read_json,
    recording_outcomes,
    registered_adopter_names,
    write_json,
)
from benchmarks.resume_benchmark.cases import BenchmarkCase
from benchmarks.resume_benchmark.memory_timeline import (
    LoadTimeline,
    finished_timeline,
    started_timeline,
)
from benchmarks.resume_benchmark.launch import ParallelLayout, rank_result_path
from benchmarks.resume_benchmark import runtime
from benchmarks.resume_benchmark.runtime import apply_determinism_env, launched_rank


def megatron_core_info() -> dict[str, Any]:
    """Version, file and state-adoption presence of the ``megatron.core`` this process imports."""
    import megatron.core

    core_file = Path(megatron.core.__file__ or "").resolve()
    site_dir = core_file.parents[2]
    version = None
    for dist in importlib.metadata.distributions(path=[str(site_dir)]):
        if (dist.metadata["Name"] or "").lower().replace("_", "-") == "megatron-core":
            version = dist.version
            break
    if version is None:
        version = str(getattr(megatron.core, "__version__", "unknown"))
    has_adoption = importlib.util.find_spec("megatron.core.optimizer.state_adoption") is not None
    return {
        "version": version,
        "file": str(core_file),
        "site": str(site_dir),
        "has_state_adoption": has_adoption,
        "has_outcome_hooks": has_adoption and has_outcome_hooks(),
    }


def _driver_version() -> str:
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return "unknown (nvidia-smi not found)"
    try:
        out = subprocess.run(
            [smi, "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        )
        return out.stdout.strip().splitlines()[0]
    except (OSError, subprocess.SubprocessError, IndexError) as exc:
        return f"unknown ({one_line(exc)})"


def probe() -> dict[str, Any]:
    """Environment report; never raises for a missing TE/megatron-core (it records the error)."""
    import torch  # before transformer_engine, which finds NCCL through torch

    info: dict[str, Any] = {
        "python": platform.python_version(),
        "executable": sys.executable,
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
        "gpu_name": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "driver": _driver_version() if torch.cuda.is_available() else None,
    }
    try:
        import transformer_engine  # noqa: F401
        import transformer_engine.pytorch  # noqa: F401

        info["transformer_engine"] = {
            "version": importlib.metadata.version("transformer_engine"),
            "file": str(Path(transformer_engine.__file__ or "").resolve()),
            "error": None,
        }
    except Exception as exc:  # noqa: BLE001 - reported, not raised
        info["transformer_engine"] = {"version": None, "file": None, "error": one_line(exc)}
    try:
        info["megatron_core"] = megatron_core_info()
        info["megatron_core"]["error"] = None
    except Exception as exc:  # noqa: BLE001 - reported, not raised
        info["megatron_core"] = {"version": None, "file": None, "error": one_line(exc)}
    return info


def _configure_logging() -> None:
    logging.basicConfig(
        level=logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stdout,
        force=True,
    )


def _directory_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _step_json(result: Any) -> StepRecord:
    return {
        "step": result.step,
        "loss": result.loss,
        "loss_hex": float(result.loss).hex(),
        "grad_norm": result.grad_norm,
        "update_successful": result.update_successful,
    }


def _who(case: BenchmarkCase, label: str) -> str:
    """Progress-line prefix: ``case/side``, plus the rank when the launch has several."""
    rank, world_size, _ = launched_rank()
    return f"{case.name}/{label}" + (f" rank {rank}" if world_size > 1 else "")


def _build(
    case: BenchmarkCase, label: str, layout: ParallelLayout
) -> tuple[Any, Any, ModelRecord]:
    from benchmarks.resume_benchmark.model import (
        build_gpt_and_optimizer,
        inner_optimizer_class_names,
        model_parameter_count,
        model_parameter_total,
        optimizer_parameter_count,
    )

    who = _who(case, label)
    started = time.perf_counter()
    model_chunks, optimizer = build_gpt_and_optimizer(case, layout)
    info: ModelRecord = {
        "total_params": model_parameter_total(model_chunks),
        "model_params_on_rank": model_parameter_count(model_chunks),
        "optimizer_params": optimizer_parameter_count(optimizer),
        "inner_optimizers": inner_optimizer_class_names(optimizer),
        "build_seconds": time.perf_counter() - started,
    }
    progress(
        f"{who}: built GPT ({info['total_params']:,} params in all, "
        f"{info['model_params_on_rank']:,} on the rank, "
        f"{info['optimizer_params']:,} optimizer params on the rank, "
        f"{len(info['inner_optimizers'])} DistributedOptimizer(s), inner "
        f"{', '.join(sorted(set(info['inner_optimizers'])))})"
    )
    return model_chunks, optimizer, info


def _next_step(case: BenchmarkCase, model_chunks: Any, optimizer: Any) -> StepRecord:
    """Run step N+1 with a fresh peak counter; loss, peak and fingerprint after the step."""
    from benchmarks.resume_benchmark.fingerprint import fingerprint_state
    from benchmarks.resume_benchmark.model import train_step

    with runtime.measured_peak() as peak:
        result = train_step(model_chunks, optimizer, case, case.train_steps + 1)
    return {
        **_step_json(result),
        "baseline_bytes": peak.baseline_bytes,
        "peak_bytes": peak.peak_bytes,
        "fingerprint": fingerprint_state(model_chunks, optimizer),
    }


def _fingerprints(
    layout: ParallelLayout, model_chunks: Any, optimizer: Any
) -> tuple[Digests, Digests | None]:
    """This rank's fingerprint and, if resharded, the gathered one (collective)."""
    from benchmarks.resume_benchmark.fingerprint import fingerprint_state, gathered_fingerprint

    digests = fingerprint_state(model_chunks, optimizer)
    return digests, gathered_fingerprint(model_chunks, optimizer) if layout.resharded else None


def _started(
    phase: str, case: BenchmarkCase, label: str, layout: ParallelLayout
) -> tuple[WorkerResult, Any, Any]:
    """The phase's record so far, the model chunks and the optimizer, built on this rank."""
    out: WorkerResult = {"phase": phase, "case": case.name, "side": label}
    out["megatron_core"] = megatron_core_info()
    model_chunks, optimizer, out["model"] = _build(case, label, layout)
    out["rank"] = runtime.rank_coordinates()
    return out, model_chunks, optimizer


def run_train(
    case: BenchmarkCase, checkpoint_dir: Path, label: str, layout: ParallelLayout
) -> WorkerResult:
    """Train+save+control phase of this rank (see module docstring)."""
    import torch

    from benchmarks.resume_benchmark.checkpoint import save_checkpoint
    from benchmarks.resume_benchmark.model import train_step

    who = _who(case, label)
    out, model_chunks, optimizer = _started("train", case, label, layout)

    with runtime.measured_peak() as peak:
        steps = [
            _step_json(train_step(model_chunks, optimizer, case, s))
            for s in range(1, case.train_steps + 1)
        ]
    out["train"] = {
        "steps": steps,
        "baseline_bytes": peak.baseline_bytes,
        "peak_bytes": peak.peak_bytes,
        "seconds": peak.seconds,
    }
    progress(
        f"{who}: trained {case.train_steps} steps "
        f"(losses {', '.join(format(s['loss'], '.6f') for s in steps)}; "
        f"training peak {out['train']['peak_bytes'] / 2**20:,.1f} MiB)"
    )

    progress(
        f"{who}: saving torch_dist checkpoint ({case.sharding_format}) " f"to {checkpoint_dir}"
    )
    started = time.perf_counter()
    try:
        save_checkpoint(model_chunks, optimizer, case.sharding_format, checkpoint_dir)
    except Exception as exc:  # noqa: BLE001 - an unsupported format is a result
        traceback.print_exc(file=sys.stdout)
        out["save"] = {
            "ok": False,
            "error": one_line(exc),
            "seconds": time.perf_counter() - started,
        }
        progress(f"{who}: save FAILED -> unsupported: {one_line(exc)}")
        return out
    torch.cuda.synchronize()
    out["save"] = {
        "ok": True,
        "error": None,
        "seconds": time.perf_counter() - started,
        "checkpoint_bytes": _directory_bytes(checkpoint_dir),
    }
    progress(
        f"{who}: saved {out['save']['checkpoint_bytes'] / 2**20:,.1f} MiB "
        f"in {out['save']['seconds']:.2f} s; fingerprinting state"
    )
    out["post_save_fingerprint"], gathered = _fingerprints(layout, model_chunks, optimizer)
    if gathered is not None:
        out["post_save_gathered_fingerprint"] = gathered
    out["next_step"] = _next_step(case, model_chunks, optimizer)
    progress(
        f"{who}: control step {case.train_steps + 1} loss "
        f"{out['next_step']['loss']:.6f}, peak {out['next_step']['peak_bytes'] / 2**20:,.1f} MiB"
    )
    return out


def run_resume(
    case: BenchmarkCase, checkpoint_dir: Path, label: str, layout: ParallelLayout
) -> WorkerResult:
    """Resume phase of this rank (see module docstring)."""
    import torch

    from benchmarks.resume_benchmark.checkpoint import load_checkpoint
    from benchmarks.resume_benchmark.instance_loader import installed_instance_loaders
    from benchmarks.resume_benchmark.model import inner_optimizers

    who = _who(case, label)
    out, model_chunks, optimizer = _started("resume", case, label, layout)
    adopters = registered_adopter_names()  # loads plugin entry points before the measurement

    loaders_installed = installed_instance_loaders(
        case.instance_loader, inner_optimizers(optimizer)
    )
    with runtime.measured_peak() as load, loaders_installed as loaders:
        progress(f"{who}: loading checkpoint (baseline {load.baseline_bytes / 2**20:,.1f} MiB)")
        recorder = started_timeline(load.baseline_bytes)
        with recording_outcomes() as outcomes:
            on_phase = recorder.mark if isinstance(recorder, LoadTimeline) else None
            load_checkpoint(model_chunks, optimizer, case.sharding_format, checkpoint_dir, on_phase)
    out["memory_timeline"] = finished_timeline(recorder)
    gc.collect()
    baseline, peak, seconds = load.baseline_bytes, load.peak_bytes, load.seconds
    out["load"] = {
        "baseline_bytes": baseline,
        "peak_bytes": peak,
        "post_load_allocated_bytes": torch.cuda.memory_allocated(),
        "seconds": seconds,
    }
    out["state_adoption"] = {"adopters": adopters, "outcomes": outcomes}
    calls = None
    if loaders is not None:
        out["instance_loader"] = loaders.to_json()
        calls = out["instance_loader"]["calls"]
    fallback = fallback_text(out["state_adoption"])
    installed = installed_by_text(out["state_adoption"], calls)
    progress(
        f"{who}: state adopters registered: {adopters_text(adopters)}; state installed by: "
        f"{installed or 'not recorded (no outcome hooks)'}"
        + (f"; fallback: {fallback}" if fallback else "")
    )
    progress(
        f"{who}: loaded in {seconds:.2f} s; load peak {peak / 2**20:,.1f} MiB "
        f"(+{(peak - baseline) / 2**20:,.1f} MiB = "
        f"{(peak - baseline) / max(out['model']['optimizer_params'], 1):.2f} B/param "
        "over baseline); "
        "fingerprinting state"
    )
    out["restored_fingerprint"], gathered = _fingerprints(layout, model_chunks, optimizer)
    if gathered is not None:
        out["restored_gathered_fingerprint"] = gathered
    out["next_step"] = _next_step(case, model_chunks, optimizer)
    progress(
        f"{who}: resumed step {case.train_steps + 1} loss "
        f"{out['next_step']['loss']:.6f}, peak {out['next_step']['peak_bytes'] / 2**20:,.1f} MiB"
    )
    return out


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--phase", choices=("probe", "train", "resume"), required=True)
    parser.add_argument("--spec", type=Path, help="JSON: case, side label, checkpoint_dir")
    parser.add_argument(
        "--result",
        type=Path,
        required=True,
        help="JSON result NAME.json; rank r writes NAME.rank<r>.json",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Run one phase; see the module docstring for exit statuses."""
    args = _parse_args(argv)
    apply_determinism_env()
    result_path = rank_result_path(args.result, launched_rank()[0])
    if args.phase == "probe":
        write_json(result_path, probe())
        return 0
    if args.spec is None:
        raise SystemExit("--spec is required for the train and resume phases")
    spec = read_json(args.spec)
    case = BenchmarkCase.from_json(spec["case"])
    label = str(spec["side"])
    checkpoint_dir = Path(spec["checkpoint_dir"])
    layout = ParallelLayout.from_json(spec["parallel"])
    _configure_logging()
    status = 0
    try:
        if args.phase == "train":
            out = run_train(case, checkpoint_dir, label, layout)
        else:
            out = run_resume(case, checkpoint_dir, label, layout)
    except Exception as exc:  # noqa: BLE001 - recorded for the driver, reported by status 1
        traceback.print_exc(file=sys.stdout)
        out = {"phase": args.phase, "case": case.name, "side": label, "error": one_line(exc)}
        status = 1
    write_json(result_path, out)
    try:
        runtime.shutdown()
    except Exception:  # noqa: BLE001 - best effort at exit
        pass
    return status


if __name__ == "__main__":
    raise SystemExit(main())
