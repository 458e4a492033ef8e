"""One lifecycle for hook state: options declared once (gradcomm.hooks.options), runtime rebuilt by
``reset_runtime``, checkpoints of the earlier format still loading. Single process, no ranks."""

import dataclasses
import inspect
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch

from gradcomm.compression import TopK
from gradcomm.hooks import registry
from gradcomm.hooks.auto_hook import AutoHookState
from gradcomm.hooks.compression_hook import CompressionState
from gradcomm.hooks.fingerprint import describe_state
from gradcomm.hooks.hierarchical_hook import HierarchicalState
from gradcomm.hooks.hook_specs import HookSpec, Option, options_of
from gradcomm.hooks.hook_state import HookState
from gradcomm.hooks.options import PowerSGDOptions, conversion_type, saved_option_names
from gradcomm.hooks.post_localSGD_hook import PostLocalSGDState
from gradcomm.hooks.powerSGD_hook import PowerSGDState, powerSGD_hook
from gradcomm.hooks.protocols import (
    Checkpointable,
    DeclaresReplicasMayDiffer,
    Fingerprinted,
    ReportsCommStats,
)

V1 = Path(__file__).parent / "data" / "hook_states_v1.pt"

# what a registry entry takes beside its state's options: names of other hooks, groups
NOT_OPTIONS = {"post_localsgd": {"subgroup"}, "hierarchical": {"inner", "inner_wrapper"}}


def _stateful_specs() -> list[HookSpec]:
    return [member.value for member in registry.CommHookType if member.value.options_class is not None]


def test_every_stateful_torch_hook_declares_its_options_once() -> None:
    names = {spec.name for spec in _stateful_specs()}
    assert {"powersgd", "batched_powersgd", "post_localsgd", "hierarchical", "auto"} <= names, names


@pytest.mark.parametrize("spec", _stateful_specs(), ids=lambda spec: spec.name)
def test_registry_options_are_the_dataclass_fields(spec: HookSpec) -> None:
    fields = [f.name for f in dataclasses.fields(spec.options_class)]
    extra = NOT_OPTIONS.get(spec.name, set())
    assert [name for name in spec.option_names if name not in extra] == fields
    assert set(spec.option_names) - set(fields) == extra
    for option in spec.options:
        if option.name in fields:
            field = next(f for f in dataclasses.fields(spec.options_class) if f.name == option.name)
            assert option.type is conversion_type(spec.options_class, option.name)
            assert option.required == (field.default is dataclasses.MISSING)


@pytest.mark.parametrize("spec", _stateful_specs(), ids=lambda spec: spec.name)
def test_the_state_built_by_name_is_the_one_declaring_the_options(spec: HookSpec) -> None:
    options = {"start_localSGD_iter": 2, "post_local_gradient_allreduce": False} if spec.name == "post_localsgd" else {}
    _, state = registry.make_comm_hook(spec.name, **options)
    assert isinstance(state, HookState) and type(state).options_class is spec.options_class
    assert isinstance(state.options(), spec.options_class)
    constructor = inspect.signature(type(state).__init__).parameters
    assert {f.name for f in dataclasses.fields(spec.options_class)} <= set(constructor)


def test_constructor_signatures_follow_the_options() -> None:
    parameters = inspect.signature(PowerSGDState.__init__).parameters
    assert list(parameters)[2:] == [f.name for f in dataclasses.fields(PowerSGDOptions)]
    assert list(inspect.signature(PostLocalSGDState.__init__).parameters) == [
        "self", "process_group", "subgroup", "start_localSGD_iter", "post_local_gradient_allreduce"
    ]
    assert PowerSGDState(None, 3, 7).options() == PowerSGDOptions(3, 7)
    with pytest.raises(TypeError, match=r"PowerSGDState: .*'rank'; its options are matrix_approximation_rank, "):
        PowerSGDState(None, rank=3)
    with pytest.raises(TypeError, match="PostLocalSGDState: .*start_localSGD_iter"):
        PostLocalSGDState(None, None)


# -- adding an option is one edit ---------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class _ExtendedOptions(PowerSGDOptions):
    power_iterations: int = 1  # the one edit: a field


class _ExtendedState(PowerSGDState):
    options_class = _ExtendedOptions


def test_an_option_added_to_the_dataclass_reaches_everything() -> None:
    state = _ExtendedState(None, start_powerSGD_iter=5, power_iterations=3)
    assert state.power_iterations == 3 and state.options().power_iterations == 3
    assert "power_iterations=3" in describe_state(state)  # the ranks compare it
    assert state.state_dict()["power_iterations"] == 3  # it is saved
    loaded = _ExtendedState(None, start_powerSGD_iter=5)
    loaded.load_state_dict(state.state_dict())
    assert loaded.power_iterations == 3
    assert pickle.loads(pickle.dumps(state)).power_iterations == 3
    older = _ExtendedState(None, start_powerSGD_iter=5, power_iterations=2)  # a checkpoint from before the option
    older.load_state_dict(PowerSGDState(None, start_powerSGD_iter=5).state_dict())
    assert older.power_iterations == 2
    unpickled = _ExtendedState.__new__(_ExtendedState)
    unpickled.__setstate__(PowerSGDState(None, start_powerSGD_iter=5).__getstate__())
    assert unpickled.power_iterations == 1  # its default
    spec = HookSpec("extended", "powerSGD_hook", "powerSGD_hook", options=options_of(_ExtendedOptions))
    assert Option("power_iterations", int) in spec.options
    assert registry._check_options(spec, {"power_iterations": "4"}) == {"power_iterations": 4}


