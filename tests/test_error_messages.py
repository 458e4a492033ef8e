"""Messages of the smaller misuse paths: bad arguments to the DDPs, the collectives, the harness, checkpoints
and the bench, and the torch-DDP surface gradcomm's DDP refuses. The ones that need a process group share one
spawned group."""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import gradcomm
from gradcomm import comm
from gradcomm.__main__ import main
from gradcomm.checkpoint import save_checkpoint
from gradcomm.compression import TopK
from gradcomm.ddp.torch_compat import _REFUSED
from gradcomm.hooks import default_hooks
from gradcomm.hooks.compression_hook import CompressionState, compressed_allreduce_hook
from gradcomm.testing import run_on_ranks
from tests.support.models import WithUnused
from tests.support.ranks import error_text


def test_grad_bucket_set_buffer_needs_the_same_size() -> None:
    buffer = torch.zeros(6)
    bucket = gradcomm.GradBucket(2, buffer, [0], [6], [torch.Size([6])], [], True)
    with pytest.raises(ValueError, match=r"GradBucket 2: set_buffer got a tensor of 4 elements, but the bucket holds 6"):
        bucket.set_buffer(torch.zeros(4))


def test_legacy_ddp_arguments() -> None:
    with pytest.raises(ValueError, match=r"LegacyDistributedDataParallel: world_size must be at least 1, got 0"):
        gradcomm.LegacyDistributedDataParallel(nn.Linear(2, 2), world_size=0)
    with pytest.raises(ValueError, match=r"LegacyDistributedDataParallel: buffer_size must be at least 1, got 0"):
        gradcomm.LegacyDistributedDataParallel(nn.Linear(2, 2), world_size=2, buffer_size=0)


def test_run_on_ranks_arguments() -> None:
    with pytest.raises(ValueError, match=r"run_on_ranks: world_size must be at least 1, got 0"):
        run_on_ranks(print, 0)
    with pytest.raises(ValueError, match=r"run_on_ranks: 1 namespaces given for 2 ranks"):
        run_on_ranks(print, 2, namespaces=["only-one"])


def test_checkpoint_extras_may_not_shadow_reserved_names(tmp_path: Any) -> None:
    with pytest.raises(ValueError, match=r"save_checkpoint: extra names \['bucket_layout', 'format'\] are reserved"):
        save_checkpoint(str(tmp_path), nn.Linear(2, 2), format=1, bucket_layout=2)


