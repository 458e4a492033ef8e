"""Training workloads for ``gradcomm bench``: real models on data made locally, nothing downloaded.

* ``transformer``: a small GPT-style byte-level language model (nanoGPT's shape: token and position
  embeddings, pre-norm blocks of causal self-attention and MLP, tied output head) trained on the source code
  of Python's own standard library, which ships with every interpreter. Its attention and MLP weights are
  the large matrices where low-rank methods (PowerSGD) pay off. Metric: perplexity. The text is that of the
  running interpreter, so absolute losses differ slightly between Python patch releases (every hook of one
  run trains on the same text); results record which text it was.
* ``transformer-stdlib``: the same model on the source of the whole standard library (its ``.py`` files but
  tests: about 12 MB on Python 3.11), where ``transformer``'s 12 modules (0.75 MB) repeat after about 3,000
  two-rank steps: for long runs that compare how methods optimise, not how they memorise a small text. Its
  held-out loss is averaged over 64 batches (of modules never trained on) instead of 4.
* ``cnn``: a small convolutional classifier on procedurally generated 16x16 images: ten classes of oriented
  sinusoidal gratings with random phase and noise. Metric: accuracy.

Each rank draws its own batches (seeded by rank and step), so data parallelism sees different data per rank
and every hook sees the same data for the same seed.
"""

from __future__ import annotations

import inspect
import math
import sysconfig
from abc import ABC, abstractmethod
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

__all__ = ["ConvClassifierWorkload", "TransformerLMWorkload", "WORKLOADS", "WholeStdlibLMWorkload", "Workload"]

Batch = tuple[torch.Tensor, torch.Tensor]


class Workload(ABC):
    """A model, its batches and its evaluation; the same for every hook."""

    name: str
    metric_name: str
    higher_is_better: bool
    evaluation_batches = 4

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)

    @abstractmethod
    def build_model(self) -> nn.Module: ...

    def data_description(self) -> str:
        """What the data is, precisely enough to tell whether two runs trained on the same data."""
        return "generated from fixed seeds"

    @abstractmethod
    def batch(self, rank: int, step: int) -> Batch: ...

    @abstractmethod
    def loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor: ...

    @abstractmethod
    def metric(self, loss: float, output: torch.Tensor, target: torch.Tensor) -> float: ...

    @torch.no_grad()
    def evaluate(self, model: nn.Module, batches: int | None = None) -> tuple[float, float]:
        """Loss and metric on held-out batches (rank -1: never drawn in training), ``evaluation_batches`` of
        them by default."""
        batches = batches or self.evaluation_batches
        model.eval()
        losses, metrics = [], []
        for step in range(batches):
            x, y = self.batch(-1, step)
            output = model(x)
            loss = self.loss(output, y).item()
            losses.append(loss)
            metrics.append(self.metric(loss, output, y))
        model.train()
        return sum(losses) / batches, sum(metrics) / batches

    def _generator(self, rank: int, step: int) -> torch.Generator:
        return torch.Generator().manual_seed(1_000_003 * (rank + 2) + step)