def test_an_option_that_sets_up_saved_state_is_not_saved_itself() -> None:
    assert "random_seed" not in saved_option_names(PowerSGDOptions)
    state = PowerSGDState(None, random_seed=9)
    assert state.random_seed == 9 and "random_seed" not in state.state_dict()


# -- runtime ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "make",
    [
        lambda: PowerSGDState(None, start_powerSGD_iter=5),
        lambda: HierarchicalState(powerSGD_hook, PowerSGDState(None), 2),
        lambda: AutoHookState(candidates="allreduce+fp16_compress"),
        lambda: CompressionState(TopK(ratio=0.01)),
    ],
    ids=["powersgd", "hierarchical", "auto", "compression"],
)
def test_the_runtime_is_never_saved_and_rebuilt_on_unpickling(make) -> None:
    state = make()
    assert "_runtime" not in state.state_dict() and "_runtime" not in state.__getstate__()
    unpickled = pickle.loads(pickle.dumps(state))
    assert unpickled._runtime is not None and unpickled._runtime is not state._runtime


def test_loading_in_place_rebuilds_caches_and_keeps_groups_and_launchers() -> None:
    powersgd = PowerSGDState(None, start_powerSGD_iter=5)
    runtime = powersgd._runtime
    runtime.buckets[("w",)] = object()
    powersgd.load_state_dict(powersgd.state_dict())
    assert powersgd._runtime.buckets == {} and powersgd._runtime.check is not None
    assert powersgd._runtime.launcher is runtime.launcher
    hierarchical = HierarchicalState(powerSGD_hook, PowerSGDState(None), 2)
    groups = hierarchical._runtime
    hierarchical.load_state_dict(hierarchical.state_dict())
    assert hierarchical._runtime is groups
    compression = CompressionState(TopK(ratio=0.01))
    runtime = compression._runtime
    runtime.plans[("w",)] = object()
    compression.memory.load_state_dict({"w": torch.zeros(4)})
    compression.load_state_dict(compression.state_dict())
    assert compression._runtime.plans == {} and compression._runtime.check is not None
    assert compression._runtime.launcher is runtime.launcher


# -- checkpoints of the earlier format --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def v1() -> dict:
    return torch.load(V1, weights_only=False)


def _check_powersgd(state: PowerSGDState) -> None:
    assert state.options() == PowerSGDOptions(2, 10, random_seed=state.random_seed)
    assert torch.equal(state.error_dict["layer.weight"], torch.arange(6.0).view(2, 3))
    assert state.parameter_shapes == {"layer.weight": (2, 3)} and state.bucket_layout == [("layer.weight",)]
    assert (state.iter, state.total_numel_before_compression, state.total_numel_after_compression) == (12, 60, 25)
    reference = np.random.RandomState(5)
    reference.randn(7)
    assert np.array_equal(state.rng.randn(3), reference.randn(3))
    assert state._runtime.check is not None  # checked against the model at its first compressed step


def test_v1_powersgd_checkpoints_load(v1: dict) -> None:
    _check_powersgd(v1["pickled"]["powersgd"])
    fresh = PowerSGDState(None)
    fresh.load_state_dict(v1["state_dicts"]["powersgd"])
    _check_powersgd(fresh)


def test_v1_post_localsgd_auto_and_hierarchical_checkpoints_load(v1: dict) -> None:
    post = v1["pickled"]["post_localsgd"]
    assert (post.start_localSGD_iter, post.post_local_gradient_allreduce, post.iter, post.subgroup) == (4, False, 3, None)
    fresh_post = PostLocalSGDState(None, None, 1)
    fresh_post.load_state_dict(v1["state_dicts"]["post_localsgd"])
    assert (fresh_post.start_localSGD_iter, fresh_post.iter) == (4, 3)
    auto = v1["pickled"]["auto"]
    assert (auto.candidates, auto.error_bound, auto.trial_steps) == ("allreduce+fp16_compress", 0.2, 2)
    fresh_auto = AutoHookState(candidates="allreduce+fp16_compress")
    fresh_auto.load_state_dict(v1["state_dicts"]["auto"])
    assert fresh_auto.trialing and fresh_auto.step == 0
    hierarchical = v1["pickled"]["hierarchical"]
    assert hierarchical.ranks_per_node == 2 and hierarchical.inner_state.matrix_approximation_rank == 4
    fresh_hierarchical = HierarchicalState(powerSGD_hook, PowerSGDState(None, 4, 20), 2)
    fresh_hierarchical.load_state_dict(v1["state_dicts"]["hierarchical"])
    assert fresh_hierarchical.inner_state.start_powerSGD_iter == 20


def test_state_dict_keys_are_those_of_v1(v1: dict) -> None:
    for name, saved in v1["state_dicts"].items():
        state = v1["pickled"][name]
        assert set(state.state_dict()) == set(saved), name


# -- the extension points -----------------------------------------------------------------------------------------
def test_the_protocols_describe_the_hooks_and_states() -> None:
    from gradcomm.hooks.debugging_hooks import noop_hook
    from gradcomm.hooks.default_hooks import allreduce_hook
    from gradcomm.hooks.post_localSGD_hook import post_localSGD_hook

    assert isinstance(post_localSGD_hook, DeclaresReplicasMayDiffer) and isinstance(noop_hook, DeclaresReplicasMayDiffer)
    assert not isinstance(allreduce_hook, DeclaresReplicasMayDiffer)
    auto = AutoHookState(candidates="allreduce")
    assert isinstance(auto, Fingerprinted) and isinstance(auto, ReportsCommStats) and isinstance(auto, Checkpointable)
    assert "error_bound=0.1" in auto.comm_hook_fingerprint()
    assert isinstance(PowerSGDState(None), Checkpointable) and not isinstance(PowerSGDState(None), ReportsCommStats)
