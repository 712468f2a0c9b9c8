"""Skip marker for the GPU tests: real Transformer Engine and a CUDA GPU are required.

Where either is missing (CI has neither) the tests are reported as skipped, with the reason,
never as passed.
"""

from typing import Optional

import pytest
import torch


def _missing_gpu_requirement() -> Optional[str]:
    """Why the GPU tests cannot run here, or None if they can."""
    if not torch.cuda.is_available():
        return "needs a CUDA GPU (torch.cuda.is_available() is False)"
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception as error:  # TE raises more than ImportError when its libraries are absent
        return f"needs Transformer Engine ({type(error).__name__}: {error})"
    return None


MISSING_GPU_REQUIREMENT = _missing_gpu_requirement()

gpu_only = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        MISSING_GPU_REQUIREMENT is not None, reason=f"GPU test: {MISSING_GPU_REQUIREMENT}"
    ),
]
