"""Train a small regression model with Lightning on 2 CPU processes, gradients compressed with PowerSGD.

    python examples/lightning_example.py            # Lightning starts the second process itself

It fits 2 epochs, saving a checkpoint after each, then resumes from the first in a fresh Trainer and checks
that the resumed fit ends with exactly the parameters of the uninterrupted one (the PowerSGD error feedback
of each rank is in the checkpoint).
"""

from __future__ import annotations

import os
import tempfile

import lightning.pytorch as pl
import torch
from torch import nn

from gradcomm.integrations.lightning import GradcommDDPStrategy


class Regression(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 4))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


def data() -> torch.utils.data.DataLoader:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(256, 8, generator=generator)
    y = x @ torch.randn(8, 4, generator=generator)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=16, shuffle=True)


def fit(folder: str, max_epochs: int, ckpt_path: str | None = None) -> pl.Trainer:
    strategy = GradcommDDPStrategy(
        ddp_comm_hook="powersgd",
        ddp_comm_hook_options={"matrix_approximation_rank": 1, "start_powerSGD_iter": 4},
        start_method="popen",
    )
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_epochs=max_epochs,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[pl.callbacks.ModelCheckpoint(dirpath=folder, filename="{epoch}", save_top_k=-1)],
    )
    trainer.fit(Regression(), data(), ckpt_path=ckpt_path)
    return trainer


def main() -> None:
    torch.manual_seed(0)
    folder = os.environ.setdefault("GRADCOMM_EXAMPLE_DIR", tempfile.mkdtemp(prefix="gradcomm-lightning-"))
    uninterrupted = fit(folder, max_epochs=2)
    final = [p.detach().clone() for p in uninterrupted.lightning_module.parameters()]
    resumed = fit(os.path.join(folder, "resumed"), max_epochs=2, ckpt_path=os.path.join(folder, "epoch=0.ckpt"))
    same = all(torch.equal(a, b) for a, b in zip(final, resumed.lightning_module.parameters(), strict=True))
    if resumed.is_global_zero:
        print(f"rank 0: loss {float(resumed.callback_metrics['loss']):.4f}; resumed fit identical: {same}")


if __name__ == "__main__":
    main()
