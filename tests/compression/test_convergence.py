"""Convergence: every compression method trains the CNN workload nearly as well as plain allreduce.

Setting: ``gradcomm.bench``'s CNN (ten classes of noisy oriented gratings, 284k parameters), 2 ranks, AdamW
(lr 1e-3), 400 steps (200 for the methods of :data:`SHORT`, against allreduce's model after 200), the same seed and data for every method of ``gradcomm.compression.registry`` (a new
one is covered without an edit here), with its default options and error feedback on wherever the method
allows it (signSGD's majority vote does not: a residual of a vote is meaningless), except as set in
:data:`OVERRIDES`: QSGD runs as designed, unbiased and without memory (with error feedback its held-out loss
was 1.84 here, without it 0.005), and random-k runs in its memory-based form (unscaled, Stich et al. 2018;
the unbiased 1/k rescaling is for use without memory) at 5% of coordinates: at 1% its result depends on which
coordinates its seed draws far more than on the code (held-out loss 0.27 to 0.52 over seeds 0-3, measured),
at 5% it was 0.13 to 0.40 over the same
seeds (both measured with the sampler that preceded ``random_subset``).

Margin: held-out cross-entropy at most 0.5 nats above allreduce's. Chance level is ln(10) = 2.30 and
allreduce reaches about 0.01, so 0.5 still means a model that has learned the task (measured worst: random-k,
which updates a few coordinates per step). Figures: benchmarks/RESULTS.md; random-k's seeds:
docs/notes/2026-11-22-first-results.md.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from gradcomm import DistributedDataParallel
from gradcomm.bench.workloads import ConvClassifierWorkload
from gradcomm.compression import ErrorFeedback
from gradcomm.compression.registry import methods
from gradcomm.hooks.registry import register_comm_hook_by_name
from gradcomm.testing import run_on_ranks

pytestmark = pytest.mark.slow  # trains every method to convergence

STEPS = 400
SHORT_STEPS = 200
"""Steps of the methods in :data:`SHORT`, compared with allreduce's model after as many steps."""
SHORT = {"bytegrad", "onebit", "qsgd", "signsgd", "terngrad"}
"""Methods within 0.21 of allreduce's held-out loss after 200 steps (measured at f4561c9; the others were 0.32
to 1.10 above it there, DGC and random-k still 0.76 and 0.39 at 300): trained half as long."""
MARGIN = 0.5
# Options where a method does not run with its defaults plus error feedback wherever it allows it.
OVERRIDES = {
    "randomk": {"ratio": 0.05, "unbiased": False, "error_feedback": True},
    "qsgd": {},
}


def _options(name: str) -> dict:
    if name in OVERRIDES:
        return OVERRIDES[name]
    allows = methods()[name]().error_feedback is not ErrorFeedback.UNSUPPORTED
    return {"error_feedback": True} if allows else {}


# The baseline, then every registered compression method (a new one is covered without an edit here).
METHODS = {"allreduce": {}, **{name: _options(name) for name in methods()}}
# About 30 s per method here: the limit grows with the number of methods, about twice that.
RUN_TIMEOUT = max(580, 60 * len(METHODS))


def train_every_method() -> dict[str, tuple[float, float, bool]]:
    """Each method's held-out loss, accuracy and whether every loss was finite; allreduce's also after
    :data:`SHORT_STEPS` (as ``"allreduce@200"``)."""
    workload = ConvClassifierWorkload()
    results = {}
    for name, options in METHODS.items():
        torch.manual_seed(0)
        ddp = DistributedDataParallel(workload.build_model())
        register_comm_hook_by_name(ddp, name, **options)
        optimizer = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
        finite = True
        for step in range(SHORT_STEPS if name in SHORT else STEPS):
            if name == "allreduce" and step == SHORT_STEPS:
                results[f"allreduce@{SHORT_STEPS}"] = (*workload.evaluate(ddp.module), finite)
            x, y = workload.batch(dist.get_rank(), step)
            loss = workload.loss(ddp(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            finite &= bool(torch.isfinite(loss))
        results[name] = (*workload.evaluate(ddp.module), finite)
    return results


@pytest.mark.timeout(RUN_TIMEOUT + 20)
def test_every_method_converges_within_margin_of_allreduce() -> None:
    assert SHORT <= set(methods()), f"not registered: {SHORT - set(methods())}"
    results = run_on_ranks(train_every_method, 2, timeout=RUN_TIMEOUT)[0]
    baselines = {STEPS: results.pop("allreduce")[0], SHORT_STEPS: results.pop(f"allreduce@{SHORT_STEPS}")[0]}
    for steps, baseline in baselines.items():
        assert baseline < 0.1, f"allreduce itself did not learn the task in {steps} steps: held-out loss {baseline:.3f}"
    failures = []
    for name, (loss, accuracy, finite) in results.items():
        steps = SHORT_STEPS if name in SHORT else STEPS
        if not finite or loss > baselines[steps] + MARGIN:
            failures.append(
                f"{name}: held-out loss {loss:.3f} after {steps} steps, allreduce's {baselines[steps]:.3f} "
                f"(accuracy {accuracy:.3f}), finite losses: {finite}"
            )
    assert not failures, f"more than {MARGIN} above allreduce's held-out loss:\n" + "\n".join(failures)
