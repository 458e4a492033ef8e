"""Random models for the property tests of the communication hooks (tests/hooks/test_properties.py).

A model is described by a :class:`ModelSpec`, plain data that hypothesis draws, prints and shrinks, and that
every rank turns into the same :class:`PropertyModel`. Each parameter feeds its own branch, chosen by its
number of dimensions so that its gradient has the parameter's real structure:

* 0-dim scalar (``nn.Parameter(torch.tensor(1.0))``): multiplies the whole output;
* ``[n]`` (``[1]`` included): a bias, ``tanh(z + p)``;
* ``[a, b]`` (``[1, n]`` and ``[n, 1]`` included): a linear layer, ``tanh(z @ p.T)``;
* ``[o, i, k]``: a 1-D convolution kernel; ``[o, i, kh, kw]``: a 2-D convolution kernel;
* empty (``[0]``, ``[0, n]``, ``[n, 0]``): a bias or linear layer of no elements, whose gradient is empty.

``z`` is a fixed random projection of the input batch (the same on every rank: it is generated from the
spec's seed and is not a buffer). A parameter may be float64 beside float32 ones, laid out in memory
otherwise than C-contiguous (a transposed matrix, a channels-last kernel: dense, non-contiguous), frozen
(``requires_grad=False``), tied (used by a second branch: its gradient is the sum of both uses), or have a
zero slice of its gradient: ``column`` zeroes one input column (channel) of its branch, ``row`` ignores one
output unit (channel), ``all`` multiplies the branch by zero. The output is summed in float64 and scaled by
1/sqrt(number of branches), so a few SGD steps stay far from overflow (even in float16).
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from hypothesis import strategies as st
from torch import nn

__all__ = [
    "BATCH",
    "INPUTS",
    "KINDS",
    "ModelSpec",
    "ParamSpec",
    "PropertyModel",
    "batch",
    "full_feature_spec",
    "model_specs",
]

INPUTS = 8  # input features
BATCH = 4  # examples per rank and step
_MB = 1024 * 1024
_FIRST_BUCKET_BYTES = _MB  # with bucket_cap_mb=None the first bucket is limited to 1 MB (torch's default)
_MAX_LARGE_NUMEL = 300_000  # above the 1 MB first bucket in float32, cheap enough on two cores


@dataclass(frozen=True)
class ParamSpec:
    """One parameter: its shape, dtype, whether it is trained and which slice of its gradient is zero."""

    shape: tuple[int, ...]
    dtype: str = "float32"  # "float32" or "float64"
    frozen: bool = False
    zero: str | None = None  # None, "column", "row" (2-D and more) or "all" (1-D and more)
    layout: str = "contiguous"  # or "transposed" (2-D: column-major) or "channels_last" (4-D)

    def describe(self) -> str:
        text = f"{self.dtype}{list(self.shape)}"
        if self.layout != "contiguous":
            text += f" {self.layout}"
        if self.frozen:
            text += " frozen"
        if self.zero is not None:
            text += f" zero-grad-{self.zero}"
        return text


@dataclass(frozen=True)
class ModelSpec:
    """A model: parameters (registered in this order), the indices of those used a second time, a seed."""

    params: tuple[ParamSpec, ...]
    tied: tuple[int, ...] = ()
    seed: int = 0

    def describe(self) -> str:
        parts = [f"p{i}: {p.describe()}" for i, p in enumerate(self.params)]
        if self.tied:
            parts.append("used twice: " + ", ".join(f"p{i}" for i in self.tied))
        return f"ModelSpec(seed={self.seed}; " + "; ".join(parts) + ")"

    def numel(self) -> int:
        return sum(math.prod(p.shape) for p in self.params)


def _dtype(name: str) -> torch.dtype:
    return {"float32": torch.float32, "float64": torch.float64}[name]


def _branch_input_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    """Shape of one example's input to the branch of a parameter of ``shape`` (empty for scalars)."""
    if len(shape) == 0:
        return ()
    if len(shape) == 1:
        return (shape[0],)
    if len(shape) == 2:
        return (shape[1],)
    if len(shape) == 3:
        return (shape[1], shape[2] + 2)
    return (shape[1], shape[2] + 1, shape[3] + 1)


