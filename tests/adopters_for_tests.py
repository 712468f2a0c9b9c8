"""Small real adopters for the dispatcher, registry and fail-safety tests: each does one thing,
right or wrong, through the public ``StateAdopter`` interface."""

from typing import Any, Callable, Dict, List, Optional

import torch

from megatron.core.optimizer.state_adoption import AdoptionContext, StateAdopter


class PyTorchLoaderAdopter(StateAdopter):
    """Accepts one optimizer class (every role it is asked for) and installs the state with
    PyTorch's own loader; records what it was asked and did."""

    def __init__(self, name: str, optimizer_class: type = torch.optim.Optimizer) -> None:
        self._name = name
        self.optimizer_class = optimizer_class
        self.checked: List[AdoptionContext] = []
        self.adopted: List[AdoptionContext] = []

    @property
    def name(self) -> str:
        return self._name

    def decline_reason(self, context: AdoptionContext) -> Optional[str]:
        self.checked.append(context)
        if not isinstance(context.optimizer, self.optimizer_class):
            return f"not a {self.optimizer_class.__name__}"
        return None

    def adopt(self, context: AdoptionContext) -> None:
        assert context.state_dict is not None
        torch.optim.Optimizer.load_state_dict(context.optimizer, dict(context.state_dict))
        self.adopted.append(context)

    def export_decline_reason(self, context: AdoptionContext) -> Optional[str]:
        return self.decline_reason(context)

    def export_state_dict(self, context: AdoptionContext) -> Dict[str, Any]:
        exported: Dict[str, Any] = torch.optim.Optimizer.state_dict(context.optimizer)
        return exported

    def initialize_decline_reason(self, context: AdoptionContext) -> Optional[str]:
        return self.decline_reason(context)

    def initialize(self, context: AdoptionContext) -> None:
        """Zeroed moments of TE's dtypes (the stand-in's), else of the parameter's."""
        dtypes = getattr(context.optimizer, "name_to_dtype_map", {})
        for group in context.optimizer.param_groups:
            for param in group["params"]:
                context.optimizer.state[param] = {
                    key: torch.zeros_like(param, dtype=dtypes.get(key, param.dtype))
                    for key in ("exp_avg", "exp_avg_sq")
                }

    def read_target_decline_reason(self, context: AdoptionContext) -> Optional[str]:
        return self.decline_reason(context)

    def read_target(self, context: AdoptionContext, param: torch.Tensor, name: str) -> torch.Tensor:
        target: torch.Tensor = context.optimizer.state[param][name]
        return target


class DecliningAdopter(PyTorchLoaderAdopter):
    """Declines every role with a fixed reason and counts the questions."""

    def __init__(self, name: str, reason: str = "never adopts") -> None:
        super().__init__(name)
        self.reason = reason
        self.checks = 0

    def decline_reason(self, context: AdoptionContext) -> Optional[str]:
        self.checks += 1
        return self.reason

    def adopt(self, context: AdoptionContext) -> None:
        raise AssertionError("adopt() called although decline_reason() declined")


class RaisingCheckAdopter(DecliningAdopter):
    """Its checks raise."""

    def decline_reason(self, context: AdoptionContext) -> Optional[str]:
        raise RuntimeError("check exploded")


class GarbageCheckAdopter(DecliningAdopter):
    """Its checks return something that is neither None nor a reason."""

    def decline_reason(self, context: AdoptionContext) -> Any:
        return 42


class WritingCheckAdopter(DecliningAdopter):
    """Its checks zero the first held or incoming tensor they find (never allowed)."""

    def decline_reason(self, context: AdoptionContext) -> Optional[str]:
        state = context.state_dict["state"] if context.state_dict else context.optimizer.state
        next(iter(next(iter(state.values())).values())).zero_()
        return "declines after writing"


class ReplacingCheckAdopter(DecliningAdopter):
    """Its checks drop the optimizer's first state entry and a group key (containers only)."""

    def decline_reason(self, context: AdoptionContext) -> Optional[str]:
        state = context.optimizer.state
        if state:
            state.pop(next(iter(state)))
        context.optimizer.param_groups[0]["lr"] = 123.0
        return "declines after changing the containers"


