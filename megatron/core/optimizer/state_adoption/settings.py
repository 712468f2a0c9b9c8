"""Process-wide settings, read from the environment at every load (no restart needed).

* ``MCORE_DISABLE_OPTIMIZER_STATE_ADOPTION=1`` (or ``true``/``yes``/``on``): every load and
  export uses the inner optimizer's own ``load_state_dict``/``state_dict``.
* ``MCORE_DISABLED_OPTIMIZER_STATE_ADOPTERS=name[,name...]``: the named adopters are skipped
  (recorded as declines); the others are consulted as usual.
"""

import os
from typing import FrozenSet

__all__: list[str] = []

_DISABLE_ENV_VAR = "MCORE_DISABLE_OPTIMIZER_STATE_ADOPTION"
_DISABLED_ADOPTERS_ENV_VAR = "MCORE_DISABLED_OPTIMIZER_STATE_ADOPTERS"


def _adoption_switched_off() -> bool:
    """Return True if the kill switch ``MCORE_DISABLE_OPTIMIZER_STATE_ADOPTION`` is set."""
    return os.environ.get(_DISABLE_ENV_VAR, "").strip().lower() in ("1", "true", "yes", "on")


def _disabled_adopter_names() -> FrozenSet[str]:
    """Return the adopter names listed in ``MCORE_DISABLED_OPTIMIZER_STATE_ADOPTERS``."""
    listed = os.environ.get(_DISABLED_ADOPTERS_ENV_VAR, "")
    return frozenset(name.strip() for name in listed.split(",") if name.strip())
