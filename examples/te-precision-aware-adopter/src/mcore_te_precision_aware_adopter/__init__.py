"""Opt-in optimizer-state adopter for TE FusedAdam under Megatron-Core's precision-aware optimizer.

It needs a megatron-core build with the state-adoption subsystem
(``megatron.core.optimizer.state_adoption``, e.g. ``megatron-core 0.19.2+stateadoption``).
Plain upstream megatron-core has none and would never load the entry point, so importing this
package there raises an ``ImportError`` that says so, rather than doing nothing silently.
"""

import importlib.util
from importlib.metadata import PackageNotFoundError, version

_SUBSYSTEM = "megatron.core.optimizer.state_adoption"


def _installed_megatron_core() -> str:
    """Describe the installed megatron-core distribution and the imported one, for the error."""
    try:
        installed = f"megatron-core {version('megatron-core')} is installed"
    except PackageNotFoundError:
        installed = "no megatron-core distribution is installed"
    has_megatron = importlib.util.find_spec("megatron") is not None
    spec = importlib.util.find_spec("megatron.core") if has_megatron else None
    imported = f"megatron.core from {spec.origin}" if spec and spec.origin else "no megatron.core"
    return f"{installed}; {imported}"


def _require_state_adoption() -> None:
    """Raise ImportError unless the state-adoption subsystem can be imported."""
    try:
        found = importlib.util.find_spec(_SUBSYSTEM) is not None
    except ModuleNotFoundError:  # a parent package (megatron.core.optimizer) is missing
        found = False
    if not found:
        raise ImportError(
            f"mcore-te-precision-aware-adopter needs {_SUBSYSTEM}, which the imported "
            f"megatron-core does not have ({_installed_megatron_core()}): plain "
            "upstream megatron-core never loads this plugin. Install the megatron-core build "
            "this plugin pins (X+stateadoption, see its README), or uninstall the plugin.",
            name=__name__,
        )


_require_state_adoption()

from .adopter import TEFusedAdamPrecisionAwareStateAdopter  # noqa: E402

__all__ = ["TEFusedAdamPrecisionAwareStateAdopter"]