# -- transformer language model --------------------------------------------------------------------------
_CORPUS_MODULES = ("argparse", "textwrap", "json.decoder", "json.encoder", "dataclasses", "functools",
                   "inspect", "pathlib", "logging", "enum", "typing", "collections")


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 256
    block_size: int = 32
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 256


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.qkv = nn.Linear(config.n_embd, 3 * config.n_embd)
        self.proj = nn.Linear(config.n_embd, config.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, time, channels = x.shape
        q, k, v = self.qkv(x).split(channels, dim=2)
        q, k, v = (t.view(batch, time, self.n_head, channels // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).contiguous().view(batch, time, channels))


class Block(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd)
        self.mlp = nn.Sequential(
            nn.Linear(config.n_embd, 4 * config.n_embd), nn.GELU(), nn.Linear(4 * config.n_embd, config.n_embd)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.token_embedding = nn.Embedding(config.vocab_size, config.n_embd)
        self.position_embedding = nn.Embedding(config.block_size, config.n_embd)
        self.blocks = nn.Sequential(*[Block(config) for _ in range(config.n_layer)])
        self.ln_f = nn.LayerNorm(config.n_embd)
        self.head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.head.weight = self.token_embedding.weight
        self.apply(self._init_weights)
        for name, param in self.named_parameters():
            if name.endswith("proj.weight") or name.endswith("mlp.2.weight"):
                nn.init.normal_(param, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.token_embedding(tokens) + self.position_embedding(positions)
        return self.head(self.ln_f(self.blocks(x)))


class TransformerLMWorkload(Workload):
    """A byte-level GPT on the Python standard library's source code."""

    name = "transformer"
    metric_name = "perplexity"
    higher_is_better = False

    def __init__(self, device: torch.device | str = "cpu", batch_size: int = 4, config: GPTConfig | None = None):
        super().__init__(device)
        self.config = config or GPTConfig()
        self.batch_size = batch_size

    @cached_property
    def corpus(self) -> torch.Tensor:
        import importlib

        text = "\n".join(inspect.getsource(importlib.import_module(name)) for name in _CORPUS_MODULES)
        return torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8).long()

    @cached_property
    def held_out_start(self) -> int:
        """Where the held-out evaluation text (rank -1) begins: the corpus' last tenth, never trained on."""
        return int(0.9 * len(self.corpus))

    def data_description(self) -> str:
        import hashlib
        import sys

        digest = hashlib.sha256(self.corpus.to(torch.uint8).numpy().tobytes()).hexdigest()[:12]
        return (
            f"source of {len(_CORPUS_MODULES)} stdlib modules of Python {sys.version.split()[0]}: "
            f"{len(self.corpus)} bytes, sha256 {digest}"
        )

    def build_model(self) -> nn.Module:
        return GPT(self.config).to(self.device)

    def batch(self, rank: int, step: int) -> Batch:
        block = self.config.block_size
        split = self.held_out_start
        low, high = (split, len(self.corpus) - block - 1) if rank < 0 else (0, split - block - 1)
        starts = torch.randint(low, high, (self.batch_size,), generator=self._generator(rank, step))
        window = torch.stack([self.corpus[s : s + block + 1] for s in starts.tolist()])
        return window[:, :-1].to(self.device), window[:, 1:].to(self.device)

    def loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(output.reshape(-1, output.shape[-1]), target.reshape(-1))

    def metric(self, loss: float, output: torch.Tensor, target: torch.Tensor) -> float:
        return math.exp(loss)


class WholeStdlibLMWorkload(TransformerLMWorkload):
    """:class:`TransformerLMWorkload` on every ``.py`` file of the standard library but its tests, in path
    order; the held-out text is the last tenth's whole files: modules never trained on."""

    name = "transformer-stdlib"
    evaluation_batches = 64

    @cached_property
    def corpus(self) -> torch.Tensor:
        return torch.frombuffer(bytearray(b"".join(self._files)), dtype=torch.uint8).long()

    @cached_property
    def held_out_start(self) -> int:
        """The start of the first file that begins in the corpus' last tenth."""
        start = 0
        for text in self._files:
            if start >= 0.9 * len(self.corpus):
                break
            start += len(text)
        return start

    @cached_property
    def _files(self) -> list[bytes]:
        return [path.read_bytes() + b"\n" for path in _stdlib_sources()]

    def data_description(self) -> str:
        import hashlib
        import sys

        digest = hashlib.sha256(self.corpus.to(torch.uint8).numpy().tobytes()).hexdigest()[:12]
        return (
            f"{len(_stdlib_sources())} .py files of Python {sys.version.split()[0]}'s standard library: "
            f"{len(self.corpus)} bytes, sha256 {digest}"
        )


_SKIPPED_FOLDERS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}


def _stdlib_sources() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(
        path
        for path in root.rglob("*.py")
        if not _SKIPPED_FOLDERS.intersection(path.relative_to(root).parts[:-1])
    )


# -- convolutional classifier ----------------------------------------------------------------------------
class ConvNet(nn.Module):
    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(32, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU(), nn.MaxPool2d(2),
        )
        self.classifier = nn.Sequential(nn.Flatten(), nn.Linear(64 * 4 * 4, 256), nn.ReLU(), nn.Linear(256, classes))

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(images))


class ConvClassifierWorkload(Workload):
    """Ten classes of oriented gratings (16x16, random phase and frequency jitter, Gaussian noise)."""

    name = "cnn"
    metric_name = "accuracy"
    higher_is_better = True
    classes = 10

    def __init__(self, device: torch.device | str = "cpu", batch_size: int = 32, noise: float = 0.8):
        super().__init__(device)
        self.batch_size = batch_size
        self.noise = noise

    def build_model(self) -> nn.Module:
        return ConvNet(self.classes).to(self.device)

    def batch(self, rank: int, step: int) -> Batch:
        g = self._generator(rank, step)
        labels = torch.randint(0, self.classes, (self.batch_size,), generator=g)
        angle = labels.float() * math.pi / self.classes
        frequency = 0.6 + 0.15 * torch.rand(self.batch_size, generator=g)
        phase = 2 * math.pi * torch.rand(self.batch_size, generator=g)
        coords = torch.arange(16, dtype=torch.float32) - 7.5
        ys, xs = torch.meshgrid(coords, coords, indexing="ij")
        along = xs[None] * torch.cos(angle)[:, None, None] + ys[None] * torch.sin(angle)[:, None, None]
        images = torch.sin(frequency[:, None, None] * along + phase[:, None, None])
        images = images + self.noise * torch.randn(images.shape, generator=g)
        return images[:, None].to(self.device), labels.to(self.device)

    def loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(output, target)

    def metric(self, loss: float, output: torch.Tensor, target: torch.Tensor) -> float:
        return (output.argmax(dim=1) == target).float().mean().item()


WORKLOADS: dict[str, type[Workload]] = {
    w.name: w for w in (TransformerLMWorkload, WholeStdlibLMWorkload, ConvClassifierWorkload)
}
