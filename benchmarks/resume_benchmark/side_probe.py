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
from typing import TypedDict

from benchmarks.resume_benchmark.driver import rank_result_path
from benchmarks.resume_benchmark.results import has_outcome_hooks, one_line, write_json


class CoreInfo(TypedDict, total=False):
    """The ``megatron.core`` a side imports (``error``: why it could not)."""

    version: str | None
    file: str | None
    site: str
    has_state_adoption: bool
    has_outcome_hooks: bool
    error: str | None


class PackageInfo(TypedDict):
    """An imported package: version and file, or the error of the import."""

    version: str | None
    file: str | None
    error: str | None


class SideProbe(TypedDict):
    """What :func:`probe` records."""

    python: str
    executable: str
    torch: str
    torch_cuda: str | None
    cuda_available: bool
    gpu_name: str | None
    driver: str | None
    transformer_engine: PackageInfo
    megatron_core: CoreInfo


def megatron_core_info() -> CoreInfo:
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
    return CoreInfo(
        version=version,
        file=str(core_file),
        site=str(site_dir),
        has_state_adoption=has_adoption,
        has_outcome_hooks=has_adoption and has_outcome_hooks(),
        error=None,
    )


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


def _transformer_engine() -> PackageInfo:
    try:
        import transformer_engine
        import transformer_engine.pytorch  # noqa: F401

        version = importlib.metadata.version("transformer_engine")
        return PackageInfo(
            version=version, file=str(Path(transformer_engine.__file__ or "").resolve()), error=None
        )
    except Exception as exc:  # noqa: BLE001 - reported, not raised
        return PackageInfo(version=None, file=None, error=one_line(exc))


def probe() -> SideProbe:
    """Environment report; never raises for a missing TE/megatron-core (it records the error)."""
    import torch  # before transformer_engine, which finds NCCL through torch

    try:
        core = megatron_core_info()
    except Exception as exc:  # noqa: BLE001 - reported, not raised
        core = CoreInfo(version=None, file=None, error=one_line(exc))
    cuda = torch.cuda.is_available()
    return SideProbe(
        python=platform.python_version(),
        executable=sys.executable,
        torch=torch.__version__,
        torch_cuda=torch.version.cuda,
        cuda_available=cuda,
        gpu_name=torch.cuda.get_device_name(0) if cuda else None,
        driver=_driver_version() if cuda else None,
        transformer_engine=_transformer_engine(),
        megatron_core=core,
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Write :func:`probe` to the rank-0 path of ``--result``."""
    parser = argparse.ArgumentParser(prog="side_probe", description=__doc__)
    parser.add_argument("--result", type=Path, required=True)
    args = parser.parse_args(argv)
    write_json(rank_result_path(args.result, 0), dict(probe()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