class PropertyModel(nn.Module):
    """The model a :class:`ModelSpec` describes; built identically on every rank from the spec alone."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.spec = spec
        generator = torch.Generator().manual_seed(spec.seed)
        self.weights = nn.ParameterList()
        self._branches: list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]] = []
        for p in spec.params:
            dtype = _dtype(p.dtype)
            if len(p.shape) == 0:
                value = torch.tensor(1.0, dtype=dtype)
            else:
                fan_in = math.prod(p.shape[1:]) if len(p.shape) > 1 else 1
                value = torch.randn(p.shape, generator=generator, dtype=torch.float64) / math.sqrt(fan_in)
            value = value.to(dtype)
            if p.layout == "transposed":
                value = value.t().contiguous().t()
            elif p.layout == "channels_last":
                value = value.contiguous(memory_format=torch.channels_last)
            self.weights.append(nn.Parameter(value, requires_grad=not p.frozen))
        # Tied parameters: the same Parameter objects, registered a second time (named_parameters and
        # parameters() list them once) and used by a second branch.
        self.tied = nn.ParameterList([self.weights[i] for i in spec.tied])
        for index in [*range(len(spec.params)), *spec.tied]:
            p = spec.params[index]
            if len(p.shape) == 0:
                continue
            dtype = _dtype(p.dtype)
            inner = _branch_input_shape(p.shape)
            projection = torch.randn(INPUTS, math.prod(inner), generator=generator, dtype=dtype) / math.sqrt(INPUTS)
            mask = torch.ones(inner, dtype=dtype)
            if p.zero == "column" and len(p.shape) >= 2:
                mask[0] = 0  # input column (channel) 0 of the branch: column 0 of the weight's gradient
            out_units = p.shape[0]
            readout = torch.randn(out_units, generator=generator, dtype=dtype) / math.sqrt(out_units)
            if p.zero == "row" and len(p.shape) >= 2:
                readout[-1] = 0  # the last output unit (channel) does not reach the output
            if p.zero == "all":
                readout.zero_()
            self._branches.append((index, projection, mask, readout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(x.shape[0], dtype=torch.float64, device=x.device)
        for index, *constants in self._branches:
            projection, mask, readout = (c.to(x.device) for c in constants)  # not buffers: DDP would sync them
            weight = self.weights[index]
            shape = tuple(weight.shape)
            z = (x.to(projection.dtype) @ projection).reshape(x.shape[0], *_branch_input_shape(shape)) * mask
            if len(shape) == 1:
                h = torch.tanh(z + weight)
            elif len(shape) == 2:
                h = torch.tanh(F.linear(z, weight))
            elif len(shape) == 3:
                h = torch.tanh(F.conv1d(z, weight)).mean(dim=2)
            else:
                h = torch.tanh(F.conv2d(z, weight)).mean(dim=(2, 3))
            out = out + (h @ readout).to(torch.float64)
        for index, p in enumerate(self.spec.params):
            if len(p.shape) == 0:
                uses = 1 + self.spec.tied.count(index)
                out = out * self.weights[index].to(torch.float64) ** uses
        return out / math.sqrt(max(1, len(self._branches)))


def batch(seed: int, rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's inputs and targets for ``step``: different on every rank, reproducible."""
    digest = hashlib.sha256(f"{seed}/{rank}/{step}".encode()).digest()
    generator = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little"))
    x = torch.randn(BATCH, INPUTS, generator=generator)
    y = torch.randn(BATCH, generator=generator, dtype=torch.float64)
    return x, y


# -- strategies ---------------------------------------------------------------------------------------------
KINDS = ("scalar", "one", "vector", "row", "column", "matrix", "conv1d", "conv2d", "empty")

_dims = st.integers(1, 6)


