"""Checking that all ranks agree: on how they communicate, and on the parameters they hold.

Ranks that register different hooks or options, or bucket differently, would pair unrelated collectives and
hang or silently corrupt. A fingerprint of the setup (plain strings) is exchanged once with one small
collective, and every rank raises the same :class:`RanksDisagreeError` naming what differs on which ranks.

Replicas that should be identical are compared by :func:`check_same_parameters`: a checksum of every
parameter's bits, one small ``all_gather``, and :class:`~gradcomm.comm.faults.ParameterDriftError` on every
rank if they differ. The DDP runs it every ``check_parameters_every`` steps, the model averagers right
after each averaging.
"""

from __future__ import annotations

import enum
import functools
import hashlib
import inspect
import sys
import types
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from gradcomm.comm import collective_device
from gradcomm.comm.faults import ParameterDriftError
from gradcomm.errors import GradcommError
from gradcomm.hooks.contract import DEFAULT_HOOK_NAME, hook_name

__all__ = [
    "RanksDisagreeError",
    "check_same_on_all_ranks",
    "check_same_parameters",
    "describe_hook",
    "describe_state",
    "hook_fingerprint",
]


class RanksDisagreeError(GradcommError, ValueError, RuntimeError):
    """Ranks registered different hooks, hook options or bucket layouts; raised on every rank alike.

    A ``RuntimeError``, as torch raises for ranks whose models differ, and a ``ValueError``, as it was before.
    """


_SCALARS = (bool, int, float, str, bytes, type(None), torch.dtype, torch.device, enum.Enum)
_MAX_SEQUENCE = 16
_LIBRARIES = ("torch", "gradcomm")
"""Packages whose code is named without a hash (as the standard library's): every rank runs the same
installed library."""
_HASH_CHARS = 8


def describe_hook(hook: Callable[..., Any] | None, depth: int = 16) -> str:
    """What must agree across ranks about ``hook``: the code it runs, not the data it holds.

    Ranks launch different collectives only if they run different code, so the fingerprint names every
    callable reachable from ``hook`` as ``module.qualname(what it holds)``, followed, for code outside torch,
    gradcomm and the standard library, by ``@`` and a short hash of its code (a function's code object,
    nested functions included; a callable object's class, all its methods). It goes through ``functools.partial`` arguments, closure cells,
    default arguments, the attributes of callable objects (``Wrapper(powerSGD_hook)``), the function of a
    bound method and the callable attributes of its ``self``, and short lists or tuples of callables, down
    to ``depth`` levels. Data (ints, strings, tensors, a rank, a process group) is left out, so a closure
    over per-rank values is accepted, as torch's DDP accepts it. A ``torch.dtype`` is kept: it decides what
    a collective sends (``fp16_compress_wrapper`` and ``bf16_compress_wrapper`` share their code). A cycle
    is cut where it closes, and past :data:`_MAX_NODES` callables only names are given.
    """
    if hook is None:
        return DEFAULT_HOOK_NAME
    return _Walk().describe(hook, depth) or _qualified(hook)


_MAX_NODES = 256


