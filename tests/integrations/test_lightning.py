"""gradcomm inside Lightning 2.6: ``GradcommDDPStrategy`` fits, checkpoints and resumes on 2 CPU ranks (gloo).

Real Lightning Trainers run on the ranks of :func:`gradcomm.testing.run_on_ranks`: the process group is already
initialized there and ``LOCAL_RANK`` is set, so Lightning's ``LightningEnvironment`` takes the processes as
launched externally and starts none. One spawned group runs every multi-rank check (importing Lightning costs
seconds per process); each rank returns what it observed and the assertions run here.
"""

from __future__ import annotations

import copy
import os
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch import nn

from gradcomm.testing import run_on_ranks
from tests.support.models import mlp
from tests.support.ranks import error_text
from tests.support.training import flat_parameters

pl = pytest.importorskip("lightning.pytorch")

from gradcomm.integrations.lightning import FORMAT, GradcommDDPStrategy  # noqa: E402

SAMPLES, BATCH = 64, 8  # 4 steps per epoch on each of 2 ranks


def _data(seed: int = 0) -> torch.utils.data.DataLoader:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(SAMPLES, 8, generator=generator)
    y = torch.randn(SAMPLES, 4, generator=generator)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=BATCH, shuffle=True)


def _net(seed: int) -> nn.Module:
    return mlp(8, 16, 4, seed=seed)


class Regression(pl.LightningModule):
    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        self.net = _net(seed)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


class ManualRegression(Regression):
    """Two backward/step pairs per training_step; records each synchronised gradient and the ranks' mean of
    the local gradients (from a copy of the network outside the DDP)."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.gaps: list[float] = []

    def training_step(self, batch: Any, batch_idx: int) -> None:
        optimizer = self.optimizers()
        x, y = batch
        for half in (x[: BATCH // 2], y[: BATCH // 2]), (x[BATCH // 2 :], y[BATCH // 2 :]):
            local = copy.deepcopy(self.net)
            grads = torch.autograd.grad(nn.functional.mse_loss(local(half[0]), half[1]), list(local.parameters()))
            expected = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(expected)
            expected /= dist.get_world_size()
            optimizer.zero_grad()
            self.manual_backward(nn.functional.mse_loss(self(half[0]), half[1]))
            synced = torch.cat([p.grad.reshape(-1) for p in self.net.parameters()])
            self.gaps.append(float((synced - expected).abs().max() / expected.abs().max()))
            optimizer.step()


class Observer(pl.Callback):
    """Keeps, at the end of fit (before the strategy unwraps the DDP), what the checks need."""

    def __init__(self) -> None:
        self.seen: dict[str, Any] = {}
        self.agreement: list[bool] = []

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        mine = torch.cat([p.detach().reshape(-1) for p in pl_module.parameters()])
        gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, mine)
        self.agreement.append(all(torch.equal(gathered[0], other) for other in gathered[1:]))

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        ddp = trainer.strategy.model
        state = trainer.strategy.comm_state
        self.seen = {
            "ddp": type(ddp).__module__ + "." + type(ddp).__qualname__,
            "bytes": ddp.comm_stats().total.bytes_sent,
            "dense_bytes": ddp.comm_stats().total.dense_bytes,
            "hook_iter": getattr(state, "iter", None),
            "hook_state": state.state_dict() if hasattr(state, "state_dict") else None,
            "params": flat_parameters(pl_module),
            "global_step": trainer.global_step,
            "wrong_world_size": error_text(
                lambda: trainer.strategy._restore_rank_share({"gradcomm": {"format": FORMAT, "world_size": 3}})
            ),
        }


def _fit(
    model: pl.LightningModule, strategy: Any, max_epochs: int, callbacks: tuple = (), ckpt_path: str | None = None
) -> Observer:
    observer = Observer()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        num_nodes=1,
        strategy=strategy,
        max_epochs=max_epochs,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=bool(callbacks),
        callbacks=[observer, *callbacks],
    )
    trainer.fit(model, _data(), ckpt_path=ckpt_path)
    return observer


def _powersgd() -> GradcommDDPStrategy:
    return GradcommDDPStrategy(
        ddp_comm_hook="powersgd", ddp_comm_hook_options={"matrix_approximation_rank": 1, "start_powerSGD_iter": 2}
    )


def _post_local(torch_state: bool) -> GradcommDDPStrategy:
    if torch_state:
        from torch.distributed.algorithms.ddp_comm_hooks import post_localSGD_hook as torch_hooks

        state = torch_hooks.PostLocalSGDState(None, None, start_localSGD_iter=2, post_local_gradient_allreduce=False)
        return GradcommDDPStrategy(
            ddp_comm_hook=torch_hooks.post_localSGD_hook, ddp_comm_state=state, model_averaging_period=3
        )
    return GradcommDDPStrategy(
        ddp_comm_hook="post_localsgd",
        ddp_comm_hook_options={"start_localSGD_iter": 2, "post_local_gradient_allreduce": False},
        model_averaging_period=3,
    )


def lightning_checks(folder: str) -> dict[str, Any]:
    """Every multi-rank check, on one rank; returns what each observed."""
    results: dict[str, Any] = {}
    results["allreduce"] = _fit(Regression(), "gradcomm_ddp", max_epochs=1).seen

    saving = pl.callbacks.ModelCheckpoint(dirpath=folder, filename="{epoch}", every_n_epochs=1, save_top_k=-1)
    results["powersgd"] = _fit(Regression(), _powersgd(), max_epochs=4, callbacks=(saving,)).seen
    resumed = _fit(Regression(seed=1), _powersgd(), max_epochs=4, ckpt_path=os.path.join(folder, "epoch=1.ckpt"))
    results["resumed"] = resumed.seen
    results["checkpoint"] = torch.load(os.path.join(folder, "epoch=1.ckpt"), weights_only=True)["gradcomm"]

    manual = ManualRegression()
    results["manual"] = _fit(manual, GradcommDDPStrategy(), max_epochs=1).seen
    results["manual_gaps"] = manual.gaps

    try:  # last but post-local SGD: a DDP refusing the argument fails before its first collective
        results["static_graph"] = _fit(Regression(), GradcommDDPStrategy(static_graph=True), max_epochs=1).seen
    except TypeError as exc:
        results["static_graph"] = f"{type(exc).__name__}: {exc}"

    local_folder = os.path.join(folder, "post_local")
    saving = pl.callbacks.ModelCheckpoint(dirpath=local_folder, filename="{epoch}", every_n_epochs=1, save_top_k=-1)
    for name, torch_state in (("post_local", False), ("post_local_torch", True)):
        observer = _fit(Regression(), _post_local(torch_state), max_epochs=3, callbacks=() if torch_state else (saving,))
        results[name] = observer.seen
        results[name + "_agreement"] = observer.agreement
    # after epoch 0 (4 steps) the replicas and optimizer states differ: step 3 was local
    resumed = _fit(Regression(seed=1), _post_local(False), max_epochs=3, ckpt_path=f"{local_folder}/epoch=0.ckpt")
    results["post_local_resumed"] = resumed.seen
    return results


@pytest.fixture(scope="module")
def observed(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_on_ranks(lightning_checks, world_size=2, args=(str(tmp_path_factory.mktemp("ckpt")),), timeout=240)


def _tensors(value: Any) -> list[torch.Tensor]:
    """The tensors in nested dicts and lists, in key order."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        return [t for key in sorted(value, key=repr) for t in _tensors(value[key])]
    if isinstance(value, (list, tuple)):
        return [t for item in value for t in _tensors(item)]
    return []


