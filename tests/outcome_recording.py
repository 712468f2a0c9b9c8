"""Record the state-adoption outcomes of a block of code (tests read them instead of logs)."""

from contextlib import contextmanager
from typing import Iterator, List, Optional

from megatron.core.optimizer.state_adoption import (
    StateAdopterRegistry,
    StateAdoptionOutcome,
    register_outcome_hook,
)


@contextmanager
def recorded_outcomes(
    registry: Optional[StateAdopterRegistry] = None,
) -> Iterator[List[StateAdoptionOutcome]]:
    """Yield a list that receives every outcome produced inside the ``with`` block.

    Args:
        registry (StateAdopterRegistry, optional): the registry whose outcomes to record;
            defaults to the process-wide one.
    """
    outcomes: List[StateAdoptionOutcome] = []
    register = register_outcome_hook if registry is None else registry.register_outcome_hook
    handle = register(outcomes.append)
    try:
        yield outcomes
    finally:
        handle.remove()


def loaded_by(outcomes: List[StateAdoptionOutcome]) -> List[object]:
    """Who installed the state at each load pass: an adopter's name or None (own loader)."""
    return [outcome.adopter for outcome in outcomes if outcome.hook_point == "load"]


def exported_by(outcomes: List[StateAdoptionOutcome]) -> List[object]:
    """Who supplied the state dict at each export: an adopter's name or None (own state_dict)."""
    return [outcome.adopter for outcome in outcomes if outcome.hook_point == "export"]
