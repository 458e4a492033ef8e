"""Staged gradient writes (``gradcomm.ddp.staging``): whatever order the gradients arrive in, however they
split into runs, the bucket ends up holding each gradient times the scale, bit for bit the floats of
``torch.mul(grad, scale, out=view)`` per gradient with ``scale`` a Python number (torch's reducer's wrapped
scalar), each element scaled once."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gradcomm.ddp import staging
from gradcomm.ddp.bucketing import Bucket

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]


@st.composite
def cases(draw: st.DrawFn) -> tuple[list[tuple[int, ...]], list[int], list[bool], int, bool, torch.dtype]:
    shapes = draw(
        st.lists(
            st.sampled_from([(), (1,), (0,), (1, 7), (3, 5), (40,), (9, 9), (300,)]), min_size=1, max_size=12
        )
    )
    order = draw(st.permutations(range(len(shapes))))
    in_place = draw(st.lists(st.booleans(), min_size=len(shapes), max_size=len(shapes)))
    run_bytes = draw(st.sampled_from([1, 16, 100, 400, 1 << 20]))
    scaled = draw(st.booleans())
    dtype = draw(st.sampled_from(DTYPES))
    return shapes, list(order), in_place, run_bytes, scaled, dtype


@settings(max_examples=200, deadline=None)
@given(case=cases())
def test_staged_writes_give_each_gradient_times_the_scale(case) -> None:
    shapes, order, in_place, run_bytes, scaled, dtype = case
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(staging, "RUN_BYTES", run_bytes)
        _check_staged_writes(shapes, order, in_place, scaled, dtype, run_bytes)


def _check_staged_writes(
    shapes: list[tuple[int, ...]],
    order: list[int],
    in_place: list[bool],
    scaled: bool,
    dtype: torch.dtype,
    run_bytes: int,
) -> None:
    generator = torch.Generator().manual_seed(len(order))
    params = [torch.nn.Parameter(torch.zeros(shape, dtype=dtype)) for shape in shapes]
    bucket = Bucket(0, list(range(len(params))), params, is_last=True)
    bucket.buffer.fill_(float("nan"))  # what was not written shows
    grads = [(torch.randn(shape, generator=generator) * 1e3).to(dtype) for shape in shapes]
    scale = 1.0 / 3.0 if scaled else None
    expected = [
        torch.mul(grad, scale, out=torch.empty_like(grad)) if scaled else grad.clone() for grad in grads
    ]
    for position in order:
        if in_place[position]:  # a gradient already accumulated into its view
            bucket.views[position].copy_(grads[position])
            bucket.staged.put(position, None, scale)
        else:
            bucket.staged.put(position, grads[position], scale)
    bucket.staged.flush(scale)
    for position, want in enumerate(expected):
        got = bucket.views[position]
        assert torch.equal(_bits(got), _bits(want)), (
            f"position {position} (shape {shapes[position]}, arrival order {order}, run of {run_bytes} bytes)"
        )


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.reshape(-1).contiguous().view(torch.uint8)


def test_discard_forgets_a_run_left_by_an_abandoned_backward() -> None:
    params = [torch.nn.Parameter(torch.zeros(4)) for _ in range(2)]
    bucket = Bucket(0, [0, 1], params, is_last=True)
    scale = 0.5
    bucket.staged.put(0, torch.ones(4), scale)
    bucket.staged.discard()
    bucket.staged.flush(scale)
    assert torch.equal(bucket.buffer, torch.zeros(8)), "a discarded run must not be written"