def _same_on_ranks(observed: list[dict[str, Any]], run: str) -> np.ndarray:
    params = [rank[run]["params"] for rank in observed]
    assert all(np.array_equal(params[0], other) for other in params[1:]), f"{run}: replicas differ"
    return params[0]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_fit_allreduce_and_powersgd(observed: list[dict[str, Any]]) -> None:
    for rank in observed:
        assert rank["allreduce"]["ddp"] == "gradcomm.ddp.distributed.DistributedDataParallel"
        assert rank["allreduce"]["global_step"] == 4
        assert rank["allreduce"]["bytes"] > 0
        assert rank["powersgd"]["global_step"] == 16
        assert rank["powersgd"]["hook_iter"] == 16
        assert rank["powersgd"]["bytes"] < rank["powersgd"]["dense_bytes"]  # compressed after the warm-up
    _same_on_ranks(observed, "allreduce")
    _same_on_ranks(observed, "powersgd")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_resumed_fit_continues_bit_for_bit(observed: list[dict[str, Any]]) -> None:
    checkpoint = observed[0]["checkpoint"]
    assert checkpoint["format"] == FORMAT and checkpoint["world_size"] == 2
    assert all(share["bucket_layout"]["rebuilt"] for share in checkpoint["ranks"])
    feedback = [_tensors(share["hook_state"]["error_dict"]) for share in checkpoint["ranks"]]
    assert feedback[0] and len(feedback[0]) == len(feedback[1])
    assert not all(torch.equal(a, b) for a, b in zip(*feedback, strict=True))  # each rank's error feedback is its own
    for rank in observed:
        assert rank["resumed"]["global_step"] == 16
        assert np.array_equal(rank["resumed"]["params"], rank["powersgd"]["params"])
        assert rank["resumed"]["hook_iter"] == rank["powersgd"]["hook_iter"]
        resumed, uninterrupted = _tensors(rank["resumed"]["hook_state"]), _tensors(rank["powersgd"]["hook_state"])
        assert len(resumed) == len(uninterrupted) and all(map(torch.equal, resumed, uninterrupted))
        assert rank["resumed"]["wrong_world_size"].startswith("CheckpointError: GradcommDDPStrategy:")
        assert "this fit has 2" in rank["resumed"]["wrong_world_size"]
        assert "Resume with 3 ranks" in rank["resumed"]["wrong_world_size"]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_manual_optimization_synchronises(observed: list[dict[str, Any]]) -> None:
    for rank in observed:
        assert len(rank["manual_gaps"]) == 8
        assert max(rank["manual_gaps"]) < 1e-6
        assert rank["manual"]["global_step"] == 8
    _same_on_ranks(observed, "manual")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_static_graph_fits(observed: list[dict[str, Any]]) -> None:
    assert isinstance(observed[0]["static_graph"], dict), observed[0]["static_graph"]
    assert observed[0]["static_graph"]["global_step"] == 4
    _same_on_ranks(observed, "static_graph")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_post_local_sgd_averages(observed: list[dict[str, Any]]) -> None:
    # steps 0, 1: global gradient averaging; from step 2 local SGD, parameters averaged at steps 2, 5, 8, 11
    expected = [step < 2 or (step - 2) % 3 == 0 for step in range(12)]
    for run in ("post_local", "post_local_torch"):
        for rank in observed:
            assert rank[run + "_agreement"] == expected, run
        _same_on_ranks(observed, run)
    assert np.array_equal(observed[0]["post_local"]["params"], observed[0]["post_local_torch"]["params"])


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_post_local_sgd_resumes_in_the_local_phase(observed: list[dict[str, Any]]) -> None:
    for rank in observed:
        assert rank["post_local_resumed"]["global_step"] == 12
        assert np.array_equal(rank["post_local_resumed"]["params"], rank["post_local"]["params"])