def test_bench_option_and_torchrun_messages(capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    assert main(["bench", "--hook-option", "rank4"]) == 2
    assert "gradcomm bench: error: --hook-option 'rank4' is not KEY=VALUE" in capsys.readouterr().err
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert main(["bench", "--bandwidth", "1gbit"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        "gradcomm bench: error: --bandwidth shapes local namespaced ranks; under torchrun the real network is "
        "measured"
    )


def test_hook_state_constructors_name_the_option_and_its_range() -> None:
    from gradcomm.compression import QSGD, TernGrad, TopK
    from gradcomm.hooks.compression_hook import CompressionState
    from gradcomm.hooks.post_localSGD_hook import PostLocalSGDState
    from gradcomm.hooks.powerSGD_hook import PowerSGDState

    with pytest.raises(TypeError, match=r"^PowerSGDState: random_seed must be an integer, got 1\.0$"):
        PowerSGDState(None, random_seed=1.0)
    with pytest.raises(ValueError, match=r"^PowerSGDState: orthogonalization_epsilon must be a finite number >= 0, got inf$"):
        PowerSGDState(None, orthogonalization_epsilon=float("inf"))
    with pytest.raises(ValueError, match=r"^PowerSGDState: start_powerSGD_iter must be at least 0, got -2$"):
        PowerSGDState(None, start_powerSGD_iter=-2, use_error_feedback=False, warm_start=False)
    with pytest.raises(TypeError, match=r"^QSGD: bucket_size must be an integer, got 0\.5$"):
        QSGD(bucket_size=0.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"^TernGrad: clip must be a number > 0 \(standard deviations\) or None, got nan$"):
        TernGrad(clip=float("nan"))
    with pytest.raises(ValueError, match=r"^CompressionState: min_numel must be at least 0, got -1$"):
        CompressionState(TopK(), min_numel=-1)
    with pytest.raises(TypeError, match=r"^CompressionState: compressor must be a Compressor, got str$"):
        CompressionState("topk")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"^PostLocalSGDState: start_localSGD_iter must be an integer, got 1\.5$"):
        PostLocalSGDState(None, None, 1.5)  # type: ignore[arg-type]


def test_bench_under_torchrun_refuses_bad_input_before_the_rendezvous(
    tmp_path: Any, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_rendezvous(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("init_process_group was called before the input was checked")

    monkeypatch.setattr(dist, "init_process_group", no_rendezvous)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "0")
    (tmp_path / "taken").write_text("")
    assert main(["bench", "--output", str(tmp_path / "taken")]) == 2
    assert capsys.readouterr().err.strip() == (
        f"gradcomm bench: error: --output {tmp_path / 'taken'} is not a folder; give a folder path (it is created "
        "if missing)"
    )
    assert main(["bench", "--hooks", "topk:ratio=2"]) == 2
    assert capsys.readouterr().err.strip() == (
        "gradcomm bench: error: communication hook 'topk': TopK: ratio must be in (0, 1], got 2.0"
    )


def _frozen() -> nn.Module:
    module = nn.Linear(4, 2)
    module.requires_grad_(False)
    return module


def _sparse_step(ddp: nn.Module) -> None:
    ddp(torch.tensor([1, 3, 3])).sum().backward()


def misuse_with_a_process_group() -> dict[str, str]:
    torch.set_num_threads(1)
    out = {
        "reduce_scatter": error_text(lambda: comm.reduce_scatter_tensor(torch.zeros(3))),
        "all_to_all": error_text(lambda: comm.all_to_all_single(torch.zeros(3, 2))),
        "two_devices": error_text(lambda: gradcomm.DistributedDataParallel(nn.Linear(4, 2), device_ids=[0, 1])),
        "all_frozen": error_text(lambda: gradcomm.DistributedDataParallel(_frozen())),
    }
    torch.manual_seed(0)
    ddp = gradcomm.DistributedDataParallel(nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2)))
    other = gradcomm.DistributedDataParallel(nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 3), nn.Linear(3, 2)))
    out["layout_of_other_model"] = error_text(lambda: ddp.load_bucket_layout(other.bucket_layout()))
    # torch-DDP internals without a gradcomm equivalent, called on the instance as torch code would.
    for name in _REFUSED:
        out[f"refused {name}"] = error_text(lambda name=name: getattr(other, name)())
    out["builtin_unknown"] = error_text(lambda: other._register_builtin_comm_hook(5))
    # Changing the buckets from inside backward (here: from a hook on the last gradient to become ready).
    layout = ddp.bucket_layout()
    seen: dict[str, str] = {}

    def change_layout(_: torch.Tensor) -> None:
        seen["during_backward"] = error_text(lambda: ddp.load_bucket_layout(layout))

    ddp.module[0].weight.register_post_accumulate_grad_hook(change_layout)
    ddp(torch.randn(2, 4)).sum().backward()
    out.update(seen)
    # A backward that left buckets unreduced (an unused parameter without find_unused_parameters).
    unfinished = gradcomm.DistributedDataParallel(WithUnused(4, 2))
    unfinished(torch.randn(2, 4)).sum().backward()
    out["not_finalized"] = error_text(unfinished._check_reducer_finalized)
    # A hook that expects dense buffers on a sparse bucket, and a dense gradient where a sparse one belongs.
    for name, state, hook in (
        ("hook_raises_on_sparse_bucket", CompressionState(TopK(ratio=0.5), min_numel=0), compressed_allreduce_hook),
        ("hook_future_fails_on_sparse_bucket", None, default_hooks.fp16_compress_hook),
    ):
        sparse = gradcomm.DistributedDataParallel(nn.Embedding(6, 3, sparse=True))
        sparse.register_comm_hook(state, hook)
        out[name] = error_text(lambda sparse=sparse: _sparse_step(sparse))
    made_dense = gradcomm.DistributedDataParallel(nn.Embedding(6, 3, sparse=True))
    made_dense.module.sparse = False
    out["dense_on_sparse_bucket"] = error_text(lambda: _sparse_step(made_dense))
    dist.barrier()
    return out


@pytest.fixture(scope="module")
def observed() -> dict[str, str]:
    return run_on_ranks(misuse_with_a_process_group, 2, timeout=100)[0]


_SPARSE_HINT = (
    r"a sparse bucket: torch's DDP hands sparse gradients \(nn.Embedding\(sparse=True\)\) to hooks too, so the "
    r"hook must handle a sparse buffer, or use no hook"
)

