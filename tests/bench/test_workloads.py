"""The bench's workloads: what their data is. Single process, no ranks."""

from __future__ import annotations

import pytest
import torch

from gradcomm.bench.workloads import WORKLOADS, TransformerLMWorkload, WholeStdlibLMWorkload


@pytest.fixture(scope="module")
def stdlib() -> WholeStdlibLMWorkload:
    return WholeStdlibLMWorkload()


def test_the_whole_stdlib_is_not_repeated_by_a_long_run(stdlib: WholeStdlibLMWorkload) -> None:
    drawn = 8000 * 2 * stdlib.batch_size * (stdlib.config.block_size + 1)  # 8,000 steps on two ranks
    small = TransformerLMWorkload()
    assert small.held_out_start < drawn  # the 12 modules repeat
    assert stdlib.held_out_start > 3 * drawn, (stdlib.held_out_start, drawn)


def test_its_held_out_text_is_whole_files_never_trained_on(stdlib: WholeStdlibLMWorkload) -> None:
    split = stdlib.held_out_start
    assert 0.9 * len(stdlib.corpus) <= split < len(stdlib.corpus)
    assert stdlib.corpus[split - 1] == ord("\n")  # a file ends where the held-out text begins
    assert stdlib.evaluation_batches == 64  # 8,192 tokens: the 12 modules' workload evaluates on 512
    x, y = stdlib.batch(0, 0)
    assert x.shape == y.shape == (stdlib.batch_size, stdlib.config.block_size)
    assert torch.equal(x[:, 1:], y[:, :-1])
    assert "standard library" in stdlib.data_description()


def test_workloads_are_named_by_their_names() -> None:
    assert list(WORKLOADS) == ["transformer", "transformer-stdlib", "cnn"]
    assert all(WORKLOADS[name].name == name for name in WORKLOADS)
