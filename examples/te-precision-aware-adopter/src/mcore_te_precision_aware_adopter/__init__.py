"""Opt-in optimizer-state adopter for TE FusedAdam under Megatron-Core's precision-aware optimizer."""

from .adopter import TEFusedAdamPrecisionAwareStateAdopter

__all__ = ["TEFusedAdamPrecisionAwareStateAdopter"]
