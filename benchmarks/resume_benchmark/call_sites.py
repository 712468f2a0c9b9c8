"""Resume measurements at Megatron-Core's other load call sites (issue #19).

Load paths besides the DistributedOptimizer's main branch (measured by the main benchmark):

* ``megatron_fsdp``: Megatron-FSDP (``optim_grads_params``), ``fsdp_dtensor`` read with
  ``torch.distributed.checkpoint``, the DTensor branch of ``DistributedOptimizer``;
* ``float16_wrapper``: BF16 model, ``Float16OptimizerWithFloat16Params``, ``torch_dist``;
* ``fp32_wrapper``: FP32 model, ``FP32Optimizer``;
* ``cpu_offload``: ``optimizer_cpu_offload`` (``HybridDeviceOptimizer``; host RSS measured too).

Each path trains, saves and runs a control step with upstream, then resumes with each side, all
in fresh processes, on the GPT of the main benchmark's ``--preset``. Usage::

    python -m benchmarks.resume_benchmark.call_sites --upstream SITE --build SITE \
        [--paths megatron_fsdp,float16_wrapper,fp32_wrapper,cpu_offload] [--preset small] \
        --work-dir DIR --json-out OUT.json --markdown-out OUT.md

A side is a directory put first on ``PYTHONPATH`` (it holds one ``megatron-core``).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import shutil
import subprocess
import sys
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Final

from benchmarks.resume_benchmark.cases import FP32_MOMENT_PAIR_BYTES, PRESETS, make_case
from benchmarks.resume_benchmark.results import recording_outcomes
from benchmarks.resume_benchmark.results import one_line, progress, read_json, write_json
from benchmarks.resume_benchmark.runtime import measured_peak

PATHS: Final[tuple[str, ...]] = ("megatron_fsdp", "float16_wrapper", "fp32_wrapper", "cpu_offload")
_SEED: Final = 1234
_TRAIN_STEPS: Final = 2


def _rss_bytes(field: str) -> int:
    """``VmRSS`` or ``VmHWM`` (peak) of this process from ``/proc/self/status``."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def _reset_rss_peak() -> bool:
    """Reset ``VmHWM`` to the current RSS (Linux ``clear_refs`` 5); False when not allowed."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def _build(path: str, preset: str) -> tuple[list[Any], Any]:
    """The GPT of ``preset`` wrapped and optimised as ``path`` requires."""
    import torch
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import get_megatron_optimizer
    from megatron.core.transformer.module import Float16Module

    from benchmarks.resume_benchmark import model as bench_model
    from benchmarks.resume_benchmark.launch import ParallelLayout
    from benchmarks.resume_benchmark.runtime import initialize_rank, seed_everything

    case = make_case("dp_reshardable", PRESETS[preset], seed=_SEED)
    initialize_rank(_SEED)
    seed_everything(_SEED)
    fp32_model = path == "fp32_wrapper"
    config = bench_model.transformer_config(case, ParallelLayout())
    if fp32_model:
        config = dataclasses.replace(config, bf16=False, params_dtype=torch.float32)
    gpt = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(),
        vocab_size=case.size.vocab_size,
        max_sequence_length=case.size.seq_length,
        parallel_output=True,
        share_embeddings_and_output_weights=False,
        position_embedding_type="learned_absolute",
    )
    gpt.cuda(torch.cuda.current_device())
    module: torch.nn.Module = gpt if fp32_model else Float16Module(config, gpt)
    distributed = path in ("megatron_fsdp", "cpu_offload")
    ddp_kwargs: dict[str, Any] = {}
    if path == "megatron_fsdp":
        ddp_kwargs = {
            "use_megatron_fsdp": True,
            "data_parallel_sharding_strategy": "optim_grads_params",
        }
    ddp_config = DistributedDataParallelConfig(
        use_distributed_optimizer=distributed,
        overlap_grad_reduce=False,
        overlap_param_gather=False,
        grad_reduce_in_fp32=False,
        **ddp_kwargs,
    )
    if path == "megatron_fsdp":
        from megatron.core.distributed.fsdp.mcore_fsdp_adapter import FullyShardedDataParallel

        wrapped: Any = FullyShardedDataParallel(config=config, ddp_config=ddp_config, module=module)
    else:
        wrapped = DistributedDataParallel(config=config, ddp_config=ddp_config, module=module)
    if path != "megatron_fsdp":  # one rank; Megatron-FSDP's DTensors have no broadcast rule
        wrapped.broadcast_params()
    opt_config = bench_model.optimizer_config(case)
    opt_config = dataclasses.replace(
        opt_config,
        use_distributed_optimizer=distributed,
        bf16=not fp32_model,
        params_dtype=torch.float32 if fp32_model else torch.bfloat16,
    )
    if path == "cpu_offload":
        opt_config = dataclasses.replace(
            opt_config,
            optimizer_cpu_offload=True,
            optimizer_offload_fraction=1.0,
            use_precision_aware_optimizer=True,
        )
    return [wrapped], get_megatron_optimizer(opt_config, [wrapped])


def _wrappers(optimizer: Any) -> Iterator[Any]:
    """The Megatron optimizers holding an inner optimizer, in chain order."""
    chained = getattr(optimizer, "chained_optimizers", None)
    if chained is None:
        yield optimizer
    else:
        for inner in chained:
            yield from _wrappers(inner)


def _local(tensor: Any) -> Any:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def _named_tensors(model_chunks: list[Any], optimizer: Any) -> Iterator[tuple[str, Any]]:
    for name, param in model_chunks[0].named_parameters():
        yield f"model.{name}", _local(param)
    for index, wrapper in enumerate(_wrappers(optimizer)):
        inner = wrapper.optimizer
        for g, group in enumerate(inner.param_groups):
            for p, param in enumerate(group["params"]):
                prefix = f"opt{index}.group{g}.param{p}"
                yield f"{prefix}.param", _local(param)
                state = inner.state.get(param, {})
                for key in sorted(state):
                    if hasattr(state[key], "shape"):
                        yield f"{prefix}.{key}", _local(state[key])


def _fingerprint(model_chunks: list[Any], optimizer: Any) -> dict[str, str]:
    import torch

    from benchmarks.resume_benchmark.fingerprint import fingerprint_tensors

    torch.cuda.synchronize()
    return fingerprint_tensors(_named_tensors(model_chunks, optimizer))


def _inner_elements(optimizer: Any) -> int:
    return sum(
        int(_local(p).numel())
        for w in _wrappers(optimizer)
        for g in w.optimizer.param_groups
        for p in g["params"]
    )


def _fsdp_state_dict(model_chunks: list[Any], optimizer: Any, is_loading: bool) -> dict[str, Any]:
    from megatron.core.distributed.fsdp.src.megatron_fsdp.uneven_dtensor import (
        preprocess_state_dict_for_uneven_dtensor,
    )

    model_sd = model_chunks[0].state_dict()
    metadata = {"distrib_optim_sharding_type": "fsdp_dtensor"}
    state_dict = {
        "model": model_sd,
        "optimizer": optimizer.sharded_state_dict(
            model_sd, is_loading=is_loading, metadata=metadata
        ),
    }
    preprocess_state_dict_for_uneven_dtensor(state_dict)
    return state_dict


def _save(path: str, model_chunks: list[Any], optimizer: Any, directory: Path) -> None:
    if path == "megatron_fsdp":
        from torch.distributed.checkpoint.state_dict_saver import save

        save(_fsdp_state_dict(model_chunks, optimizer, False), checkpoint_id=str(directory))
        return
    from benchmarks.resume_benchmark.checkpoint import save_checkpoint

    save_checkpoint(model_chunks, optimizer, "dp_reshardable", directory)


def _load(path: str, model_chunks: list[Any], optimizer: Any, directory: Path) -> None:
    if path == "megatron_fsdp":
        from torch.distributed.checkpoint.state_dict_loader import load

        state_dict = _fsdp_state_dict(model_chunks, optimizer, True)
        load(state_dict, checkpoint_id=str(directory))  # in place, model parameters included
        # As Megatron-LM does: the model's load_state_dict post-hook refreshes the compute
        # weights from the loaded main weights, which the load alone does not.
        model_chunks[0].load_state_dict(state_dict["model"], strict=False)
        optimizer.load_state_dict(state_dict["optimizer"])
        return
    from benchmarks.resume_benchmark.checkpoint import load_checkpoint

    load_checkpoint(model_chunks, optimizer, "dp_reshardable", directory)


def _step(model_chunks: list[Any], optimizer: Any, preset: str, step: int) -> dict[str, Any]:
    from benchmarks.resume_benchmark.model import train_step

    case = make_case("dp_reshardable", PRESETS[preset], seed=_SEED)
    with measured_peak() as peak:
        result = train_step(model_chunks, optimizer, case, step)
    return {
        "loss_hex": float(result.loss).hex(),
        "loss": result.loss,
        "peak_bytes": peak.peak_bytes,
    }


def run_phase(phase: str, path: str, preset: str, directory: Path) -> dict[str, Any]:
    """``train`` (train, save, control step) or ``resume`` (load, measure, next step)."""
    model_chunks, optimizer = _build(path, preset)
    out: dict[str, Any] = {
        "path": path,
        "wrapper": [type(w).__name__ for w in _wrappers(optimizer)],
        "inner": [type(w.optimizer).__name__ for w in _wrappers(optimizer)],
        "optimizer_elements": _inner_elements(optimizer),
    }
    if phase == "train":
        out["losses"] = [
            _step(model_chunks, optimizer, preset, s) for s in range(1, _TRAIN_STEPS + 1)
        ]
        _save(path, model_chunks, optimizer, directory)
        out["post_save_fingerprint"] = _fingerprint(model_chunks, optimizer)
    else:
        rss_baseline = _rss_bytes("VmRSS")
        rss_peak_reset = _reset_rss_peak()
        with measured_peak() as load, recording_outcomes() as outcomes:
            _load(path, model_chunks, optimizer, directory)
        out["load"] = {
            "seconds": load.seconds,
            "baseline_bytes": load.baseline_bytes,
            "peak_bytes": load.peak_bytes,
            "rss_baseline_bytes": rss_baseline,
            "rss_peak_bytes": _rss_bytes("VmHWM") if rss_peak_reset else None,
        }
        gc.collect()
        out["load"]["rss_after_bytes"] = _rss_bytes("VmRSS")
        out["outcomes"] = outcomes or []
        out["restored_fingerprint"] = _fingerprint(model_chunks, optimizer)
    out["next_step"] = _step(model_chunks, optimizer, preset, _TRAIN_STEPS + 1)
    out["next_step_fingerprint"] = _fingerprint(model_chunks, optimizer)
    return out


def _worker(argv: list[str]) -> int:
    phase, path, preset, directory, result = argv
    try:
        out = run_phase(phase, path, preset, Path(directory))
        status = 0
    except Exception as exc:  # noqa: BLE001 - recorded, reported by the status
        traceback.print_exc(file=sys.stdout)
        out, status = {"path": path, "error": one_line(exc)}, 1
    write_json(Path(result), out)
    return status


def _run_side(site: Path, argv: list[str], log: Path, timeout: float) -> None:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(site), env.get("PYTHONPATH", ""), os.getcwd()])
    env.pop("RANK", None)
    with log.open("w") as sink:
        subprocess.run(
            [sys.executable, "-m", "benchmarks.resume_benchmark.call_sites", "--worker", *argv],
            env=env,
            stdout=sink,
            stderr=subprocess.STDOUT,
            timeout=timeout,
            check=False,
        )


def _same(a: dict[str, str] | None, b: dict[str, str] | None) -> bool:
    return a is not None and a == b


def measure_path(
    path: str, preset: str, sides: dict[str, Path], work: Path, timeout: float
) -> dict[str, Any]:
    """Train with upstream, then resume with every side; the per-side rows of ``path``."""
    directory = work / path / "checkpoint"
    shutil.rmtree(work / path, ignore_errors=True)
    directory.mkdir(parents=True)
    phases: dict[str, dict[str, Any]] = {}
    for label, phase, site in [("train", "train", sides["upstream"])] + [
        (name, "resume", site) for name, site in sides.items()
    ]:
        result = work / path / f"{label}.json"
        progress(f"{path}: {label} ({phase}) with {site}")
        try:
            _run_side(
                site,
                [phase, path, preset, str(directory), str(result)],
                result.with_suffix(".log"),
                timeout,
            )
            phases[label] = read_json(result)
        except (OSError, ValueError, subprocess.TimeoutExpired) as exc:
            phases[label] = {"error": one_line(exc)}
        if "error" in phases[label]:
            progress(f"{path}: {label} failed: {phases[label]['error']}")
            if label == "train":
                break
    return phases


def summarise(path: str, phases: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per resumed side: load peak over baseline, saving, peaks, bitwise checks."""
    train = phases.get("train", {})
    upstream = phases.get("upstream", {})
    rows = [{"path": path, "side": "train", "error": train["error"]}] if "error" in train else []
    for side, result in phases.items():
        if side == "train":
            continue
        row: dict[str, Any] = {"path": path, "side": side, "error": result.get("error")}
        if row["error"] is None:
            load = result["load"]
            elements = result["optimizer_elements"]
            row |= {
                "wrapper": "+".join(result["wrapper"]),
                "inner": "+".join(result["inner"]),
                "optimizer_elements": elements,
                "load_over_baseline_b_per_param": (load["peak_bytes"] - load["baseline_bytes"])
                / elements,
                "load_peak_bytes": load["peak_bytes"],
                "next_step_peak_bytes": result["next_step"]["peak_bytes"],
                "rss_over_baseline_b_per_param": (
                    None
                    if load["rss_peak_bytes"] is None
                    else (load["rss_peak_bytes"] - load["rss_baseline_bytes"]) / elements
                ),
                "restored_equal": _same(
                    result["restored_fingerprint"], train["post_save_fingerprint"]
                ),
                "next_step_equal": _same(
                    result["next_step_fingerprint"], train["next_step_fingerprint"]
                )
                and result["next_step"]["loss_hex"] == train["next_step"]["loss_hex"],
                "adopters": sorted({o.get("adopter") or "-" for o in result.get("outcomes", [])}),
                "fallbacks": sorted(
                    {o.get("fallback_reason") or "" for o in result.get("outcomes", [])} - {""}
                ),
                "hook_points": sorted({o.get("hook_point") for o in result.get("outcomes", [])}),
            }
            if side != "upstream" and "next_step_fingerprint" in upstream:
                row["next_step_equals_upstream"] = (
                    _same(result["next_step_fingerprint"], upstream["next_step_fingerprint"])
                    and result["next_step"]["loss_hex"] == upstream["next_step"]["loss_hex"]
                )
            if side != "upstream" and "load" in upstream:
                up = upstream["load"]
                saving = (up["peak_bytes"] - up["baseline_bytes"]) - (
                    load["peak_bytes"] - load["baseline_bytes"]
                )
                row["saving_vs_8b"] = saving / (FP32_MOMENT_PAIR_BYTES * elements)
                if up["rss_peak_bytes"] is not None and load["rss_peak_bytes"] is not None:
                    rss_saving = (up["rss_peak_bytes"] - up["rss_baseline_bytes"]) - (
                        load["rss_peak_bytes"] - load["rss_baseline_bytes"]
                    )
                    row["rss_saving_vs_8b"] = rss_saving / (FP32_MOMENT_PAIR_BYTES * elements)
        rows.append(row)
    return rows


