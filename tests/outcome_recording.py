"""Record the state-adoption outcomes of a block of code (tests read them instead of logs)."""

from contextlib import contextmanager
from typing import Iterator, List, Optional

from megatron.core.optimizer.state_adoption import (
    AdoptionOutcome,
    StateAdopterRegistry,
    default_registry,
)


@contextmanager
def recorded_outcomes(
    registry: Optional[StateAdopterRegistry] = None,
) -> Iterator[List[AdoptionOutcome]]:
    """Yield a list that receives every outcome ``registry`` (default: the process-wide one)
    reports inside the ``with`` block."""
    outcomes: List[AdoptionOutcome] = []
    handle = (registry or default_registry()).register_outcome_hook(outcomes.append)
    try:
        yield outcomes
    finally:
        handle.remove()


def loaded_by(outcomes: List[AdoptionOutcome]) -> List[Optional[str]]:
    """Who installed the state at each load pass: an adopter's name or None (own loader)."""
    return [outcome.adopter for outcome in outcomes if outcome.hook_point == "load"]


def exported_by(outcomes: List[AdoptionOutcome]) -> List[Optional[str]]:
    """Who supplied the state dict at each export: an adopter's name or None (own state_dict)."""
    return [outcome.adopter for outcome in outcomes if outcome.hook_point == "export"]