class _Walk:
    """One description: the callables on the current path (to cut cycles) and how many were described."""

    def __init__(self) -> None:
        self.path: set[int] = set()
        self.nodes = 0

    def describe(self, value: Any, depth: int) -> str | None:
        """The code (and dtypes) reachable from ``value`` as text; ``None`` where there is only data."""
        if isinstance(value, torch.dtype):
            return repr(value)
        if isinstance(value, (list, tuple)):
            described = [text for text in (self.describe(item, depth) for item in value[:_MAX_SEQUENCE]) if text]
            return f"[{', '.join(described)}]" if described else None
        if not callable(value) or isinstance(value, (dist.ProcessGroup, torch.Tensor)):
            return None
        if isinstance(value, type):
            return _named(value)
        if id(value) in self.path or depth <= 0 or self.nodes >= _MAX_NODES:
            return _named(value)
        self.nodes += 1
        self.path.add(id(value))
        try:
            return self._node(value, depth)
        finally:
            self.path.discard(id(value))

    def _node(self, value: Any, depth: int) -> str:
        if isinstance(value, functools.partial):
            held = [(str(i), arg) for i, arg in enumerate(value.args)] + sorted(value.keywords.items())
            return self._held(f"functools.partial({self.describe(value.func, depth - 1)})", held, depth)
        if isinstance(value, types.MethodType):  # the function and the class of self, not self's data
            function, owner = value.__func__, value.__self__
            held = _function_held(function) + _callable_attributes(owner, "self.")
            return self._held(_qualified(function), held, depth, _hash(_code_texts(function) + _code_texts(owner)))
        if isinstance(getattr(value, "__code__", None), types.CodeType):
            return self._held(_qualified(value), _function_held(value), depth, _hash(_code_texts(value)))
        if inspect.isroutine(value):  # a builtin or C function: its name is all there is
            return _qualified(value)
        return self._held(_qualified(value), _callable_attributes(value, ""), depth, _hash(_code_texts(value)))

    def _held(self, name: str, held: list[tuple[str, Any]], depth: int, code: str = "") -> str:
        """``name(key=description, ...)@code``, the items that hold only data left out."""
        shown = [(key, self.describe(item, depth - 1)) for key, item in held]
        items = [f"{key}={text}" for key, text in shown if text is not None]
        return (f"{name}({', '.join(items)})" if items else name) + (f"@{code}" if code else "")


def _function_held(function: Any) -> list[tuple[str, Any]]:
    """A function's closure cells and default arguments, by name."""
    code = function.__code__
    held: list[tuple[str, Any]] = []
    for var, cell in zip(code.co_freevars, getattr(function, "__closure__", None) or (), strict=False):
        try:
            held.append((var, cell.cell_contents))
        except ValueError:  # an empty cell
            continue
    defaults = getattr(function, "__defaults__", None) or ()
    positional = code.co_varnames[: code.co_argcount]
    held += list(zip(positional[len(positional) - len(defaults) :], defaults, strict=True))
    held += sorted((getattr(function, "__kwdefaults__", None) or {}).items())
    return held


def _callable_attributes(obj: Any, prefix: str) -> list[tuple[str, Any]]:
    """The instance attributes of ``obj`` that may hold code (callables, lists, tuples) or a dtype, by name."""
    attributes = getattr(obj, "__dict__", None)
    if not isinstance(attributes, Mapping):
        return []
    return [
        (prefix + key, value)
        for key, value in sorted(attributes.items(), key=lambda item: str(item[0]))
        if not str(key).startswith("__") and (callable(value) or isinstance(value, (list, tuple, torch.dtype)))
    ]


def _owner(value: Any) -> Any:
    """The function or class that ``value`` is, or the class of an instance."""
    return value if isinstance(value, type) or inspect.isroutine(value) else type(value)


def _qualified(value: Any) -> str:
    """``module.qualname`` of a function or class, or of an instance's class."""
    owner = _owner(value)
    module = getattr(owner, "__module__", None) or type(owner).__module__
    if module == "__mp_main__":  # the main script as multiprocessing's spawned ranks import it
        module = "__main__"
    return f"{module}.{hook_name(owner)}"


def _named(value: Any) -> str:
    """:func:`_qualified`, then ``@`` and the hash of its code where there is one."""
    code = _hash(_code_texts(value))
    return f"{_qualified(value)}@{code}" if code else _qualified(value)


def _code_texts(value: Any) -> list[str]:
    """The code of a function or class (or an instance's class) outside torch, gradcomm and the standard
    library, which every rank runs alike: none there and for builtins. A class's code is all the methods it
    and its bases outside those libraries define."""
    owner = _owner(value)
    if _in_library(owner):
        return []
    if isinstance(owner, type):
        return _class_code_texts(owner)
    code = getattr(owner, "__code__", None)
    return [_code_text(code)] if isinstance(code, types.CodeType) else []


