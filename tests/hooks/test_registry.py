"""The hook registry: names, torch's names, option checking, and every hook registering and training.

The unit tests need no process group. The training test spawns one group per (DDP kind, world size) that
registers every hook by name in turn and trains a few steps; each hook then has its own test case, which
fails with the import error if the hook's module is missing.
"""

import importlib
import inspect
import traceback

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import DDPCommHookType

from gradcomm.compression.registry import methods
from gradcomm.hooks.post_localSGD_hook import PostLocalSGDState, post_localSGD_hook
from gradcomm.hooks.registry import (
    CommHookType,
    apply_option_defaults,
    check_options,
    get_hook,
    hook_names,
    make_comm_hook,
    register_comm_hook_by_name,
    resolve_hook_name,
)
from gradcomm.testing import RankError, run_on_ranks
from tests.support.models import mlp
from tests.support.ranks import DDP_KINDS, make_ddp
from tests.support.training import flat_parameters

TORCH_NAMES = {
    "ALLREDUCE": "allreduce",
    "FP16_COMPRESS": "fp16_compress",
    "BF16_COMPRESS": "bf16_compress",
    "QUANTIZE_PER_TENSOR": "quantize_per_tensor",
    "QUANTIZE_PER_CHANNEL": "quantize_per_channel",
    "POWER_SGD": "powersgd",
    "POWER_SGD_RANK2": "powersgd_rank2",
    "BATCHED_POWER_SGD": "batched_powersgd",
    "BATCHED_POWER_SGD_RANK2": "batched_powersgd_rank2",
    "NOOP": "noop",
}

# case -> (name, options, wrapper); option values as strings where a command line would give strings.
# Every registered compression method has a case of its own, COMPRESSION_CASES' or the generic one below.
COMPRESSION_METHODS = methods()
COMPRESSION_CASES = {
    "topk": ("topk", {"ratio": "0.05", "min_numel": 16}, None),
    "randomk": ("randomk", {"ratio": 0.05, "min_numel": 16}, None),
    "qsgd": ("QSGD", {"levels": 3, "min_numel": 16}, None),
    "onebit": ("one-bit", {"min_numel": 16, "error_feedback": "true"}, None),
}
TRAIN_CASES = {
    "allreduce": ("allreduce", {}, None),
    "fp16_compress": ("fp16_compress", {}, None),
    "bf16_compress": ("bf16_compress", {}, None),
    "quantize_per_tensor": ("quantize_per_tensor", {}, None),
    "quantize_per_channel": ("quantize_per_channel", {}, None),
    "powersgd": ("powersgd", {"start_powerSGD_iter": 2, "matrix_approximation_rank": 2}, None),
    "powersgd_rank2": ("powersgd_rank2", {"start_powerSGD_iter": "2"}, None),
    "batched_powersgd": ("batched_powersgd", {"start_powerSGD_iter": 2}, None),
    "batched_powersgd_rank2": ("BATCHED_POWER_SGD_RANK2", {"start_powerSGD_iter": 2}, None),
    "noop": ("noop", {}, None),
    "allgather": ("allgather", {}, None),
    "post_localsgd": ("post_localsgd", {"start_localSGD_iter": "1"}, None),
    # one rank per node, so that the inner hook runs (nodes of several ranks: tests/hooks/test_hierarchical_hook.py)
    "hierarchical": ("hierarchical", {"inner": "powersgd", "ranks_per_node": "1", "start_powerSGD_iter": "2"}, None),
    "auto": ("auto", {"trial_steps": "1", "candidates": "allreduce+fp16_compress"}, None),
    **{name: COMPRESSION_CASES.get(name, (name, {"min_numel": 16}, None)) for name in COMPRESSION_METHODS},
    "powersgd+fp16": ("powersgd", {"start_powerSGD_iter": 2}, "fp16"),
    "allreduce+bf16": ("allreduce", {}, "bf16"),
}
STEPS = 3


def _model() -> torch.nn.Module:
    return mlp(6, 16, 3)



