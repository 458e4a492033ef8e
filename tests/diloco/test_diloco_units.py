"""gradcomm.DiLoCo's pieces: fragments, schedule, argument checks (no process group), and refused loads
(one rank)."""

from __future__ import annotations

import copy
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


def _shaped(*shapes: tuple[int, ...]) -> list[tuple[str, torch.nn.Parameter]]:
    return [(f"p{i}", torch.nn.Parameter(torch.zeros(shape))) for i, shape in enumerate(shapes)]


SHAPES = [
    ((96, 64), (16, 64), (16, 64)),
    ((1024, 256), (256,), (256, 1024), (1024,), (256,), (256,)),  # an MLP block of the bench's transformer
    ((7, 3), (5,), (), (0,), (11, 2, 3), (13,)),  # odd sizes, a scalar, an empty parameter
    ((3,), (2, 50), (1,), (4, 5)),  # rows of 50: three cuts would round to the same boundary
]


@pytest.mark.parametrize("shapes", SHAPES)
@pytest.mark.parametrize("unit", ["row", "element"])
def test_fragments_that_cut_parameters_hold_one_fth_of_the_elements(shapes, unit) -> None:
    """Every element once, in order; by elements each fragment holds N // F or N // F + 1 elements, by rows
    N / F to within a row; a part of whole rows keeps the rows."""
    named = _shaped(*shapes)
    total = sum(p.numel() for _, p in named)
    rows = {name: p.numel() // p.shape[0] if p.dim() >= 2 else 1 for name, p in named}
    for fragments in range(1, 9):
        split = split_into_fragments(named, fragments, sync_every=8, unit=unit)
        laid = [(part.name, i) for f in split for part in f.parts for i in range(part.start, part.stop)]
        assert laid == [(name, i) for name, p in named for i in range(p.numel())]
        assert [name for name, _ in named if not any(part.name == name for f in split for part in f.parts)] == []
        for f in split:
            if unit == "element":
                assert f.numel() in (total // fragments, -(-total // fragments)), (fragments, f.numel())
            else:
                slack = max(rows.values()) + 1
                assert abs(f.numel() - total / fragments) <= slack, (fragments, [g.numel() for g in split])
            for part in f.parts:
                view = part.of(part.param.detach())
                assert view.shape == part.shape and view.numel() == part.numel
                assert view.data_ptr() == part.param.data_ptr() + part.start * part.param.element_size()
                whole_rows = part.start % rows[part.name] == 0 and part.stop % rows[part.name] == 0
                if unit == "row" or (part.param.dim() >= 2 and whole_rows):
                    assert part.shape[1:] == part.param.shape[1:], (part.key, part.shape)
                assert part.key == (part.name if part.whole else f"{part.name}[{part.start}:{part.stop}]")


@pytest.mark.parametrize("unit", ["row", "element", "parameter"])
def test_one_fragment_is_the_whole_model_whatever_the_unit(unit) -> None:
    """Plain DiLoCo (fragments=1) is the same with every unit: one fragment of whole parameters."""
    named = _shaped(*SHAPES[2])
    (only,) = split_into_fragments(named, 1, sync_every=8, unit=unit)
    assert [(part.name, part.start, part.stop) for part in only.parts] == [
        (name, 0, p.numel()) for name, p in named
    ]
    assert all(part.whole and part.shape == part.param.shape for part in only.parts)


def test_a_dominant_tensor_is_cut_where_whole_parameters_cannot() -> None:
    """The bench transformer's case in small: one tensor of 3/4 of the model. Whole parameters leave it in one
    fragment; rows cut it into fragments of exactly N / F."""
    named = _shaped(*SHAPES[0])
    assert [f.numel() for f in split_into_fragments(named, 2, 8, "parameter")] == [6144, 2048]
    for fragments in (2, 4, 8):
        assert [f.numel() for f in split_into_fragments(named, fragments, 8, "row")] == [8192 // fragments] * fragments
    first, second = split_into_fragments(named, 2, 8, "row")
    assert first.names == ("p0[0:4096]",) and second.names == ("p0[4096:6144]", "p1", "p2")
    assert [tuple(part.shape) for part in second.parts] == [(32, 64), (16, 64), (16, 64)]


def test_a_non_contiguous_parameter_is_never_cut() -> None:
    named = [("t", torch.nn.Parameter(torch.zeros(8, 4).t())), ("v", torch.nn.Parameter(torch.zeros(32)))]
    for unit in ("row", "element"):
        first, second = split_into_fragments(named, 2, 8, unit)
        assert first.names == ("t",) and second.names == ("v",), (unit, first.names, second.names)


@pytest.mark.parametrize(
    ("unit", "fragments", "message"),
    [
        ("row", 3, r"fragments=3 cannot each hold at least one row of a model of 8 trainable elements; use "
         r"fewer fragments or fragment_unit='element'"),
        ("element", 9, r"fragments=9 cannot each hold at least one element of a model of 8 trainable elements"),
        ("halves", 2, r"fragment_unit must be one of 'row', 'element', 'parameter', got 'halves'"),
    ],
)
def test_fragments_that_would_be_empty_are_refused(unit, fragments, message) -> None:
    with pytest.raises(ValueError, match=message):
        split_into_fragments(_shaped((2, 4)), fragments, sync_every=4, unit=unit)


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


def _as_written_before_cuts(state: dict) -> dict:
    """A state as DiLoCo wrote it before fragments could cut parameters: format 1, no layout."""
    return {**{k: v for k, v in state.items() if k != "layout"}, "format": "gradcomm.diloco/1"}


def refused_loads() -> list[str]:
    model = _model_for_load()
    saved = DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.1), sync_every=4).state_dict()
    other = _model_for_load(width=3)
    whole = dict(sync_every=4, fragments=2, fragment_unit="parameter")
    halves = DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.1), **whole).state_dict()
    wrong = [
        (model, {"sync_every": 5}, saved),
        (other, {"sync_every": 4}, saved),
        (model, {"sync_every": 4}, {**saved, "format": "elsewhere/9"}),
        (model, {"sync_every": 4, "compressor": "topk:ratio=0.5"}, saved),
        (model, {"sync_every": 4, "fragments": 2}, _as_written_before_cuts(halves)),
        (model, {"sync_every": 4, "fragments": 2}, halves),
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
    setup, model, format_, compressor, before_cuts, layout = run_on_ranks(refused_loads, 1, timeout=45)[0]
    prefix = "ValueError: gradcomm.DiLoCo.load_state_dict: "
    assert setup.startswith(prefix + "it was saved with {'sync_every': 4,"), setup
    assert model.startswith(prefix + "parameter 'weight' has shape (2, 2), here (3, 2)"), model
    assert format_.startswith(prefix + "the state's format is 'elsewhere/9'"), format_
    assert compressor.startswith(prefix + "fragment 0's compressor state was saved without a state"), (
        compressor
    )
    assert before_cuts == (
        prefix + "it was written before fragments could cut parameters (format 'gradcomm.diloco/1'): its "
        "fragments hold whole parameters, as fragment_unit='parameter' splits them, and this DiLoCo's "
        "fragment_unit='row' splits the model otherwise; build the DiLoCo as in the run that saved it"
    ), before_cuts
    assert layout == (
        prefix + "its fragment 0 holds [weight[0:4]], this DiLoCo's (fragment_unit='row') holds [weight[0:2]]; "
        "build the DiLoCo as in the run that saved it"
    ), layout


def states_written_before_cuts() -> dict[str, bool]:
    """Whether a state of format 1 (whole-parameter fragments) loads, and resumes the run it was taken from
    bit for bit: with fragments=1 under every unit, with fragments=2 under fragment_unit='parameter'."""
    out = {}
    for options in (
        {"fragments": 1, "fragment_unit": "row"},
        {"fragments": 1, "fragment_unit": "element"},
        {"fragments": 2, "fragment_unit": "parameter"},
    ):
        runs = []
        for interrupt in (False, True):
            model = _model_for_load(width=4)
            inner = torch.optim.SGD(model.parameters(), lr=0.1)
            diloco = DiLoCo(model, inner, sync_every=2, outer_momentum=0.9, overlap=1, **options)
            for t in range(1, 10):
                if interrupt and t == 4:  # after step 3: overlap=1, fragment 1's exchange is in flight
                    saved = (
                        copy.deepcopy(model.state_dict()),
                        copy.deepcopy(inner.state_dict()),
                        _as_written_before_cuts(diloco.state_dict()),
                    )
                    model = _model_for_load(width=4)
                    inner = torch.optim.SGD(model.parameters(), lr=0.1)
                    diloco = DiLoCo(model, inner, sync_every=2, outer_momentum=0.9, overlap=1, **options)
                    model.load_state_dict(saved[0])
                    inner.load_state_dict(saved[1])
                    diloco.load_state_dict(saved[2])
                model(torch.full((1, 2), float(t))).square().sum().backward()
                diloco.step()
                diloco.zero_grad()
            runs.append([p.detach().clone() for p in model.parameters()])
        out[f"{options['fragments']}-{options['fragment_unit']}"] = all(
            torch.equal(a, b) for a, b in zip(*runs, strict=True)
        )
    return out


@pytest.mark.timeout(60)
def test_a_state_written_before_fragments_cut_parameters_still_resumes() -> None:
    resumed = run_on_ranks(states_written_before_cuts, 1, timeout=45)[0]
    assert resumed == {"1-row": True, "1-element": True, "2-parameter": True}, resumed


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