class HalfInstallingAdopter(PyTorchLoaderAdopter):
    """Accepts, installs the first parameter's state and mutates a group, then raises."""

    def __init__(self, name: str = "half_installing", mutate_incoming: bool = False) -> None:
        super().__init__(name)
        self.mutate_incoming = mutate_incoming

    def decline_reason(self, context: AdoptionContext) -> Optional[str]:
        return None

    def adopt(self, context: AdoptionContext) -> None:
        optimizer, given = context.optimizer, context.state_dict
        assert given is not None
        first_param = optimizer.param_groups[0]["params"][0]
        optimizer.state[first_param] = dict(given["state"][given["param_groups"][0]["params"][0]])
        optimizer.state[first_param]["bogus"] = torch.zeros(1)
        optimizer.param_groups[0]["lr"] = 999.0
        optimizer.param_groups[0]["params"].append(torch.zeros(1))
        optimizer.param_groups.append({"params": [], "lr": 1.0})
        if self.mutate_incoming:
            given["state"].clear()  # type: ignore[attr-defined]
            given["param_groups"][0]["params"].pop()
        raise RuntimeError("failed half-way")


class CopyingAdopter(PyTorchLoaderAdopter):
    """Accepts and installs copies of the incoming tensors: measured as new memory."""

    def __init__(self, name: str = "copying") -> None:
        super().__init__(name)

    def decline_reason(self, context: AdoptionContext) -> Optional[str]:
        return None

    def adopt(self, context: AdoptionContext) -> None:
        assert context.state_dict is not None
        copied = {
            key: {name: value.clone() for name, value in entry.items()}
            for key, entry in context.state_dict["state"].items()
        }
        state_dict = {"state": copied, "param_groups": context.state_dict["param_groups"]}
        torch.optim.Optimizer.load_state_dict(context.optimizer, state_dict)


class RaisingAfterLoaderAdopter(PyTorchLoaderAdopter):
    """Accepts, runs PyTorch's loader, then raises."""

    def adopt(self, context: AdoptionContext) -> None:
        super().adopt(context)
        raise RuntimeError("failed after PyTorch's loader")


class Exporter(DecliningAdopter):
    """Declines loads; exports what ``export(optimizer)`` returns (``decline`` is its answer)."""

    def __init__(
        self, name: str, export: Callable[[Any], Any], decline: Optional[str] = None
    ) -> None:
        super().__init__(name, "exports only")
        self.export, self.decline = export, decline

    def export_decline_reason(self, context: AdoptionContext) -> Optional[str]:
        return self.decline

    def export_state_dict(self, context: AdoptionContext) -> Dict[str, Any]:
        exported: Dict[str, Any] = self.export(context.optimizer)
        return exported


def pytorch_state_dict(optimizer: torch.optim.Optimizer) -> Dict[str, Any]:
    """PyTorch's state dict of ``optimizer``: its groups and the held tensors themselves."""
    return torch.optim.Optimizer.state_dict(optimizer)


class ReadTargets(DecliningAdopter):
    """Supplies read targets (and nothing else): the held moments themselves and TE's own
    tensor for the rest, or what ``target_of[name](optimizer, param)`` returns."""

    def __init__(self, name: str = "read_targets") -> None:
        super().__init__(name, "only supplies read targets")
        self.target_of: Dict[str, Callable[[Any, torch.Tensor], Any]] = {}

    def read_target_decline_reason(self, context: AdoptionContext) -> Optional[str]:
        return None

    def read_target(self, context: AdoptionContext, param: torch.Tensor, name: str) -> Any:
        optimizer: Any = context.optimizer
        if name in self.target_of:
            return self.target_of[name](optimizer, param)
        if name in ("exp_avg", "exp_avg_sq"):
            return optimizer.state[param][name]
        return optimizer.get_unscaled_state(param, name)


class Initializer(PyTorchLoaderAdopter):
    """Initializes, and loads only a state dict the call site owns: the check an initialization
    must pass."""

    def __init__(self, name: str = "initializer") -> None:
        super().__init__(name)

    def decline_reason(self, context: AdoptionContext) -> Optional[str]:
        return None if context.owns_state_dict else "initializes only"

    def initialize_decline_reason(self, context: AdoptionContext) -> Optional[str]:
        return None