MESSAGES = {
    "reduce_scatter": r"ValueError: reduce_scatter_tensor: 3 elements do not split into 2 equal chunks; pad",
    "all_to_all": r"ValueError: all_to_all_single: dimension 0 of size 3 does not split into 2 equal chunks",
    "two_devices": r"ValueError: gradcomm.DistributedDataParallel supports one device per process; got "
    r"device_ids=\[0, 1\]",
    "all_frozen": r"RuntimeError: gradcomm.DistributedDataParallel: the module has no parameter that requires "
    r"a gradient",
    "layout_of_other_model": r"ValueError: load_bucket_layout: the checkpoint's bucket layout is for other "
    r"parameters \(4 parameters here, 6 saved\); load it into the model it was saved from",
    "during_backward": r"RuntimeError: load_bucket_layout: cannot change buckets during a backward pass",
    "builtin_unknown": r"^TypeError: gradcomm.DistributedDataParallel._register_builtin_comm_hook: comm_hook_type "
    r"must be dist.BuiltinCommHookType.ALLREDUCE or dist.BuiltinCommHookType.FP16_COMPRESS, got int 5; for any "
    r"other hook use register_comm_hook\(state, hook\)$",
    "not_finalized": r"^RuntimeError: gradcomm.DistributedDataParallel: the last backward did not finish reducing: "
    r"no gradient arrived for unused.weight, unused.bias. Pass find_unused_parameters=True if they are unused on "
    r"purpose.$",
    "hook_raises_on_sparse_bucket": r"^CommHookError: Communication hook compressed_allreduce_hook raised on bucket 0 "
    rf"\(18 elements, {_SPARSE_HINT}\): \w+: .* \(rank \d, step 0\); the hook's traceback is chained below$",
    "hook_future_fails_on_sparse_bucket": r"(?s)^CommHookError: Communication hook fp16_compress_hook: the future it "
    rf"returned for bucket 0 \({_SPARSE_HINT}\) failed: RuntimeError: .*Half.* \(rank \d, step 0\)$",
    "dense_on_sparse_bucket": r"^RuntimeError: gradcomm.DistributedDataParallel: parameter weight belongs to an "
    r"nn.Embedding/EmbeddingBag with sparse=True, so its bucket expects a sparse gradient, but it received a dense "
    r"one \(was the module's sparse flag changed after wrapping\?\). Set sparse before wrapping the model.$",
}


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("check", list(MESSAGES))
def test_messages_with_a_process_group(observed: dict[str, str], check: str) -> None:
    assert re.search(MESSAGES[check], observed[check]), f"{check}: {observed[check]}"


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize(("name", "advice"), list(_REFUSED.items()))
def test_refused_torch_methods_name_the_method_and_what_to_do(
    observed: dict[str, str], name: str, advice: str
) -> None:
    assert observed[f"refused {name}"] == (
        f"UnsupportedTorchMethodError: gradcomm.DistributedDataParallel.{name}() is torch's C++-reducer internals "
        f"and has no gradcomm equivalent; {advice}."
    )


class _TwoDimensionalMesh:
    ndim = 2

    def __repr__(self) -> str:
        return "DeviceMesh((2, 1))"


def test_a_multi_dimensional_device_mesh_gets_torchs_sentence_too() -> None:
    with pytest.raises(gradcomm.UnsupportedArgumentError) as caught:
        gradcomm.DistributedDataParallel(nn.Linear(2, 2), device_mesh=_TwoDimensionalMesh())
    assert str(caught.value) == (
        "gradcomm.DistributedDataParallel does not support device_mesh=DeviceMesh((2, 1)) (torch's DDP argument); "
        "pass process_group=device_mesh.get_group(0) for a 1-D mesh. Only 1D device mesh is supported, but got "
        "DeviceMesh((2, 1))."
    )


def test_public_error_types_are_exported() -> None:
    from gradcomm.ddp import distributed, torch_compat
    from gradcomm.hooks import contract

    expected = {
        "CommHookTypeError": contract.CommHookTypeError,
        "CommHookResultError": contract.CommHookResultError,
        "ParameterMismatchError": distributed.ParameterMismatchError,
        "UnsupportedArgumentError": torch_compat.UnsupportedArgumentError,
        "UnsupportedTorchMethodError": torch_compat.UnsupportedTorchMethodError,
    }
    for name, error in expected.items():
        assert name in gradcomm.__all__ and getattr(gradcomm, name) is error, name
