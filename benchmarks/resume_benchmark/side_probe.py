"""What one side's interpreter imports: Python, torch, CUDA, GPU, driver, Transformer Engine and
``megatron-core`` (version, file, state-adoption presence), run with the side's ``PYTHONPATH``::

    python -m benchmarks.resume_benchmark.side_probe --result R.json   # writes R.rank0.json

Missing packages are recorded, never raised.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import platform
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.resume_benchmark.driver import rank_result_path
from benchmarks.resume_benchmark.results import has_outcome_hooks, one_line, write_json


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


def main(argv: Sequence[str] | None = None) -> int:
    """Write :func:`probe` to the rank-0 path of ``--result``."""
    parser = argparse.ArgumentParser(prog="side_probe", description=__doc__)
    parser.add_argument("--result", type=Path, required=True)
    args = parser.parse_args(argv)
    write_json(rank_result_path(args.result, 0), probe())
    return 0


if __name__ == "__main__":
    sys.exit(main())