def _hash(texts: list[str]) -> str:
    return hashlib.sha256("|".join(texts).encode()).hexdigest()[:_HASH_CHARS] if texts else ""


def _in_library(owner: Any) -> bool:
    module = getattr(owner, "__module__", None) or ""
    top = module.split(".", 1)[0]
    return top in _LIBRARIES or top in sys.stdlib_module_names


def _class_code_texts(cls: type) -> list[str]:
    """The code of every function a class and its bases outside torch, gradcomm and builtins define."""
    texts = []
    for klass in cls.__mro__:
        if _in_library(klass):
            continue
        for key, member in sorted(vars(klass).items()):
            function = getattr(member, "__func__", member)  # staticmethod, classmethod
            code = getattr(function, "__code__", None)
            if isinstance(code, types.CodeType):
                texts.append(f"{klass.__qualname__}.{key}:{_code_text(code)}")
    return texts


def _code_text(code: types.CodeType) -> str:
    """What ``code`` does as text, the same in every process: its bytecode, the names and constants it uses
    and the code nested in it; not its file, line numbers or local variable names."""
    consts = ",".join(_const_text(const) for const in code.co_consts)
    shape = (code.co_argcount, code.co_posonlyargcount, code.co_kwonlyargcount, code.co_flags)
    return f"{code.co_code.hex()}|{code.co_names}|{shape}|{consts}"


def _const_text(const: Any) -> str:
    """A constant as text independent of the process: a frozenset's order follows string hashing, which
    differs between processes, so its elements are sorted."""
    if isinstance(const, types.CodeType):
        return f"<{_code_text(const)}>"
    if isinstance(const, frozenset):
        return "{" + ",".join(sorted(_const_text(item) for item in const)) + "}"
    if isinstance(const, tuple):
        return "(" + ",".join(_const_text(item) for item in const) + ")"
    return f"{type(const).__name__}:{const!r}"


def _plain(value: Any) -> str | None:
    """``repr`` of a scalar or a short sequence of scalars; ``None`` for anything else."""
    if isinstance(value, _SCALARS):
        return repr(value)
    if isinstance(value, (list, tuple)) and len(value) <= _MAX_SEQUENCE and all(isinstance(v, _SCALARS) for v in value):
        return repr(value)
    return None


def describe_state(state: Any, depth: int = 1) -> str:
    """A hook state's options as text: its public attributes holding plain values (numbers, strings, short
    tuples of them), one level into attribute objects (a compressor). Tensors, buffers and process groups
    are left out; a process group is described by its size.

    A state class may define ``comm_hook_fingerprint() -> str`` to say itself what must agree across ranks
    (for states that keep rank-specific plain values).
    """
    if state is None:
        return "None"
    custom = getattr(state, "comm_hook_fingerprint", None)
    if callable(custom):
        return str(custom())
    if isinstance(state, dist.ProcessGroup):
        return f"a process group of {state.size()} ranks"
    plain = _plain(state)
    if plain is not None:
        return plain
    attributes = getattr(state, "__dict__", None)
    if not isinstance(attributes, Mapping):
        return type(state).__qualname__
    fields = []
    for key in sorted(attributes):
        if key.startswith("_"):
            continue
        value = attributes[key]
        text = _plain(value)
        if text is None and depth > 0 and hasattr(value, "__dict__") and not isinstance(value, torch.Tensor):
            if isinstance(value, dist.ProcessGroup) or callable(value):
                continue
            text = describe_state(value, depth - 1)
        if text is not None:
            fields.append(f"{key}={text}")
    return f"{type(state).__qualname__}({', '.join(fields)})"


def hook_fingerprint(hook: Callable[..., Any] | None, state: Any) -> dict[str, str]:
    """The hook's part of a setup fingerprint: its qualified name and its state's plain options."""
    return {"hook": describe_hook(hook), "hook options": describe_state(state) if hook is not None else "-"}


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
