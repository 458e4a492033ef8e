"""The reducer's bucket layout and its one-time rebuild (:class:`gradcomm.ddp.layout.BucketLayout`), on its own.

No ranks: these pin the state machine the multi-rank tests (test_ddp_behaviour's rebuilt layouts, the resume
tests' saved layouts) exercise through a DDP. Four float32 parameters of 10 elements (40 bytes) with 80-byte
buckets make two parameters per bucket.
"""

from __future__ import annotations

import pytest
import torch

from gradcomm.ddp.layout import BucketLayout

NAMES = ["a", "b", "c", "d"]


def make_layout(find_unused: bool = False, static: bool = False) -> BucketLayout:
    params = [torch.nn.Parameter(torch.zeros(10)) for _ in NAMES]
    return BucketLayout(params, (80, 80), None, None, False, find_unused, static)


def groups(layout: BucketLayout) -> list[list[int]]:
    return [bucket.param_indices for bucket in layout.buckets]


def test_first_iteration_is_recorded_then_rebuilt_once_in_ready_order() -> None:
    layout = make_layout()
    assert groups(layout) == [[0, 1, 2, 3]]  # torch's first iteration: one bucket per dtype and device
    assert layout.bucket_layout(NAMES) == {"order": [0, 1, 2, 3], "rebuilt": False, "names": NAMES}
    layout.ready_order.extend([1, 3, 0, 2])
    layout.step_done(ready_order_known=True)
    assert not layout.recording
    # a checkpoint taken now saves the pending rebuild's order
    assert layout.bucket_layout(NAMES) == {"order": [1, 3, 0, 2], "rebuilt": True, "names": NAMES}
    order = layout.take_due()
    assert order == [1, 3, 0, 2] and layout.take_due() is None
    layout.rebuild(order)
    assert groups(layout) == [[1, 3], [0, 2]] and layout.has_rebuilt
    layout.step_done(ready_order_known=True)  # later steps change nothing
    assert layout.due is None
    assert layout.bucket_layout(NAMES) == {"order": [1, 3, 0, 2], "rebuilt": True, "names": NAMES}


def test_a_joined_rank_rebuilds_from_its_current_order() -> None:
    layout = make_layout()
    layout.step_done(ready_order_known=False)
    assert layout.take_due() == [0, 1, 2, 3]


def test_find_unused_parameters_never_rebuilds_unless_the_graph_is_declared_static() -> None:
    layout = make_layout(find_unused=True)
    assert groups(layout) == [[2, 3], [0, 1]]  # torch's sized buckets, the last registered first
    assert not layout.recording
    layout.step_done(ready_order_known=True)
    assert layout.due is None
    assert layout.bucket_layout(NAMES)["rebuilt"] is False
    layout.expect()  # _set_static_graph() before the first iteration
    assert layout.recording
    assert make_layout(find_unused=True, static=True).recording


def test_an_adopted_layout_replaces_the_rebuild() -> None:
    layout = make_layout()
    layout.adopt([3, 1, 2, 0])
    assert groups(layout) == [[3, 1], [2, 0]]
    assert not layout.recording and layout.due is None
    assert layout.bucket_layout(NAMES) == {"order": [3, 1, 2, 0], "rebuilt": True, "names": NAMES}


def test_restart_recording_hands_over_the_order_so_far() -> None:
    layout = make_layout()
    layout.ready_order.extend([2, 0])
    assert layout.restart_recording() == [2, 0]
    assert layout.ready_order == []
    layout.step_done(ready_order_known=True)
    assert layout.restart_recording() == []  # no longer recording


def test_hook_state_layout_is_taken_only_where_this_ddp_would_build_it() -> None:
    layout = make_layout()
    assert layout.hook_state_order([["d", "b"], ["a", "c"]], NAMES) == [3, 1, 0, 2]
    assert layout.hook_state_order([["d", "b", "a"], ["c"]], NAMES) is None  # other bucket sizes
    assert layout.hook_state_order([["d", "b"], ["a", "x"]], NAMES) is None  # other parameters
    assert layout.hook_state_order([["d", "b"]], NAMES) is None  # not every parameter
    assert make_layout(find_unused=True).hook_state_order([["d", "b"], ["a", "c"]], NAMES) is None


def test_a_saved_layout_for_other_parameters_is_refused_naming_the_first_difference() -> None:
    saved = {"order": [1, 0, 3, 2], "rebuilt": True, "names": ["a", "B", "c", "d"]}
    with pytest.raises(ValueError, match=r"for other parameters \('b' here, 'B' saved\)"):
        BucketLayout.loaded_order(saved, NAMES)
    assert BucketLayout.loaded_order({**saved, "names": NAMES}, NAMES) == [1, 0, 3, 2]
    assert BucketLayout.loaded_order({**saved, "names": NAMES, "rebuilt": False}, NAMES) is None
