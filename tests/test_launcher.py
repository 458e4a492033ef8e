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