def test_strategy_refuses_misuse() -> None:
    assert error_text(lambda: GradcommDDPStrategy(ddp_comm_hook="powersgd", ddp_comm_state=object())).startswith(
        "ValueError: GradcommDDPStrategy: ddp_comm_hook='powersgd' is a name, so its state is built from "
    )
    assert "ddp_comm_hook_options are the options of a hook named in ddp_comm_hook" in error_text(
        lambda: GradcommDDPStrategy(ddp_comm_hook_options={"matrix_approximation_rank": 2})
    )
    assert "ddp_comm_wrapper='fp16' is a name, which needs a hook name" in error_text(
        lambda: GradcommDDPStrategy(ddp_comm_hook=lambda state, bucket: None, ddp_comm_wrapper="fp16")
    )
    assert "unknown ddp_comm_wrapper 'fp8'; valid wrappers: fp16, bf16" in error_text(
        lambda: GradcommDDPStrategy(ddp_comm_hook="allreduce", ddp_comm_wrapper="fp8")
    )
    assert "unknown communication hook 'powersdg'" in error_text(lambda: GradcommDDPStrategy(ddp_comm_hook="powersdg"))
    assert "got unknown option(s) 'rank'" in error_text(
        lambda: GradcommDDPStrategy(ddp_comm_hook="powersgd", ddp_comm_hook_options={"rank": 2})
    )
    strategy = GradcommDDPStrategy(ddp_comm_hook="post_localsgd", ddp_comm_hook_options={"start_localSGD_iter": 2})
    strategy._ddp_comm_state = object()
    assert "pass model_averaging_period=N to average every N steps" in error_text(strategy._enable_model_averaging)
    strategy.model = nn.Linear(2, 2)  # what a subclass overriding _setup_model wrongly returned
    assert "expected the model to be wrapped in gradcomm.DistributedDataParallel, got Linear" in error_text(
        strategy._register_ddp_hooks
    )


def test_registered_by_name() -> None:
    from lightning.pytorch.strategies import StrategyRegistry

    assert "gradcomm_ddp" in StrategyRegistry
    assert isinstance(StrategyRegistry.get("gradcomm_ddp"), GradcommDDPStrategy)