def _train(kind: str, case: tuple | None) -> dict:
    rank = dist.get_rank()
    ddp = make_ddp(kind, _model())
    state_type = None
    if case is not None:
        name, options, wrapper = case
        state = register_comm_hook_by_name(ddp, name, wrapper=wrapper, **options)
        state_type = type(state).__name__
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
    losses = []
    for step in range(STEPS):
        generator = torch.Generator().manual_seed(1000 * rank + step)
        x, y = torch.randn(8, 6, generator=generator), torch.randn(8, 3, generator=generator)
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return {"losses": losses, "params": flat_parameters(ddp), "state_type": state_type}


def _rank_train_every_hook(kind: str) -> dict:
    results = {"builtin": _train(kind, None)}
    for case, spec in TRAIN_CASES.items():
        try:
            results[case] = _train(kind, spec)
        except Exception as exc:
            results[case] = {"error": f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"}
    return results


_SPAWNED: dict[tuple[str, int], list[dict] | RankError] = {}


def _trained(kind: str, world_size: int) -> list[dict]:
    """The spawned group's results, run once per (kind, world size); a failed run is not repeated per case."""
    if (kind, world_size) not in _SPAWNED:
        try:
            _SPAWNED[kind, world_size] = run_on_ranks(_rank_train_every_hook, world_size, args=(kind,), timeout=150)
        except RankError as exc:
            _SPAWNED[kind, world_size] = exc
    outcome = _SPAWNED[kind, world_size]
    if isinstance(outcome, RankError):
        raise outcome
    return outcome


def test_every_name_has_a_training_case():
    assert set(hook_names()) <= {resolve_hook_name(name).value.name for name, _, _ in TRAIN_CASES.values()}


# One spawned group per DDP kind (two cores are shared); both world sizes are covered.
KIND_WORLD_SIZES = [(kind, 2 if kind == "torch" else 3) for kind in DDP_KINDS]


@pytest.mark.timeout(160)
@pytest.mark.parametrize("case", list(TRAIN_CASES))
@pytest.mark.parametrize(
    "kind, world_size",
    [pytest.param(kind, n, id=kind, marks=pytest.mark.slow if n > 2 else ()) for kind, n in KIND_WORLD_SIZES],
)
def test_every_hook_registers_by_name_and_trains(kind, world_size, case):
    by_rank = [ranks[case] for ranks in _trained(kind, world_size)]
    for rank, result in enumerate(by_rank):
        assert "error" not in result, f"{case!r} failed on rank {rank}:\n{result['error']}"
    initial = flat_parameters(_model())
    for result in by_rank:
        assert np.isfinite(result["losses"]).all() and np.isfinite(result["params"]).all()
        assert not np.array_equal(result["params"], initial)
    same = all(np.array_equal(by_rank[0]["params"], r["params"]) for r in by_rank[1:])
    if case == "noop":
        assert not same, "noop exchanged gradients"
    else:
        assert same, f"{case}: ranks disagree after {STEPS} steps"
    name = TRAIN_CASES[case][0]
    expected_state = {
        "powersgd": "PowerSGDState",
        "post_localsgd": "PostLocalSGDState",
        "hierarchical": "HierarchicalState",
    }
    expected_state.update(dict.fromkeys(COMPRESSION_METHODS, "CompressionState"))
    expected_state["auto"] = "AutoHookState"
    kind_of_state = resolve_hook_name(name).value.name.removeprefix("batched_").removesuffix("_rank2")
    assert by_rank[0]["state_type"] == expected_state.get(kind_of_state, "NoneType")
    if case in ("allreduce", "post_localsgd"):  # exact averaging: like DDP without a hook
        builtin = [ranks["builtin"] for ranks in _trained(kind, world_size)]
        for result, reference in zip(by_rank, builtin, strict=True):
            np.testing.assert_allclose(result["params"], reference["params"], rtol=1e-5, atol=1e-6)


# -- no process group needed ----------------------------------------------------------------------------


def test_names_are_lower_case_and_unique():
    names = hook_names()
    assert names == [n.lower() for n in names] and len(set(names)) == len(names)
    assert {"allreduce", "powersgd", "batched_powersgd", "noop", "allgather", "post_localsgd"} <= set(names)
    assert CommHookType.POWERSGD.value.name == "powersgd"


@pytest.mark.parametrize("torch_member", list(DDPCommHookType), ids=lambda m: m.name)
def test_torch_ddp_comm_hook_type_names_select_the_same_hooks(torch_member):
    expected = TORCH_NAMES[torch_member.name]
    for name in (torch_member, torch_member.name, torch_member.name.lower(), torch_member.name.replace("_", "-")):
        assert resolve_hook_name(name).value.name == expected
    spec = resolve_hook_name(torch_member).value
    torch_wrapper = torch_member.value
    assert torch_wrapper.keywords["comm_hook"].__name__ == spec.hook
    torch_rank = torch_wrapper.keywords.get("matrix_approximation_rank", 1)
    assert dict(spec.presets).get("matrix_approximation_rank", 1) == torch_rank


def test_unknown_name_lists_the_valid_names():
    with pytest.raises(ValueError, match="unknown communication hook 'warp_drive'; valid names: allreduce, ") as info:
        register_comm_hook_by_name(_FakeModel(), "warp_drive")
    for name in hook_names():
        assert name in str(info.value)


def test_unknown_options_name_the_hook_and_its_valid_options():
    with pytest.raises(ValueError, match=r"hook 'allreduce' got unknown option\(s\) 'rank'; it takes no options"):
        make_comm_hook("allreduce", rank=4)
    with pytest.raises(
        ValueError,
        match=r"hook 'powersgd' got unknown option\(s\) 'rank', 'seed'; valid options: matrix_approximation_rank, "
        r"start_powerSGD_iter, .*batch_tensors_with_same_shape",
    ):
        make_comm_hook("POWER_SGD", rank=4, seed=1)
    with pytest.raises(ValueError, match=r"'powersgd_rank2' fixes matrix_approximation_rank=2"):
        make_comm_hook("powersgd_rank2", matrix_approximation_rank=4)
    with pytest.raises(ValueError, match=r"'post_localsgd' requires option\(s\) start_localSGD_iter"):
        make_comm_hook("post_localsgd")
    with pytest.raises(ValueError, match=r"option 'start_localSGD_iter' expects int, got 'ten'"):
        make_comm_hook("post_localsgd", start_localSGD_iter="ten")
    with pytest.raises(ValueError, match=r"option 'post_local_gradient_allreduce' expects bool, got 'maybe'"):
        make_comm_hook("post_localsgd", start_localSGD_iter=1, post_local_gradient_allreduce="maybe")
    with pytest.raises(ValueError, match="unknown hook wrapper 'fp8'; valid wrappers: fp16, bf16"):
        make_comm_hook("post_localsgd", wrapper="fp8", start_localSGD_iter=1, post_local_gradient_allreduce=False)


# (hook, options as a command line gives them, what the state's constructor says); see test below.
BAD_VALUES = [
    ("powersgd", {"matrix_approximation_rank": "-1"}, r"PowerSGDState: matrix_approximation_rank must be at least 1, got -1"),
    (
        "batched_powersgd",
        {"start_powerSGD_iter": "-1", "use_error_feedback": "no", "warm_start": "no"},
        r"PowerSGDState: start_powerSGD_iter must be at least 0, got -1",
    ),
    ("powersgd", {"min_compression_rate": "-0.5"}, r"PowerSGDState: min_compression_rate must be a number >= 0"),
    ("powersgd", {"orthogonalization_epsilon": "nan"}, r"orthogonalization_epsilon must be a finite number >= 0"),
    ("powersgd", {"random_seed": "-1"}, r"PowerSGDState: random_seed must be in 0\.\.2\*\*32-1"),
    ("powersgd", {"compression_stats_logging_frequency": "-5"}, r"compression_stats_logging_frequency must be >= 0"),
    ("topk", {"ratio": "2"}, r"TopK: ratio must be in \(0, 1\], got 2\.0"),
    ("topk", {"ratio": "nan"}, r"TopK: ratio must be in \(0, 1\], got nan"),
    ("randomk", {"ratio": "0"}, r"RandomK: ratio must be in \(0, 1\], got 0\.0"),
    ("qsgd", {"levels": "-3"}, r"QSGD: levels must be in 1\.\.127"),
    ("qsgd", {"bucket_size": "-1"}, r"QSGD: bucket_size must be at least 1, got -1"),
    ("terngrad", {"clip": "-1"}, r"TernGrad: clip must be a number > 0"),
    ("terngrad", {"clip": "nan"}, r"TernGrad: clip must be a number > 0"),
    ("efsign", {"min_numel": "-1"}, r"CompressionState: min_numel must be at least 0, got -1"),
    ("signsgd", {"min_compression_rate": "-2"}, r"CompressionState: min_compression_rate must be a number >= 0"),
    ("signsgd", {"error_feedback": "yes"}, r"SignSGD does not support error feedback"),
    ("post_localsgd", {"start_localSGD_iter": "-1"}, r"PostLocalSGDState: start_localSGD_iter must be >= 0, got -1"),
]


@pytest.mark.parametrize(("name", "options", "message"), BAD_VALUES, ids=lambda v: str(v)[:40])
def test_option_values_are_refused_by_the_constructor_before_any_process_group(name, options, message):
    """check_options (what a launcher calls before starting ranks) and make_comm_hook say the same."""
    assert not dist.is_initialized()
    expected = rf"^communication hook '{name}': .*{message}"
    with pytest.raises(ValueError, match=expected) as checked:
        check_options(name, **options)
    with pytest.raises(ValueError, match=expected) as made:
        make_comm_hook(name, **options)
    assert str(checked.value) == str(made.value)
    with pytest.raises(ValueError, match=expected):
        register_comm_hook_by_name(_FakeModel(), name, **options)


def test_option_types_the_constructor_refuses_are_type_errors_naming_the_hook():
    with pytest.raises(TypeError, match=r"^communication hook 'powersgd': PowerSGDState: matrix_approximation_rank "
                       r"must be an integer, got 1\.5"):
        make_comm_hook("powersgd", matrix_approximation_rank=1.5)
    with pytest.raises(TypeError, match=r"^communication hook 'post_localsgd': PostLocalSGDState: subgroup must be "
                       r"a ProcessGroup or None"):
        check_options("post_localsgd", start_localSGD_iter="1", subgroup="intra-node")


def test_check_options_builds_no_process_group_and_converts():
    """Valid values pass without a process group, post_localsgd's intra-node subgroups included."""
    assert not dist.is_initialized()
    assert check_options("post_localsgd", start_localSGD_iter="3") == {"start_localSGD_iter": 3, "subgroup": None}
    assert check_options("powersgd", matrix_approximation_rank="4", use_error_feedback="off") == {
        "matrix_approximation_rank": 4,
        "use_error_feedback": False,
    }
    assert check_options("qsgd", levels="3", bucket_size="64", min_numel="0") == {
        "levels": 3,
        "bucket_size": 64,
        "min_numel": 0,
    }
    assert check_options("allreduce") == {}
    assert not dist.is_initialized()


BENCH_DEFAULTS = {"start_powerSGD_iter": 10, "matrix_approximation_rank": "2"}


@pytest.mark.parametrize(
    ("name", "options", "resolved"),
    [
        ("allreduce", {}, {}),
        ("powersgd", {}, {"start_powerSGD_iter": 10, "matrix_approximation_rank": "2"}),
        ("powersgd", {"start_powerSGD_iter": "3"}, {"start_powerSGD_iter": "3", "matrix_approximation_rank": "2"}),
        ("powersgd_rank2", {}, {"start_powerSGD_iter": 10}),  # its preset rank is not overridden
        ("hierarchical", {}, {}),  # the inner hook defaults to allreduce, which takes neither
        (
            "hierarchical",
            {"inner": "powersgd", "matrix_approximation_rank": "4"},
            {"inner": "powersgd", "matrix_approximation_rank": "4", "start_powerSGD_iter": 10},
        ),
        (
            "hierarchical",
            {"inner": "batched_powersgd", "start_powerSGD_iter": "0", "ranks_per_node": "2"},
            {"inner": "batched_powersgd", "ranks_per_node": "2", "start_powerSGD_iter": "0",
             "matrix_approximation_rank": "2"},
        ),
        ("auto", {}, {}),  # the default candidates set both options themselves
        (
            "auto",
            {"candidates": "allreduce+powersgd:matrix_approximation_rank=4"},
            {"candidates": "allreduce+powersgd:matrix_approximation_rank=4;start_powerSGD_iter=10"},
        ),
        (
            "auto",
            {"candidates": ["fp16_compress", "hierarchical:inner=powersgd,start_powerSGD_iter=1"], "trial_steps": "2"},
            {
                "candidates": ["fp16_compress", "hierarchical:inner=powersgd;start_powerSGD_iter=1;matrix_approximation_rank=2"],
                "trial_steps": "2",
            },
        ),
    ],
)
def test_option_defaults_reach_every_hook_the_choice_runs_and_given_options_win(name, options, resolved):
    assert apply_option_defaults(name, options, BENCH_DEFAULTS) == resolved
    assert apply_option_defaults(name, resolved, BENCH_DEFAULTS) == resolved  # applying again changes nothing


def test_option_defaults_are_what_the_inner_hooks_and_candidates_are_built_with():
    """The resolved options build an inner PowerSGD and an auto candidate that start compressing at step 10."""
    options = apply_option_defaults("hierarchical", {"inner": "powersgd"}, {"start_powerSGD_iter": "10"})
    _, state = make_comm_hook("hierarchical", **options)
    assert state.inner_state.start_powerSGD_iter == 10
    candidates = apply_option_defaults("auto", {"candidates": "allreduce+powersgd"}, {"start_powerSGD_iter": "10"})
    _, state = make_comm_hook("auto", **candidates)
    assert [c.options for c in state._candidates] == [{}, {"start_powerSGD_iter": 10}]
    with pytest.raises(ValueError, match="unknown communication hook 'warp'"):
        apply_option_defaults("hierarchical", {"inner": "warp"}, {})


class _FakeModel:
    def __init__(self) -> None:
        self.registered: list = []

    def register_comm_hook(self, state, hook) -> None:
        self.registered.append((state, hook))


def test_registers_on_any_model_with_register_comm_hook_and_converts_strings():
    model = _FakeModel()
    state = register_comm_hook_by_name(
        model, "Post-LocalSGD", start_localSGD_iter="7", post_local_gradient_allreduce="false"
    )
    assert model.registered == [(state, post_localSGD_hook)]
    assert isinstance(state, PostLocalSGDState)
    assert (state.start_localSGD_iter, state.post_local_gradient_allreduce, state.subgroup) == (7, False, None)
    with pytest.raises(TypeError, match="Linear has no register_comm_hook"):
        register_comm_hook_by_name(torch.nn.Linear(1, 1), "allreduce")


@pytest.mark.parametrize("name", hook_names())
def test_every_name_imports_its_hook(name):
    """Fails with the import error while a hook's module is missing (it is written separately)."""
    spec = resolve_hook_name(name).value
    hook = get_hook(name)
    assert callable(hook)
    module = importlib.import_module(f"gradcomm.hooks.{spec.module}")
    assert hook is getattr(module, spec.hook)
    class_name = getattr(spec.state, "class_name", None)
    if class_name is not None:  # the declared options are the state constructor's keywords
        parameters = inspect.signature(getattr(module, class_name)).parameters
        assert set(spec.option_names) | {"process_group"} <= set(parameters)


def test_compression_registry_refuses_a_taken_name_and_a_missing_summary() -> None:
    """Refused while the class is created, so the registry is left as it was."""
    from gradcomm.compression import Compressor
    from gradcomm.compression.registry import methods

    before = methods()
    with pytest.raises(ValueError, match=r"compression method name 'topk' of .*Impostor is already taken by "
                       r"gradcomm.compression.methods.topk.TopK; choose another name="):

        class Impostor(Compressor, name="topk", summary="another top-k"):
            pass

    with pytest.raises(ValueError, match=r"compression method 'unsummarised' \(.*Unsummarised\) needs a summary="):

        class Unsummarised(Compressor, name="unsummarised"):
            pass

    assert methods() == before
