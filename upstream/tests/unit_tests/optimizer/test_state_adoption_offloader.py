# Copyright (c) 2026 NVIDIA CORPORATION & AFFILIATES. All rights reserved.

"""With a chunked optimizer-state offloader, the optimizers' ``load_state_dict`` is unchanged.

The offloader's ``load_state_dict_without_device_cast`` is part of the offload mechanism (it keeps
selected states in pinned CPU memory), so it must never be replaced by an adopter, switched off
or fallen back from. These tests pin that: with an offloader set, no adopter is consulted, no
outcome is reported, and the offloader receives what upstream handed it.
"""

import pytest

from tests.unit_tests.optimizer.test_state_adoption import (
    PyTorchLoaderAdopter,
    _moments,
    _trained_adam,
)
from tests.unit_tests.optimizer.test_state_adoption_roles import (  # noqa: F401 (fixtures)
    _bare_distributed_optimizer,
    _bare_float16_optimizer,
    outcomes,
    register,
)


def _outer_state_dict(inner):
    """The non-tensor state dict DistributedOptimizer.load_state_dict receives for ``inner``."""
    groups = [
        {k: v for k, v in g.items() if k != "params"} for g in inner.state_dict()["param_groups"]
    ]
    for group in groups:
        group["step"] = 2
    return {"optimizer": {"param_groups": groups}}


class RecordingOffloader:
    """Stands in for ``ChunkedOptimizerStateOffloader``; records what it is asked to load."""

    def __init__(self):
        self.loaded = []

    def load_state_dict_without_device_cast(self, state_dict):
        self.loaded.append(state_dict)


def _count_state_dict_calls(inner):
    calls = []
    own_state_dict = inner.state_dict

    def state_dict():
        calls.append(True)
        return own_state_dict()

    inner.state_dict = state_dict
    return calls


class TestStateAdoptionWithChunkedOffloader:
    @pytest.mark.parametrize("switch", [True, False])
    def test_offloader_loads_without_adoption(self, register, outcomes, switch):
        adopter = PyTorchLoaderAdopter("test_accepting")
        register(adopter)
        inner = _trained_adam(0)
        distributed = _bare_distributed_optimizer(inner, optimizer_state_adoption=switch)
        distributed._optimizer_state_offloader = RecordingOffloader()
        outer = _outer_state_dict(inner)
        moments = _moments(inner)
        state_dict_calls = _count_state_dict_calls(inner)

        distributed.load_state_dict(outer)

        assert adopter.checked == 0 and outcomes == []
        assert len(state_dict_calls) == 1
        (loaded,) = distributed._optimizer_state_offloader.loaded
        assert sorted(loaded) == ["param_groups", "state"]
        params = [p for g in inner.param_groups for p in g["params"]]
        for index, param in enumerate(params):
            for key in ("exp_avg", "exp_avg_sq"):
                assert loaded["state"][index][key] is inner.state[param][key]
        (group,) = loaded["param_groups"]
        assert group["params"] == list(range(len(params))) and group["step"] == 2
        assert all(a is b for a, b in zip(_moments(inner), moments))

    def test_float16_optimizer_offloader_loads_without_adoption(self, register, outcomes):
        adopter = PyTorchLoaderAdopter("test_accepting")
        register(adopter)
        owner = _bare_float16_optimizer(_trained_adam(0))
        owner._optimizer_state_offloader = RecordingOffloader()
        groups = owner.optimizer.param_groups
        main_params = [[p.detach().clone() for p in g["params"]] for g in groups]
        state_dict = {
            "optimizer": _trained_adam(1).state_dict(),
            "fp32_from_fp16_params": main_params,
        }

        owner.load_state_dict(state_dict)

        assert adopter.checked == 0 and outcomes == []
        assert owner._optimizer_state_offloader.loaded == [state_dict["optimizer"]]

    def test_without_offloader_the_registry_is_consulted(self, register, outcomes):
        adopter = PyTorchLoaderAdopter("test_accepting")
        register(adopter)
        distributed = _bare_distributed_optimizer(_trained_adam(0))
        distributed._optimizer_state_offloader = None

        distributed.load_state_dict(_outer_state_dict(distributed.optimizer))

        assert adopter.checked == 1
        assert [(o.hook_point, o.adopter) for o in outcomes] == [
            ("export", None),
            ("load", "test_accepting"),
        ]
