"""gradcomm.DiLoCo's pieces: fragments, schedule, argument checks (no process group), and refused loads
(one rank)."""

from __future__ import annotations

import itertools

import pytest
import torch

from gradcomm.diloco import DiLoCo
from gradcomm.diloco.fragments import split_into_fragments
from gradcomm.diloco.state import compressor_hook
from gradcomm.testing import run_on_ranks
from tests.support.ranks import error_text


def _named(*sizes: int) -> list[tuple[str, torch.nn.Parameter]]:
    return [(f"p{i}", torch.nn.Parameter(torch.zeros(size))) for i, size in enumerate(sizes)]


@pytest.mark.parametrize(
    ("sizes", "fragments", "expected"),
    [
        ((10, 10, 10, 10), 2, [["p0", "p1"], ["p2", "p3"]]),
        ((30, 3, 60, 4), 2, [["p0", "p1"], ["p2", "p3"]]),
        ((100, 1, 1, 1), 2, [["p0"], ["p1", "p2", "p3"]]),
        ((1, 1, 1, 100), 2, [["p0", "p1", "p2"], ["p3"]]),
        ((5, 5, 5), 3, [["p0"], ["p1"], ["p2"]]),
        ((1,) * 10, 3, [["p0", "p1", "p2"], ["p3", "p4", "p5", "p6"], ["p7", "p8", "p9"]]),
    ],
)
def test_fragments_are_contiguous_and_balanced_by_elements(sizes, fragments, expected) -> None:
    split = split_into_fragments(_named(*sizes), fragments, sync_every=8)
    assert [list(f.names) for f in split] == expected
    assert [f.offset for f in split] == [f * 8 // fragments for f in range(fragments)]


@pytest.mark.parametrize(
    "sizes",
    [(73, 197, 66, 263, 262, 197, 66, 263, 262), (5, 1, 9, 2, 2, 8, 1, 1, 7, 3), (1, 100, 1, 1, 50, 50, 1)],
)
def test_largest_fragment_is_the_smallest_any_split_allows(sizes) -> None:
    """The peak bytes of one exchange: the largest fragment is as small as in the best of all contiguous
    splits into whole parameters (counted by brute force)."""
    for fragments in range(1, len(sizes) + 1):
        split = split_into_fragments(_named(*sizes), fragments, sync_every=8)
        assert [name for f in split for name in f.names] == [f"p{i}" for i in range(len(sizes))]
        assert all(f.params for f in split)
        best = min(
            max(sum(sizes[a:b]) for a, b in itertools.pairwise((0, *cuts, len(sizes))))
            for cuts in itertools.combinations(range(1, len(sizes)), fragments - 1)
        )
        assert max(f.numel() for f in split) == best, (fragments, [f.numel() for f in split])


def test_fragment_schedule_is_staggered() -> None:
    first, second = split_into_fragments(_named(4, 4), 2, sync_every=4)
    assert [t for t in range(1, 13) if first.syncs_at(t)] == [4, 8, 12]
    assert [t for t in range(1, 13) if second.syncs_at(t)] == [2, 6, 10]
    assert not first.syncs_at(0)


def test_more_fragments_than_parameters_are_refused() -> None:
    with pytest.raises(ValueError, match=r"fragments=3, but the model has only 2 trainable parameters"):
        split_into_fragments(_named(4, 4), 3, sync_every=4)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"sync_every": 0}, r"sync_every must be at least 1, got 0"),
        ({"sync_every": 4, "overlap": 4}, r"overlap must be between 0 and sync_every - 1 = 3 .*got 4"),
        ({"sync_every": 4, "overlap": -1}, r"overlap must be between 0"),
        ({"mixing": 1.0}, r"mixing \(Streaming DiLoCo's alpha\) must be in \[0, 1\), got 1.0"),
    ],
)
def test_bad_arguments_are_refused_before_any_collective(options, message) -> None:
    model = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match=message):
        DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.1), **options)


def test_compressor_of_another_kind_is_refused() -> None:
    with pytest.raises(TypeError, match=r"compressor must be None, a hook name .* got int"):
        compressor_hook(3, None)  # type: ignore[arg-type]
    hook = object.__new__(type("H", (), {"__call__": lambda self, s, b: None}))
    assert compressor_hook(("state", hook), None) == (hook, "state")
    assert compressor_hook(lambda: ("made", hook), None) == (hook, "made")


def refused_loads() -> list[str]:
    model = _model_for_load()
    saved = DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.1), sync_every=4).state_dict()
    other = _model_for_load(width=3)
    wrong = [
        (model, {"sync_every": 5}, saved),
        (other, {"sync_every": 4}, saved),
        (model, {"sync_every": 4}, {**saved, "format": "elsewhere/9"}),
        (model, {"sync_every": 4, "compressor": "topk:ratio=0.5"}, saved),
    ]
    texts = []
    for module, options, state in wrong:
        diloco = DiLoCo(module, torch.optim.SGD(module.parameters(), lr=0.1), **options)
        texts.append(error_text(lambda diloco=diloco, state=state: diloco.load_state_dict(state)))
    return texts


def _model_for_load(width: int = 2) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Linear(2, width)


@pytest.mark.timeout(60)
def test_a_state_of_another_setup_or_model_is_refused() -> None:
    setup, model, format_, compressor = run_on_ranks(refused_loads, 1, timeout=45)[0]
    prefix = "ValueError: gradcomm.DiLoCo.load_state_dict: "
    assert setup.startswith(prefix + "it was saved with {'sync_every': 4,"), setup
    assert model.startswith(prefix + "parameter 'weight' has shape (2, 2), here (3, 2)"), model
    assert format_.startswith(prefix + "the state's format is 'elsewhere/9'"), format_
    assert compressor.startswith(prefix + "fragment 0's compressor state was saved without a state"), (
        compressor
    )


def plain_averaging_run() -> tuple[bool, bool]:
    model = _model_for_load()
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    diloco = DiLoCo(model, inner, sync_every=2, outer_lr=1.0, outer_momentum=0.0)
    reference = _model_for_load()
    reference_inner = torch.optim.SGD(reference.parameters(), lr=0.1)
    for _ in range(2):
        for net, optimizer in ((model, diloco), (reference, reference_inner)):
            net(torch.ones(1, 2)).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
    same = all(torch.allclose(a, b) for a, b in zip(model.parameters(), reference.parameters(), strict=True))
    return same, diloco.outer_optimizer.param_groups[0]["nesterov"]


@pytest.mark.timeout(60)
def test_outer_momentum_zero_is_plain_sgd() -> None:
    """``outer_momentum=0`` (plain averaging with ``outer_lr=1``) builds plain SGD: torch refuses Nesterov
    without momentum, and one rank's sync then leaves the inner optimizer's parameters."""
    same, nesterov = run_on_ranks(plain_averaging_run, 1, timeout=45)[0]
    assert same and not nesterov