def _yes_no(value: bool | None) -> str:
    return "-" if value is None else ("yes" if value else "NO")


def markdown(rows: list[dict[str, Any]]) -> str:
    """The report table: one line per path and side."""
    lines = [
        "| path | side | optimizer | params on rank | GPU load over baseline | saving / (8 B x params) "
        "| load peak vs next step peak | host RSS over baseline | restored bitwise | next step bitwise "
        "| next step = upstream's | adopters (fallbacks) |",
        "|---|---|---|---:|---:|---:|---|---:|---|---|---|---|",
    ]
    for r in rows:
        if r["error"]:
            lines.append(f"| {r['path']} | {r['side']} | error: {r['error']} ||||||||||")
            continue
        mib = 2**20
        saving = f"{r['saving_vs_8b']:.4f}" if "saving_vs_8b" in r else "-"
        rss = (
            "-"
            if r["rss_over_baseline_b_per_param"] is None
            else f"{r['rss_over_baseline_b_per_param']:.2f} B/param"
        )
        if "rss_saving_vs_8b" in r:
            rss += f" (saving {r['rss_saving_vs_8b']:.4f})"
        lines.append(
            f"| {r['path']} | {r['side']} | {r['wrapper']} / {r['inner']} | {r['optimizer_elements']:,} "
            f"| {r['load_over_baseline_b_per_param']:.2f} B/param | {saving} "
            f"| {r['load_peak_bytes'] / mib:,.0f} vs {r['next_step_peak_bytes'] / mib:,.0f} MiB "
            f"| {rss} | {'yes' if r['restored_equal'] else 'NO'} | {'yes' if r['next_step_equal'] else 'NO'} "
            f"| {_yes_no(r.get('next_step_equals_upstream'))} "
            f"| {', '.join(r['adopters'])}{' (' + '; '.join(r['fallbacks']) + ')' if r['fallbacks'] else ''} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Driver (see the module docstring); ``--worker`` runs one phase in this process."""
    args_list = sys.argv[1:] if argv is None else argv
    if args_list[:1] == ["--worker"]:
        from benchmarks.resume_benchmark.runtime import apply_determinism_env

        apply_determinism_env()
        return _worker(args_list[1:])
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--upstream", type=Path, required=True)
    parser.add_argument("--build", type=Path, required=True)
    parser.add_argument("--paths", default=",".join(PATHS))
    parser.add_argument("--preset", default="small", choices=sorted(PRESETS))
    parser.add_argument("--work-dir", type=Path, required=True)
    parser.add_argument("--json-out", type=Path, required=True)
    parser.add_argument("--markdown-out", type=Path, required=True)
    parser.add_argument("--phase-timeout", type=float, default=300.0)
    args = parser.parse_args(args_list)
    sides = {"upstream": args.upstream.resolve(), "build": args.build.resolve()}
    rows: list[dict[str, Any]] = []
    raw: dict[str, Any] = {}
    for path in args.paths.split(","):
        if path not in PATHS:
            parser.error(f"unknown path {path!r}; expected some of {', '.join(PATHS)}")
        raw[path] = measure_path(path, args.preset, sides, args.work_dir, args.phase_timeout)
        rows.extend(summarise(path, raw[path]))
        shutil.rmtree(args.work_dir / path / "checkpoint", ignore_errors=True)
        args.markdown_out.write_text(markdown(rows))
    write_json(args.json_out, {"preset": args.preset, "rows": rows, "raw": raw})
    args.markdown_out.write_text(markdown(rows))
    print(markdown(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
