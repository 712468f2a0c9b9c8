"""Small real adopters and exporters used by the loader, registry and fail-safety tests."""

from typing import Any, Callable, Dict, List, Optional

import torch

from megatron.core.optimizer.state_adoption import StateAdoptionContext, StateExportContext


class PyTorchLoaderAdopter:
    """Accepts one optimizer class and installs the state with PyTorch's own loader.

    Records every context it was asked about and every adoption it made.
    """

    def __init__(self, name: str, optimizer_class: type = torch.optim.Optimizer) -> None:
        self.name = name
        self.optimizer_class = optimizer_class
        self.checked: List[StateAdoptionContext] = []
        self.adopted: List[StateAdoptionContext] = []

    def decline_reason(self, context: StateAdoptionContext) -> Optional[str]:
        self.checked.append(context)
        if not isinstance(context.optimizer, self.optimizer_class):
            return f"not a {self.optimizer_class.__name__}"
        return None

    def adopt(self, context: StateAdoptionContext) -> None:
        torch.optim.Optimizer.load_state_dict(context.optimizer, dict(context.state_dict))
        self.adopted.append(context)


class DecliningAdopter:
    """Always declines with a fixed reason."""

    def __init__(self, name: str, reason: str = "never adopts") -> None:
        self.name = name
        self.reason = reason
        self.checks = 0

    def decline_reason(self, context: StateAdoptionContext) -> Optional[str]:
        self.checks += 1
        return self.reason

    def adopt(self, context: StateAdoptionContext) -> None:
        raise AssertionError("adopt() called although decline_reason() declined")


class RaisingCheckAdopter(DecliningAdopter):
    """Its check raises."""

    def decline_reason(self, context: StateAdoptionContext) -> Optional[str]:
        raise RuntimeError("check exploded")


class GarbageCheckAdopter(DecliningAdopter):
    """Its check returns something that is neither None nor a reason."""

    def decline_reason(self, context: StateAdoptionContext) -> Any:
        return 42


class HalfInstallingAdopter:
    """Accepts, installs the first parameter's state and mutates a group, then raises."""

    def __init__(self, name: str = "half_installing", mutate_incoming: bool = False) -> None:
        self.name = name
        self.mutate_incoming = mutate_incoming

    def decline_reason(self, context: StateAdoptionContext) -> Optional[str]:
        return None

    def adopt(self, context: StateAdoptionContext) -> None:
        optimizer = context.optimizer
        first_param = optimizer.param_groups[0]["params"][0]
        first_id = context.state_dict["param_groups"][0]["params"][0]
        optimizer.state[first_param] = dict(context.state_dict["state"][first_id])
        optimizer.state[first_param]["bogus"] = torch.zeros(1)
        optimizer.param_groups[0]["lr"] = 999.0
        optimizer.param_groups[0]["params"].append(torch.zeros(1))
        optimizer.param_groups.append({"params": [], "lr": 1.0})
        if self.mutate_incoming:
            context.state_dict["state"].clear()  # type: ignore[attr-defined]
            context.state_dict["param_groups"][0]["params"].pop()
        raise RuntimeError("failed half-way")


class CopyingAdopter:
    """Accepts and installs copies of the incoming tensors (what PyTorch's loader would do if
    it stopped keeping them by reference): the loader must measure the allocation."""

    name = "copying"

    def decline_reason(self, context: StateAdoptionContext) -> Optional[str]:
        return None

    def adopt(self, context: StateAdoptionContext) -> None:
        copied = {
            key: {name: value.clone() for name, value in entry.items()}
            for key, entry in context.state_dict["state"].items()
        }
        state_dict = {"state": copied, "param_groups": context.state_dict["param_groups"]}
        torch.optim.Optimizer.load_state_dict(context.optimizer, state_dict)


class RaisingAfterLoaderAdopter(PyTorchLoaderAdopter):
    """Accepts, runs PyTorch's loader (its hooks included), then raises: the rollback and the
    fallback must not make the optimizer's hooks run a second time."""

    def adopt(self, context: StateAdoptionContext) -> None:
        super().adopt(context)
        raise RuntimeError("failed after PyTorch's loader")


class Exporter:
    """Declines every load; exports what ``export(optimizer)`` returns.

    Args:
        name (str): the adopter's name.
        export (Callable): builds the exported state dict from the optimizer.
        decline (str, optional): the reason ``export_decline_reason`` gives; None accepts.
    """

    def __init__(
        self,
        name: str,
        export: Callable[[torch.optim.Optimizer], Any],
        decline: Optional[str] = None,
    ) -> None:
        self.name = name
        self.export = export
        self.decline = decline
        self.checks = 0
        self.exports: List[Any] = []

    def decline_reason(self, context: StateAdoptionContext) -> Optional[str]:
        return "exports only"

    def adopt(self, context: StateAdoptionContext) -> None:
        raise AssertionError("adopt() called although decline_reason() declined")

    def export_decline_reason(self, context: StateExportContext) -> Optional[str]:
        self.checks += 1
        return self.decline

    def export_state_dict(self, context: StateExportContext) -> Dict[str, Any]:
        exported = self.export(context.optimizer)
        self.exports.append(exported)
        return exported  # type: ignore[no-any-return]


def pytorch_state_dict(optimizer: torch.optim.Optimizer) -> Dict[str, Any]:
    """PyTorch's state dict of ``optimizer``: its param groups and the held tensors themselves
    (what a correct exporter returns)."""
    return torch.optim.Optimizer.state_dict(optimizer)


class HeldMomentReadTargets(DecliningAdopter):
    """A read-target provider for the BF16 stand-in (and no adopter): the held moments
    themselves (the read casts FP32 into them as TE's ``set_scaled_state`` does), and the
    stand-in's own tensor for the rest. ``target_of`` may replace what it returns for one state
    name, to break the contract.
    """

    def __init__(self, name: str = "held_moments") -> None:
        super().__init__(name, "only supplies read targets")
        self.checked = 0
        self.target_of: Dict[str, Callable[[Any, torch.Tensor], Any]] = {}

    def read_target_decline_reason(self, context: StateExportContext) -> Optional[str]:
        self.checked += 1
        dtypes = getattr(context.optimizer, "name_to_dtype_map", {})
        if dtypes.get("exp_avg") is not torch.bfloat16:
            return "not BF16 moments"
        return None

    def read_target(self, context: StateExportContext, param: torch.Tensor, name: str) -> Any:
        optimizer: Any = context.optimizer
        if name in self.target_of:
            return self.target_of[name](optimizer, param)
        if name in ("exp_avg", "exp_avg_sq"):
            return optimizer.state[param][name]
        return optimizer.get_unscaled_state(param, name)
