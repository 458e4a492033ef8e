"""Deprecated: split into :mod:`gradcomm.comm.agreement` (the ranks compare a fingerprint and their parameters)
and :mod:`gradcomm.hooks.fingerprint` (what describes a hook); importing this path warns."""

from gradcomm._moved import warn_moved
from gradcomm.comm import agreement as _agreement
from gradcomm.comm.agreement import (  # noqa: F401
    RanksDisagreeError,
    broadcast_coalesced,
    check_same_on_all_ranks,
    check_same_parameters,
)
from gradcomm.hooks import fingerprint as _fingerprint
from gradcomm.hooks.fingerprint import describe_hook, describe_state, hook_fingerprint  # noqa: F401

warn_moved(
    __name__,
    "gradcomm.comm.agreement (RanksDisagreeError, check_same_on_all_ranks, check_same_parameters, "
    "broadcast_coalesced) or gradcomm.hooks.fingerprint (describe_hook, describe_state, hook_fingerprint)",
)


def __getattr__(name: str) -> object:
    """The old module's private helpers, from whichever half now holds them."""
    for module in (_agreement, _fingerprint):
        if hasattr(module, name):
            return getattr(module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
