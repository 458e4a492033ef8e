"""Checking that all ranks agree: on a fingerprint of their setup, and on the parameters they hold.

Ranks that register different hooks or options, or bucket differently, would pair unrelated collectives and
hang or silently corrupt. A fingerprint of the setup (plain strings; a hook's part from
:func:`gradcomm.hooks.fingerprint.hook_fingerprint`) is exchanged once with one small collective, and every
rank raises the same :class:`RanksDisagreeError` naming what differs on which ranks.

Replicas that should be identical are compared by :func:`check_same_parameters`: a checksum of every
parameter's bits, one small ``all_gather``, and :class:`~gradcomm.comm.faults.ParameterDriftError` on every
rank if they differ. The DDP runs it every ``check_parameters_every`` steps, the model averagers right
after each averaging.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from gradcomm.comm.collectives import collective_device
from gradcomm.comm.faults import ParameterDriftError
from gradcomm.errors import GradcommError

__all__ = ["RanksDisagreeError", "broadcast_coalesced", "check_same_on_all_ranks", "check_same_parameters"]


class RanksDisagreeError(GradcommError, ValueError, RuntimeError):
    """Ranks registered different hooks, hook options or bucket layouts; raised on every rank alike.

    A ``RuntimeError``, as torch raises for ranks whose models differ, and a ``ValueError``, as it was before.
    """


def check_same_on_all_ranks(fingerprint: Mapping[str, str], group: Any, who: str) -> None:
    """Compare ``fingerprint`` (what must agree, as text) across the ranks of ``group``; a collective.

    Every rank of ``group`` must call it. One ``all_gather_object`` of the fingerprints; if they differ,
    every rank raises the same :class:`RanksDisagreeError`, naming each differing item and which ranks
    have which value.
    """
    world = dist.get_world_size(group)
    if world == 1:
        return
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, dict(fingerprint), group=group)
    global_ranks = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
    keys = list(dict.fromkeys(key for described in everyone for key in described))
    differences = []
    for key in keys:
        by_value: dict[str, list[int]] = {}
        for rank, described in zip(global_ranks, everyone, strict=True):
            by_value.setdefault(described.get(key, "<not set>"), []).append(rank)
        if len(by_value) > 1:
            parts = "; ".join(f"{_ranks(ranks)}: {value}" for value, ranks in by_value.items())
            differences.append(f"  {key} differs: {parts}")
    if differences:
        raise RanksDisagreeError(
            f"{who}: the ranks disagree on how gradients are communicated, so their collectives would not "
            "match (a hang or silently wrong gradients):\n" + "\n".join(differences) + "\n"
            "Every rank must wrap the same model with the same DDP options and register the same hook with "
            "the same options."
        )


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"


# -- the same parameters on every rank -----------------------------------------------------------------------
# Each parameter's bits summed as integers, so the sum does not depend on the order of summation (thread
# count, kernels) and any change of any bit pattern shows; combined modulo a prime.
_CHECKSUM_MODULUS = (1 << 61) - 1
_INT_VIEW = {1: torch.int8, 2: torch.int16}


def _bit_sums(params: Sequence[torch.Tensor]) -> list[int]:
    """Per parameter, the wrapping int32 sum of its elements' bit patterns: changes if any element's bits do."""
    sums = []
    for param in params:
        data = param.detach()
        if data.is_complex():
            data = torch.view_as_real(data)
        view = data.reshape(-1).view(_INT_VIEW.get(data.element_size(), torch.int32))
        sums.append(view.sum(dtype=torch.int32))  # wraps around: order-independent, no int64 copy
    return torch.stack(sums).tolist() if sums else []


def check_same_parameters(
    named_params: Sequence[tuple[str, torch.Tensor]],
    group: Any,
    who: str,
    when: str,
    take_part: bool = True,
    advice: str = "",
) -> None:
    """Raise :class:`~gradcomm.comm.faults.ParameterDriftError` on every rank of ``group`` if the ranks'
    parameters differ in any bit; a collective (every rank calls it with the same parameter list).

    One ``all_gather`` of three integers (a flag and two checksums); only when they differ, a second one
    of a checksum per parameter, to name the first parameter that differs. Ranks calling with
    ``take_part=False`` (a rank that has joined early and keeps stale parameters) are left out of the
    comparison. ``who`` and ``when`` name the check and the moment in the message; ``advice`` is appended.
    """
    names = [name for name, _ in named_params]
    sums = _bit_sums([param for _, param in named_params])
    first = sum(sums) % _CHECKSUM_MODULUS
    weighted = sum((i + 1) * s for i, s in enumerate(sums)) % _CHECKSUM_MODULUS
    world = dist.get_world_size(group)
    device = collective_device(group)
    mine = torch.tensor([int(take_part), first, weighted], dtype=torch.int64, device=device)
    gathered = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(gathered, mine, group=group)
    rows = [row.tolist() for row in gathered]
    compared = [rank for rank in range(world) if rows[rank][0]]
    if not compared:
        return
    reference = compared[0]
    drifted = [rank for rank in compared if rows[rank][1:] != rows[reference][1:]]
    if not drifted:
        return
    mine_all = torch.tensor(sums, dtype=torch.int64, device=device)
    every_sum = [torch.empty_like(mine_all) for _ in range(world)]
    dist.all_gather(every_sum, mine_all, group=group)
    per_rank = [row.tolist() for row in every_sum]
    first_diff = next(
        (names[i] for i in range(len(names)) if any(per_rank[r][i] != per_rank[reference][i] for r in drifted)),
        "?",
    )
    global_ranks = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
    raise ParameterDriftError(
        f"{who}: {when} the parameters of rank(s) {[global_ranks[r] for r in drifted]} differ from rank "
        f"{global_ranks[reference]}'s (first differing parameter: {first_diff!r}). Replicas must stay "
        "identical; something changed parameters on some ranks only (an update outside the DDP, a "
        "rank-dependent re-initialisation, a hook that does not average, a non-deterministic kernel). "
        f"Fix the cause and resume from the last checkpoint.{advice}"
    )


def broadcast_coalesced(tensors: Sequence[torch.Tensor], group: ProcessGroup, src_group_rank: int = 0) -> None:
    """Overwrite ``tensors`` with rank ``src_group_rank``'s values, one broadcast per dtype and device."""
    by_kind: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for tensor in tensors:
        by_kind.setdefault((tensor.dtype, tensor.device), []).append(tensor)
    src = dist.get_global_rank(group, src_group_rank)
    for same_kind in by_kind.values():
        flat = torch._utils._flatten_dense_tensors([t.detach() for t in same_kind])
        dist.broadcast(flat, src=src, group=group)
        with torch.no_grad():
            for tensor, synced in zip(same_kind, torch._utils._unflatten_dense_tensors(flat, same_kind), strict=True):
                tensor.copy_(synced)