def _shape(kind: str) -> st.SearchStrategy[tuple[int, ...]]:
    if kind == "scalar":
        return st.just(())
    if kind == "one":
        return st.just((1,))
    if kind == "vector":
        return st.tuples(st.integers(2, 12))
    if kind == "row":
        return st.tuples(st.just(1), st.integers(2, 12))
    if kind == "column":
        return st.tuples(st.integers(2, 12), st.just(1))
    if kind == "matrix":
        return st.tuples(st.integers(2, 12), st.integers(2, 12))
    if kind == "empty":  # no elements: its gradient is empty too
        return st.sampled_from([(0,), (0, 5), (4, 0)])
    if kind == "conv1d":
        return st.tuples(_dims, _dims, st.integers(1, 3))
    return st.tuples(_dims, _dims, st.integers(1, 3), st.integers(1, 3))


@st.composite
def _param_specs(draw: st.DrawFn, shape: tuple[int, ...] | None = None) -> ParamSpec:
    if shape is None:
        shape = draw(st.sampled_from(KINDS).flatmap(_shape))
    dtype = draw(st.sampled_from(["float32", "float32", "float32", "float64"]))
    frozen = draw(st.integers(0, 5)) == 0
    zeros: list[str | None] = [None, None]
    if len(shape) >= 1:
        zeros.append("all")
    if len(shape) >= 2:
        zeros += ["column", "column", "row"]
    if math.prod(shape) == 0:  # an empty gradient has no slice to zero
        zeros = [None]
    layouts = ["contiguous", "contiguous"] + {2: ["transposed"], 4: ["channels_last"]}.get(len(shape), [])
    return ParamSpec(shape, dtype, frozen, draw(st.sampled_from(zeros)), draw(st.sampled_from(layouts)))


def _large_shape(bucket_cap_mb: float | None, factor: float, dtype: str) -> tuple[int, int]:
    """A matrix shape of ``factor`` times the (first) bucket's byte limit."""
    limit = _FIRST_BUCKET_BYTES if bucket_cap_mb is None else max(1, int(bucket_cap_mb * _MB))
    numel = min(_MAX_LARGE_NUMEL, max(2, math.ceil(factor * limit / _dtype(dtype).itemsize)))
    rows = max(1, math.isqrt(numel))
    return rows, math.ceil(numel / rows)


@st.composite
def model_specs(draw: st.DrawFn, bucket_cap_mb: float | None) -> ModelSpec:
    """Two to seven random parameters, sometimes one larger than the bucket cap, some used twice.

    At least one parameter is trained (DDP refuses a model without one).
    """
    params = draw(st.lists(_param_specs(), min_size=1, max_size=6))
    if draw(st.booleans()):
        dtype = draw(st.sampled_from(["float32", "float64"]))
        shape = _large_shape(bucket_cap_mb, draw(st.floats(1.1, 2.0)), dtype)
        layout = draw(st.sampled_from(["contiguous", "transposed"]))
        large = ParamSpec(shape, dtype, zero=draw(st.sampled_from([None, "column"])), layout=layout)
        params.insert(draw(st.integers(0, len(params))), large)
    if all(p.frozen for p in params):
        params[0] = dataclasses.replace(params[0], frozen=False)
    tied = tuple(draw(st.lists(st.integers(0, len(params) - 1), max_size=2, unique=True)))
    return ModelSpec(tuple(params), tied, draw(st.integers(0, 2**16)))


def full_feature_spec(bucket_cap_mb: float | None) -> ModelSpec:
    """Every feature at once: a scalar used twice, [1], [1, n], [n, 1], conv kernels, float64, a frozen
    parameter, zero gradient columns and rows, a matrix larger than the bucket cap, empty parameters, a
    transposed matrix and a channels-last kernel."""
    return ModelSpec(
        params=(
            ParamSpec(()),
            ParamSpec((1,)),
            ParamSpec((1, 5)),
            ParamSpec((6, 1), zero="column"),
            ParamSpec((3, 2, 3), "float64"),
            ParamSpec((4, 3, 2, 2), zero="column", layout="channels_last"),
            ParamSpec((5, 7), frozen=True),
            ParamSpec(_large_shape(bucket_cap_mb, 1.5, "float32"), zero="row"),
            ParamSpec((7,), "float64"),
            ParamSpec((), "float64"),
            ParamSpec((4, 6), "float64", zero="column", layout="transposed"),
            ParamSpec((0,)),
            ParamSpec((3, 0)),
        ),
        tied=(0, 2),
        seed=1,
    )
