"""Telling faults apart across ranks, and the errors that report them.

In data-parallel training one rank's fault surfaces on its peers as a failed or timed-out collective. These
helpers decide whether an exception is such a communication failure (a peer died, stalled past the process
group's timeout or failed earlier) and turn it into :class:`PeerLostError`, naming this rank, the step and
the bucket, so the message says what happened where and what to do. The optional numerical checks of
:class:`gradcomm.DistributedDataParallel` report through :class:`NonFiniteGradientError` and
:class:`ParameterDriftError`.
"""

from __future__ import annotations

import datetime
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

from gradcomm.errors import GradcommError

__all__ = [
    "NonFiniteGradientError",
    "ParameterDriftError",
    "PeerLostError",
    "derived_group_timeout",
    "is_communication_failure",
    "lost_contact",
    "process_group_timeout",
    "rank_and_step",
    "reporting_lost_peers",
]


_DistBackendError: type[RuntimeError] = getattr(dist, "DistBackendError", RuntimeError)


class PeerLostError(GradcommError, _DistBackendError):  # type: ignore[misc, valid-type]
    """A collective failed on this rank because a peer died, stalled past the timeout or failed first.

    A ``torch.distributed.DistBackendError`` (so a ``DistError`` and a ``RuntimeError``), what torch raises
    when a backend's collective fails, so code written for torch's DDP catches it.

    Attributes:
        rank: this rank (global).
        step: the synchronised step during which contact was lost (counted from 0), if known.
        where: what was being communicated (``"bucket 2 (hook: ...)"``, ``"broadcasting buffers"``, ...).
    """

    def __init__(self, message: str, rank: int, step: int | None, where: str) -> None:
        super().__init__(message)
        self.rank = rank
        self.step = step
        self.where = where


class NonFiniteGradientError(GradcommError, FloatingPointError, RuntimeError):
    """A gradient held NaN or infinity before it was communicated (``check_finite=True``).

    A ``RuntimeError``, as torch's ``clip_grad_norm_(error_if_nonfinite=True)`` raises for non-finite
    gradients, and a ``FloatingPointError``, as it was before.
    """


class ParameterDriftError(GradcommError, RuntimeError):
    """The ranks' parameters are no longer identical (``check_parameters_every``); raised on every rank."""


# Substrings of the errors gloo and NCCL raise when a peer is gone or a collective timed out. torch 2.13's
# gloo raises plain RuntimeErrors, so the message is all there is to go by.
_COMMUNICATION_FAILURE_MARKERS = (
    "connection closed by peer",
    "connection reset by peer",
    "connection refused",
    "broken pipe",
    "timed out",
    "timeout caused pair closure",
    "socket timeout",
    "nccl communicator was aborted",
    "watchdog caught collective operation timeout",
    "process group has been destroyed",
)


def is_communication_failure(exc: BaseException | None) -> bool:
    """Whether ``exc`` (or an exception it was raised from) is a collective failing for want of a peer.

    True for torch's ``DistError`` family and for the messages gloo and NCCL give when a peer closed its
    connection or a collective passed the process group's timeout, also when a future's callback
    re-raised them.
    """
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, PeerLostError):
            return True
        dist_error = getattr(dist, "DistError", None)
        if dist_error is not None and isinstance(exc, dist_error):
            return True
        text = str(exc).lower()
        if any(marker in text for marker in _COMMUNICATION_FAILURE_MARKERS):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def process_group_timeout(group: Any = None) -> float | None:
    """The timeout in seconds of ``group``'s collectives (``None``: the default group), if it can be read."""
    try:
        pg = group if group is not None else dist.group.WORLD
        for device in ("cpu", "cuda"):
            try:
                return pg._get_backend(torch.device(device)).options._timeout.total_seconds()
            except Exception:
                continue
    except Exception:
        pass
    return None


def derived_group_timeout(group: Any = None) -> datetime.timedelta | None:
    """The ``timeout=`` for a group made from ``group``: ``group``'s own (``None`` where it cannot be read).

    torch gives a new group its backend's default timeout (30 minutes on gloo and NCCL), not the timeout of the
    group it is made from, so without this a rank would wait that long for a hung peer in a derived group.
    """
    seconds = process_group_timeout(group)
    return datetime.timedelta(seconds=seconds) if seconds is not None else None


def _this_rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _describe_error(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def lost_contact(exc: BaseException, step: int | None, where: str, group: Any = None) -> PeerLostError:
    """The :class:`PeerLostError` for communication failure ``exc`` at ``where`` in ``step`` (raise it ``from exc``)."""
    rank = _this_rank()
    timeout = process_group_timeout(group)
    during = f"during step {step}, " if step is not None else "while "
    limit = f"the process group's timeout ({timeout:g} s)" if timeout is not None else "the process group's timeout"
    return PeerLostError(
        f"rank {rank} lost contact with its peers {during}{where}: {_describe_error(exc)}\n"
        f"A peer rank died, stalled for longer than {limit} or failed before it reached this collective; the "
        "other ranks' errors name the cause. This process group cannot be used any more: restart the job "
        "and resume from the last checkpoint (gradcomm.checkpoint.load_checkpoint).",
        rank,
        step,
        where,
    )


@contextmanager
def reporting_lost_peers(step: int | None, where: str, group: Any = None) -> Iterator[None]:
    """Turn a communication failure inside the block into :class:`PeerLostError` naming ``step`` and ``where``."""
    try:
        yield
    except PeerLostError:
        raise
    except Exception as exc:
        if is_communication_failure(exc):
            raise lost_contact(exc, step, where, group) from exc
        raise


def rank_and_step(step: int | None) -> str:
    return f" (rank {_this_rank()}, step {step})" if step is not None else f" (rank {_this_rank()})"
