"""gradcomm.DistributedDataParallel as a drop-in for torch 2.13's DDP: the class, the constructor's arguments,
the torch internals frameworks reach for, exception types, pickling and sparse gradients, against torch's DDP.

The checks that need ranks run in one spawned group of 2 (``checked_on_ranks``, at the end); each test asserts
on its own check's results."""

from __future__ import annotations

import inspect
import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import gradcomm
from gradcomm.ddp.torch_compat import UnsupportedArgumentError, UnsupportedTorchMethodError
from gradcomm.testing import run_on_ranks
from tests.support.models import mlp
from tests.support.ranks import each_part, error_text, part_results
from tests.support.training import flat_parameters


class WithUnused(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.used = nn.Linear(6, 4)
        self.unused = nn.Linear(6, 4)
        self.register_buffer("seen", torch.zeros(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.used(x)


def _mlp() -> nn.Module:
    return mlp(6, 8, 2)


def _batch(step: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(100 * step + dist.get_rank())
    return torch.randn(5, 6, generator=generator)


def _train(ddp: nn.Module, steps: int, lr: float = 0.1) -> list[Any]:
    optimizer = torch.optim.SGD(ddp.parameters(), lr=lr)
    for step in range(steps):
        optimizer.zero_grad()
        ddp(_batch(step)).pow(2).sum().backward()
        optimizer.step()
    return [p.grad for p in ddp.module.parameters()]


def _same(ours: nn.Module, theirs: nn.Module) -> bool:
    return bool((flat_parameters(ours) == flat_parameters(theirs)).all())


# -- 1 and 2: the class and its constructor -----------------------------------------------------------------
def test_signature_takes_every_torch_argument_in_torch_order() -> None:
    torch_names = list(inspect.signature(TorchDDP.__init__).parameters)
    ours = inspect.signature(gradcomm.DistributedDataParallel.__init__).parameters
    assert list(ours)[: len(torch_names)] == torch_names
    assert all(ours[name].kind is inspect.Parameter.KEYWORD_ONLY for name in list(ours)[len(torch_names) :])
    # the one deliberate difference: by default .grad are bucket views where no user can tell (test_grad_views)
    own_defaults = {"gradient_as_bucket_view": None}
    for name in torch_names[2:]:
        expected = own_defaults.get(name, inspect.signature(TorchDDP.__init__).parameters[name].default)
        assert ours[name].default == expected, name


@pytest.mark.parametrize(
    ("argument", "value", "advice"),
    [
        ("delay_all_reduce_named_params", [("w", nn.Parameter(torch.zeros(1)))], "requires_grad=False"),
        ("param_to_hook_all_reduce", nn.Parameter(torch.zeros(1)), "delay_all_reduce_named_params"),
        ("mixed_precision", object(), "torch.autocast"),
        ("device_mesh", object(), "process_group=device_mesh.get_group(0)"),
        ("skip_all_reduce_unused_params", True, "find_unused_parameters=True"),
        ("batched_grad_copy", True, "gradient_as_bucket_view=None"),
    ],
)
def test_unsupported_arguments_are_refused_by_name(argument: str, value: Any, advice: str) -> None:
    with pytest.raises(UnsupportedArgumentError) as caught:
        gradcomm.DistributedDataParallel(nn.Linear(2, 2), **{argument: value})
    assert isinstance(caught.value, ValueError) and isinstance(caught.value, RuntimeError)
    message = str(caught.value)
    assert message.startswith(f"gradcomm.DistributedDataParallel does not support {argument}=")
    assert advice in message


def _constructor_checks() -> dict[str, Any]:
    torch.set_num_threads(1)
    rank = dist.get_rank()
    out: dict[str, Any] = {}

    def build(**kwargs: Any) -> tuple[gradcomm.DistributedDataParallel, list[str]]:
        module = WithUnused()
        module.seen.fill_(rank + 1.0)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ddp = gradcomm.DistributedDataParallel(module, find_unused_parameters=True, **kwargs)
        return ddp, [f"{w.category.__name__}: {w.message}" for w in caught]

    plain, out["plain_warnings"] = build()
    out["isinstance"] = isinstance(plain, TorchDDP)
    out["plain"] = (plain.forward_sync_buffers, plain.broadcast_buffers, plain.module.seen.tolist())
    synced = []  # every forward broadcasts rank 0's buffers, a buffer reassigned since the last one included
    for value in (5.0, 9.0):
        if value == 5.0:
            plain.module.seen.fill_(value + rank)
        else:
            plain.module.seen = torch.full((4,), value + rank)
        plain(torch.zeros(2, 6))
        synced.append(plain.module.seen.tolist())
    out["synced"] = synced
    old, out["old_warnings"] = build(broadcast_buffers=False)
    out["old"] = (old.forward_sync_buffers, old.broadcast_buffers, old.module.seen.tolist())
    new, out["new_warnings"] = build(forward_sync_buffers=False)
    out["new"] = (new.forward_sync_buffers, new.broadcast_buffers, new.module.seen.tolist())
    both, out["both_warnings"] = build(broadcast_buffers=False, forward_sync_buffers=True)
    out["both"] = both.forward_sync_buffers
    both.broadcast_buffers = False  # torch's property: an alias of forward_sync_buffers
    out["alias"] = (both.forward_sync_buffers, "broadcast_buffers" in both.__dict__)
    _, out["check_reduction_warnings"] = build(check_reduction=True)
    out["dim"] = build(dim=1)[0].dim

    caps = gradcomm.DistributedDataParallel(_mlp(), bucket_cap_mb_list=[40 / 2**20, 1000])
    out["caps"] = (caps.reducer.bucket_parameter_names(), caps.bucket_bytes_cap, caps.bucket_bytes_cap_list)
    out["bad_caps"] = error_text(lambda: gradcomm.DistributedDataParallel(_mlp(), bucket_cap_mb_list=[0]))
    return out


@pytest.mark.slow
@pytest.mark.timeout(330)
def test_constructor_arguments_behave_as_torch(checked_on_ranks: list[dict[str, Any]]) -> None:
    out = part_results(checked_on_ranks, "_constructor_checks")[1]
    assert out["isinstance"]
    assert out["plain_warnings"] == []
    assert out["plain"] == (True, True, [1.0] * 4)  # buffers broadcast from rank 0 at construction
    assert out["synced"] == [[5.0] * 4, [9.0] * 4]
    assert out["old"] == (False, False, [2.0] * 4)  # the deprecated False leaves buffers out of the init sync
    assert out["old_warnings"] == [
        "FutureWarning: `broadcast_buffers` is deprecated. Use `forward_sync_buffers` instead. IMPORTANT: unlike "
        "`broadcast_buffers=False`, `forward_sync_buffers=False` still syncs buffers at init."
    ]
    assert out["new"] == (False, False, [1.0] * 4) and out["new_warnings"] == []
    assert out["both"] is True
    assert out["both_warnings"][0].startswith("FutureWarning: Both `broadcast_buffers` and `forward_sync_buffers`")
    assert out["alias"] == (False, False)
    assert out["check_reduction_warnings"] == [
        "FutureWarning: The `check_reduction` argument in `DistributedDataParallel` module is deprecated. Please "
        "avoid using it."
    ]
    assert out["dim"] == 1
    names, cap, cap_list = out["caps"]
    # torch's first-iteration layout: in registration order the first bucket closes once it reaches 40 bytes
    # (0.weight, 192 bytes), the rest share 1000 MB; then the list is reversed
    assert names == [["0.bias", "2.weight", "2.bias"], ["0.weight"]]
    assert cap == 1000 * 2**20 and cap_list == [40, 1000 * 2**20]
    assert out["bad_caps"] == "ValueError: bucket_cap_mb_list must hold positive sizes in MB, got [0]"


class RankLocalBuffer(nn.Module):
    """torch's ``test_ddp_join_respects_forward_sync_buffers_false`` model: a buffer drawn per rank."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(10, 10, bias=False)
        torch.manual_seed(dist.get_rank() + 42)
        self.register_buffer("rank_local", torch.randn(10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) + self.rank_local


def _join_buffer_checks() -> dict[str, Any]:
    """torch's case on CPU: ``rank + 1`` steps under ``ddp.join()`` with buffer sync off, both spellings, on
    torch's DDP and gradcomm's; each run reports ``(buffer before, buffer after, parameters after)``."""
    torch.set_num_threads(1)
    rank = dist.get_rank()
    out: dict[str, Any] = {}
    for spelling in ("broadcast_buffers", "forward_sync_buffers"):
        for label, kind in (("torch", TorchDDP), ("gradcomm", gradcomm.DistributedDataParallel)):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)
                ddp = kind(RankLocalBuffer(), **{spelling: False})
            before = ddp.module.rank_local.detach().clone()
            generator = torch.Generator().manual_seed(rank)
            with ddp.join():
                for _ in range(rank + 1):
                    ddp(torch.randn(2, 10, generator=generator)).sum().backward()
            out[spelling, label] = (before.tolist(), ddp.module.rank_local.tolist(), flat_parameters(ddp.module))
    return out


@pytest.mark.slow
@pytest.mark.timeout(330)
def test_join_leaves_buffers_alone_when_buffer_sync_is_off_as_torch(checked_on_ranks: list[dict[str, Any]]) -> None:
    ranks = part_results(checked_on_ranks, "_join_buffer_checks")
    for rank, out in enumerate(ranks):
        for spelling in ("broadcast_buffers", "forward_sync_buffers"):
            ours, theirs = out[spelling, "gradcomm"], out[spelling, "torch"]
            assert theirs[0] == theirs[1], (rank, spelling)  # torch's assertion, which torch's DDP passes
            assert ours[0] == ours[1], f"rank {rank}, {spelling}=False: join() changed the rank-local buffer"
            assert ours[1] == theirs[1] and (ours[2] == theirs[2]).all(), (rank, spelling)
    # the deprecated spelling also skips the init sync: the buffers stay each rank's own throughout
    assert ranks[0]["broadcast_buffers", "gradcomm"][1] != ranks[1]["broadcast_buffers", "gradcomm"][1]
    assert ranks[0]["forward_sync_buffers", "gradcomm"][1] == ranks[1]["forward_sync_buffers", "gradcomm"][1]


# -- the torch internals frameworks use -----------------------------------------------------------------------
def _torch_surface_checks() -> dict[str, Any]:
    torch.set_num_threads(1)
    out: dict[str, Any] = {}

    # static graph, against torch's, with a parameter never used
    torch.manual_seed(1)
    ours = gradcomm.DistributedDataParallel(WithUnused(), static_graph=True)
    torch.manual_seed(1)
    theirs = TorchDDP(WithUnused(), static_graph=True)
    out["static_grads"] = [_train(ddp, 4) for ddp in (ours, theirs)]
    out["static_same"] = _same(ours.module, theirs.module)
    out["static_attr"] = (ours.static_graph, ours._get_ddp_logging_data()["static_graph"])
    out["static_again"] = error_text(lambda: ours._set_static_graph())  # warns, as torch: no error
    # a static graph that changes: a parameter used in the first iteration gets no gradient in the second
    for kind in (gradcomm.DistributedDataParallel, TorchDDP):
        changing = kind(WithUnused(), static_graph=True)
        changing(_batch(0)).pow(2).sum().backward()
        changing.module.used.weight.requires_grad_(False)  # never marked ready in this backward
        changing(_batch(1)).pow(2).sum().backward()
        changing.module.used.weight.requires_grad_(True)
        out[f"static_changed_{kind.__module__}"] = error_text(lambda: changing(_batch(2)))  # noqa: B023
    late = gradcomm.DistributedDataParallel(_mlp())
    _train(late, 1)
    out["static_late"] = error_text(late._set_static_graph)
    logging_data = late._get_ddp_logging_data()
    out["logging"] = {k: logging_data[k] for k in ("can_set_static_graph", "iteration", "world_size", "comm_hook")}

    # Accelerate's trigger_sync_in_backward: a forward under no_sync, then a synchronised backward
    results = []
    for kind in (gradcomm.DistributedDataParallel, TorchDDP):
        ddp = kind(_mlp())
        with ddp.no_sync():
            loss = ddp(_batch(0)).pow(2).sum()
        ddp.require_backward_grad_sync = True
        ddp.reducer.prepare_for_backward([])
        loss.backward()
        results.append(torch.cat([p.grad.flatten() for p in ddp.parameters()]))
        out[f"rebuild_{kind.__module__}"] = ddp.reducer._rebuild_buckets()
    out["trigger_sync_equal"] = torch.equal(*results)

    # built-in hook, and torch internals that have no meaning here
    builtin = gradcomm.DistributedDataParallel(_mlp())
    builtin._register_builtin_comm_hook(dist.BuiltinCommHookType.ALLREDUCE)
    reference = TorchDDP(_mlp())
    _train(builtin, 2), _train(reference, 2)
    out["builtin_same"] = _same(builtin.module, reference.module)
    out["builtin_name"] = builtin._get_ddp_logging_data()["comm_hook"]
    out["fused"] = error_text(lambda: builtin._register_fused_optim(torch.optim.SGD, lr=0.1))
    out["update_group"] = error_text(lambda: builtin._update_process_group(dist.group.WORLD))
    out["sample_rate"] = error_text(lambda: builtin._set_ddp_runtime_logging_sample_rate(5))
    out["train_returns_self"] = builtin.train() is builtin and builtin.eval() is builtin
    out["finalized"] = error_text(builtin._check_reducer_finalized)
    out["active_module"] = TorchDDP._get_active_ddp_module()
    out["will_sync"] = builtin.will_sync_module_buffers()
    return out


@pytest.mark.slow
@pytest.mark.timeout(330)
def test_torch_internals_frameworks_use(checked_on_ranks: list[dict[str, Any]]) -> None:
    out = part_results(checked_on_ranks, "_torch_surface_checks")[0]
    ours, theirs = out["static_grads"]
    assert [g is None for g in ours] == [g is None for g in theirs] == [False, False, True, True]
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True) if a is not None)
    assert out["static_same"]
    assert out["static_attr"] == (True, 1)
    assert out["static_again"] == "no error"
    changed = (
        "Expected to have finished reduction in the prior iteration before starting a new one. This error "
        "indicates that your training graph has changed in this iteration"
    )
    assert changed in out["static_changed_torch.nn.parallel.distributed"]
    assert changed in out["static_changed_gradcomm.ddp.distributed"], out["static_changed_gradcomm.ddp.distributed"]
    assert out["static_late"] == (
        "RuntimeError: set_static_graph() should be called before training loop starts and after "
        "DistributedDataParallel is constructed. "
        "gradcomm.DistributedDataParallel._set_static_graph() must be called before the first "
        "synchronised iteration (1 already ran); pass static_graph=True to the constructor instead"
    )
    assert out["logging"] == {
        "can_set_static_graph": 1,
        "iteration": 1,
        "world_size": 2,
        "comm_hook": "default allreduce (no hook registered)",
    }
    assert out["trigger_sync_equal"]
    assert out["rebuild_gradcomm.ddp.distributed"] is out["rebuild_torch.nn.parallel.distributed"] is True
    assert out["builtin_same"]
    assert out["builtin_name"] == "allreduce_hook"
    assert out["fused"] == (
        "UnsupportedTorchMethodError: gradcomm.DistributedDataParallel._register_fused_optim() is torch's "
        "C++-reducer internals and has no gradcomm equivalent; step the optimizer after backward as usual "
        "(gradcomm reduces every bucket by the end of backward)."
    )
    assert out["update_group"].startswith("UnsupportedTorchMethodError: gradcomm.DistributedDataParallel._update_")
    assert "ddp.comm_stats()" in out["sample_rate"]
    assert issubclass(UnsupportedTorchMethodError, RuntimeError)
    assert out["train_returns_self"]
    assert out["finalized"] == "no error"
    assert out["active_module"] is None  # restored after every forward
    assert out["will_sync"] is False  # the MLP has no buffers


# -- 3: gradcomm's errors are what torch raises, and more specific ------------------------------------------------
def test_error_classes_subclass_what_torch_raises() -> None:
    from gradcomm.ddp.distributed import ParameterMismatchError
    from gradcomm.hooks.contract import CommHookResultError, CommHookTypeError

    assert issubclass(gradcomm.CommHookError, RuntimeError)
    assert issubclass(CommHookTypeError, gradcomm.CommHookError) and issubclass(CommHookTypeError, TypeError)
    assert issubclass(CommHookResultError, gradcomm.CommHookError) and issubclass(CommHookResultError, ValueError)
    assert issubclass(ParameterMismatchError, RuntimeError) and issubclass(ParameterMismatchError, ValueError)
    assert issubclass(gradcomm.PeerLostError, dist.DistBackendError)
    assert issubclass(gradcomm.ParameterDriftError, RuntimeError)
    assert issubclass(UnsupportedTorchMethodError, RuntimeError)


def _hook_error_checks() -> dict[str, str]:
    torch.set_num_threads(1)

    def returns_tensor_hook(state, bucket):  # type: ignore[no-untyped-def]
        return bucket.buffer()

    def wrong_shape_hook(state, bucket):  # type: ignore[no-untyped-def]
        future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        future.set_result(torch.zeros(3))
        return future

    out = {}
    for hook in (returns_tensor_hook, wrong_shape_hook):
        ddp = gradcomm.DistributedDataParallel(_mlp(), check_parameters_every=0)
        ddp.register_comm_hook(None, hook)
        try:
            ddp(_batch(0)).sum().backward()
            out[hook.__name__] = "no error"
        except RuntimeError as exc:  # what code written for torch's DDP catches
            out[hook.__name__] = f"{type(exc).__name__}: {exc}"
    return out


@pytest.mark.slow
@pytest.mark.timeout(330)
def test_hook_contract_errors_are_runtime_errors_with_gradcomm_messages(checked_on_ranks: list[dict[str, Any]]) -> None:
    out = part_results(checked_on_ranks, "_hook_error_checks")[0]
    assert out["returns_tensor_hook"].startswith(
        "CommHookTypeError: Communication hook _hook_error_checks.<locals>.returns_tensor_hook returned Tensor on "
        "bucket 0; it must return a torch.futures.Future"
    )
    assert out["wrong_shape_hook"].startswith(
        "CommHookResultError: Communication hook _hook_error_checks.<locals>.wrong_shape_hook: the future for "
        "bucket 0 holds a tensor of shape (3,) and dtype torch.float32; expected shape (74,)"
    )


# -- 4: pickling, as torch's DDP -------------------------------------------------------------------------------
def _pickle_checks() -> dict[str, Any]:
    import io
    import pickle

    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    torch.set_num_threads(1)
    ours = gradcomm.DistributedDataParallel(_mlp())
    ours.register_comm_hook(None, default_hooks.allreduce_hook)
    theirs = TorchDDP(_mlp())
    _train(ours, 1), _train(theirs, 1)
    ours, theirs = pickle.loads(pickle.dumps(ours)), pickle.loads(pickle.dumps(theirs))
    out: dict[str, Any] = {"hook_after": ours.reducer.hook_name, "isinstance": isinstance(ours, TorchDDP)}
    _train(ours, 3), _train(theirs, 3)
    out["same"] = _same(ours.module, theirs.module)
    buffer = io.BytesIO()
    torch.save(ours, buffer)
    out["saved"] = buffer.getvalue()
    group = dist.new_group([0, 1])
    on_group = gradcomm.DistributedDataParallel(_mlp(), process_group=group)
    out["other_group"] = error_text(lambda: pickle.dumps(on_group))
    return out


@pytest.mark.slow
@pytest.mark.timeout(330)
def test_pickling_drops_the_group_and_rebuilds_like_torch(checked_on_ranks: list[dict[str, Any]]) -> None:
    import io

    out = part_results(checked_on_ranks, "_pickle_checks")[0]
    assert out["hook_after"] == "default allreduce (no hook registered)"  # torch drops the hook too
    assert out["isinstance"] and out["same"]
    assert out["other_group"].startswith(
        "RuntimeError: gradcomm.DistributedDataParallel: pickling is only supported for a DDP on the default "
        "process group"
    )
    assert not dist.is_initialized()
    loaded = torch.load(io.BytesIO(out["saved"]), weights_only=False)
    assert isinstance(loaded, gradcomm.DistributedDataParallel)
    assert loaded.module(torch.zeros(1, 6)).shape == (1, 2)  # usable for inspection
    with pytest.raises(RuntimeError, match=r"unpickled while no default process group was initialized, .* Call "
                       r"torch.distributed.init_process_group\(...\) before loading it"):
        loaded(torch.zeros(1, 6))


# -- 5: sparse gradients, against torch's DDP --------------------------------------------------------------------
class SparseModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.embedding = nn.Embedding(30, 4, sparse=True)
        self.bag = nn.EmbeddingBag(30, 4, mode="sum", sparse=True)
        self.head = nn.Linear(8, 1)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(torch.cat([self.embedding(tokens).mean(1), self.bag(tokens)], dim=1))


def _sparse_checks() -> dict[str, Any]:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    torch.set_num_threads(1)
    out: dict[str, Any] = {}
    for hooked in (False, True):
        trained = []
        for kind in (gradcomm.DistributedDataParallel, TorchDDP):
            ddp = kind(SparseModel())
            if hooked:
                ddp.register_comm_hook(None, default_hooks.allreduce_hook)
            optimizer = torch.optim.SGD(ddp.parameters(), lr=0.5)
            grads = []
            for step in range(3):
                generator = torch.Generator().manual_seed(10 * step + dist.get_rank())
                tokens = torch.randint(0, 30, (4, 5), generator=generator)
                optimizer.zero_grad()
                ddp(tokens).pow(2).sum().backward()
                grads.append([p.grad.to_dense() for p in ddp.parameters()])
                optimizer.step()
            trained.append((ddp, grads))
        (ours, our_grads), (theirs, their_grads) = trained
        out[f"hooked={hooked}"] = (
            _same(ours.module, theirs.module),
            all(torch.equal(a, b) for s, t in zip(our_grads, their_grads, strict=True) for a, b in zip(s, t, strict=True)),
            ours.reducer.bucket_parameter_names(),
        )
    return out


@pytest.mark.slow
@pytest.mark.timeout(330)
def test_sparse_gradients_match_torch(checked_on_ranks: list[dict[str, Any]]) -> None:
    out = part_results(checked_on_ranks, "_sparse_checks")[1]
    for hooked in (False, True):
        same_parameters, same_gradients, buckets = out[f"hooked={hooked}"]
        assert same_parameters and same_gradients, hooked
        assert ["embedding.weight"] in buckets and ["bag.weight"] in buckets  # each sparse parameter alone


def test_parameters_to_ignore_are_refused() -> None:
    module = nn.Linear(2, 2)
    TorchDDP._set_params_and_buffers_to_ignore_for_model(module, ["bias"])
    with pytest.raises(UnsupportedArgumentError, match=r"does not support parameters and buffers to ignore .* set "
                       r"requires_grad=False on parameters that must not be reduced"):
        gradcomm.DistributedDataParallel(module)


# -- the 2-rank checks above, in one spawned group: those whose errors leave a DDP mid-step last ----------------
RANK_CHECKS = (
    _constructor_checks,
    _join_buffer_checks,
    _pickle_checks,
    _sparse_checks,
    _torch_surface_checks,
    _hook_error_checks,
)


@pytest.fixture(scope="module")
def checked_on_ranks() -> list[dict[str, Any]]:
    parts = [(check.__name__, check, ()) for check in RANK_CHECKS]
    return run_on_ranks(each_part, world_size=2, args=(parts,), timeout=300)
