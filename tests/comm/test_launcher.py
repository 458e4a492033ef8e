"""The ordered launcher: one launch order on every rank, whichever thread makes a collective ready."""

import threading
from collections.abc import Callable

import pytest
import torch

from gradcomm.comm.launcher import OrderedLauncher


def test_launcher_keeps_reservation_order_across_threads() -> None:
    launcher = OrderedLauncher()
    launched: list[str] = []

    def launch(name: str) -> Callable[[], torch.futures.Future[torch.Tensor]]:
        def start() -> torch.futures.Future[torch.Tensor]:
            launched.append(name)
            future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
            future.set_result(torch.tensor([len(launched)]))
            return future

        return start

    cpu = torch.device("cpu")
    first = launcher.reserve(cpu)  # e.g. bucket 0's Q, waiting for its P
    second = launcher.launch(launch("second"), cpu)  # bucket 1's first collective
    assert launched == [] and not second.done()
    releaser = threading.Thread(target=launcher.release, args=(first, launch("first")))
    releaser.start()
    releaser.join()
    launcher.wait_until_launched()
    assert launched == ["first", "second"]
    assert first.future.wait().item() == 1 and second.wait().item() == 2

    # a slot that cannot be launched stops the launcher: the later ones would pair with the peers' version
    # of the missing collective, so they fail without launching, now and from then on
    blocked = launcher.reserve(cpu)
    after = launcher.launch(launch("after"), cpu)
    launcher.cancel(blocked, RuntimeError("its P failed"))
    with pytest.raises(RuntimeError, match="its P failed"):
        blocked.future.wait()
    for future in (after, launcher.launch(launch("later"), cpu)):
        with pytest.raises(RuntimeError, match=r"collective not launched: an earlier collective of this hook failed "
                           r"on this rank \(RuntimeError: its P failed\)"):
            future.wait()
    launcher.wait_until_launched()  # nothing left waiting
    assert launched == ["first", "second"]

    failing = OrderedLauncher()  # launching itself raises: the same
    broken = failing.launch(lambda: (_ for _ in ()).throw(ConnectionError("peer gone")), cpu)
    with pytest.raises(ConnectionError, match="peer gone"):
        broken.wait()
    with pytest.raises(RuntimeError, match="collective not launched"):
        failing.launch(launch("never"), cpu).wait()
    assert launched == ["first", "second"]


@pytest.mark.timeout(60)
def test_two_stage_exchange_returns_at_once_and_keeps_its_second_stage_in_order(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A compressed two-stage allreduce (ByteGrad): the exchange returns with stage 1 in flight; its all-gather
    is launched from stage 1's completion, before a collective reserved after it (the next bucket's)."""
    from gradcomm import comm
    from gradcomm.compression.memory import NoMemory
    from gradcomm.compression.methods.bytegrad import ByteGrad
    from gradcomm.compression.two_stage import TwoStageAllreduce

    world_size = 2
    launched: list[str] = []
    stage1: torch.futures.Future[torch.Tensor] = torch.futures.Future()

    def all_to_all(
        rows: torch.Tensor, group: object = None, out: torch.Tensor | None = None
    ) -> torch.futures.Future[torch.Tensor]:
        launched.append("all_to_all")
        sent.append(rows)
        received.append(out)
        return stage1

    def all_gather(
        flat: torch.Tensor, group: object = None, out: torch.Tensor | None = None
    ) -> torch.futures.Future[torch.Tensor]:
        launched.append("all_gather")
        gathered = flat.repeat(world_size)  # rank 1's mean taken to be rank 0's: the first half counts
        if out is not None:  # the wire's receive buffer, as the real collective fills it
            gathered = out.copy_(gathered)
        future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        future.set_result(gathered)
        return future

    sent: list[torch.Tensor] = []
    received: list[torch.Tensor | None] = []
    monkeypatch.setattr(comm, "group_size", lambda group=None: world_size)
    monkeypatch.setattr(comm, "group_rank", lambda group=None: 0)
    monkeypatch.setattr(comm, "all_to_all_single", all_to_all)
    monkeypatch.setattr(comm, "all_gather_into_tensor", all_gather)
    communicator, compressor, memory = TwoStageAllreduce(), ByteGrad(), NoMemory()
    gradient = torch.linspace(-1, 1, 1001)
    message = communicator.encode(compressor, "weight", gradient, memory, world_size)
    launcher = OrderedLauncher()
    averaged = communicator.exchange([message], None, memory, launcher)
    next_bucket = launcher.launch(lambda: (launched.append("next bucket"), torch.futures.Future())[1],
                                  torch.device("cpu"))
    assert launched == ["all_to_all"] and not averaged.done() and not next_bucket.done()

    rows = sent[0].view(world_size, -1)[:1].repeat(world_size, 1)  # rank 0 of two identical ranks: its row, twice
    stage1.set_result(rows if received[0] is None else received[0].copy_(rows.view_as(received[0])))
    assert launched == ["all_to_all", "all_gather", "next bucket"]
    (result,) = averaged.wait()
    assert result.shape == gradient.shape
    assert torch.allclose(result[:501], gradient[:501], atol=2 / 127)
