"""The compression hook's ``compile=True``: a segmented method's encoding and decoding run through
:func:`torch.compile`, per bucket layout, while the collectives stay outside the compiled code.

A segmented codec is a fixed chain of 45-340 small torch calls per bucket; on a GPU the hook is then bound by
launching them from Python, not by the GPU's work (docs/notes/2026-11-28-gpu-h200-checks.md). Compiling the
chain lets inductor fuse its elementwise passes into a few kernels. It is meant for CUDA: on the CPU the
eager codec is already bound by its passes over memory, and inductor's C++ compilation takes tens of seconds
per graph, so the option is off by default and the CPU stays eager unless asked.

What is compiled: each of a method's four segmented passes (:meth:`~gradcomm.compression.base.
SegmentedCompressor.compress_segments`, ``decompress_segments``, ``aggregate_segments`` and
``residual_segments``) for one bucket layout (one :class:`~gradcomm.compression.segments.Segments` object,
which the hook keeps per layout). The exchange (packing into the wire, the collective, unpacking) and the
error-feedback bookkeeping are not. A method is compiled as it is, graph breaks included: what dynamo cannot
trace (``Tensor.item()``, ``storage_offset()``, operators whose output size depends on the data such as
``nonzero``, the random-stream counters of :class:`~gradcomm.compression.base.RandomizedCompressor`) runs
eagerly between graphs, so every method works; ``benchmarks/bench_compression.py --fuse`` tells what
compiled. The first call of a layout runs eagerly (it fills the layout's cached index tensors, which the
compiled code then reads); the second compiles.

Shapes: ``dynamic=None`` (torch.compile's default). A layout's own shapes never change, so they stay
static; a size that depends on the data (top-k's candidates, after a graph break) becomes dynamic at its
first change, one recompilation. With ``dynamic=False`` such a piece recompiled at every step until dynamo's
recompile limit, then ran eagerly.

Each layout's pass gets a function with its own code object: dynamo keys its cache and its recompile limit
by code object, and a model's bucket layouts would otherwise share eight entries.

Nothing here is state: :class:`CompiledCodec` forwards everything but the four passes to its compressor,
and the hook state saves the compressor's state, so a compiled hook's ``state_dict`` loads into an eager
one and back.
"""

from __future__ import annotations

import functools
import threading
import types
import weakref
from collections.abc import Callable
from typing import Any

import torch

from gradcomm.compression.base import SegmentedCompressor
from gradcomm.compression.segments import Segments

__all__ = ["CompiledCodec", "codec", "eager_under_compile"]

_EAGER_ONCE: Any = object()
"""A layout's pass was run eagerly once (the next call compiles it)."""


_EAGER: list[Any] = []
"""The functions marked by :func:`eager_under_compile` (their one-element holders of the disabled form)."""


def eager_under_compile(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn``, run eagerly where ``torch.compile`` traces it (a graph break around it), as
    ``torch.compiler.disable`` would; the disabled form is made by the first :class:`CompiledCodec`, so that
    importing a method does not import ``torch._dynamo`` (over a second of CPU time) in a process that never
    compiles."""
    disabled: list[Callable[..., Any] | None] = [None]
    _EAGER.append((fn, disabled))

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        eager = disabled[0]
        if eager is not None and torch.compiler.is_compiling():
            return eager(*args, **kwargs)
        return fn(*args, **kwargs)

    return run


def _disable_marked() -> None:
    for fn, disabled in _EAGER:
        if disabled[0] is None:
            disabled[0] = torch.compiler.disable(fn, reason=f"{fn.__qualname__} runs eagerly (eager_under_compile)")


def _own_code(method: Callable[..., Any], name: str) -> Callable[..., Any]:
    """A function calling ``method``, with a code object of its own (``name``, for dynamo's logs)."""

    def call(*args: Any) -> Any:
        return method(*args)

    names = {"co_name": name, **({"co_qualname": name} if hasattr(call.__code__, "co_qualname") else {})}
    code = call.__code__.replace(**names)  # co_qualname: Python 3.11 on
    return types.FunctionType(code, call.__globals__, name, None, call.__closure__)


class CompiledCodec:
    """``compressor`` with its segmented passes compiled per bucket layout (see the module docstring);
    anything else is the compressor's own attribute. The hook hands it to the communicators in the
    compressor's place.

    Args:
        compressor: the segmented method.
        backend, mode, options, dynamic: as for :func:`torch.compile`.
    """

    def __init__(
        self,
        compressor: SegmentedCompressor,
        backend: str | Callable[..., Any] = "inductor",
        mode: str | None = None,
        options: dict[str, Any] | None = None,
        dynamic: bool | None = None,
    ) -> None:
        if not isinstance(compressor, SegmentedCompressor):
            raise TypeError(f"CompiledCodec: needs a SegmentedCompressor, got {type(compressor).__name__}")
        _disable_marked()
        self.compressor = compressor
        self._settings: dict[str, Any] = {"backend": backend, "mode": mode, "options": options, "dynamic": dynamic}
        self._passes: weakref.WeakKeyDictionary[Segments, dict[str, Any]] = weakref.WeakKeyDictionary()
        self._lock = threading.Lock()  # decoding may run on a collective's callback thread

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name in ("compressor", "_settings", "_passes", "_lock"):
            raise AttributeError(name)
        return getattr(self.compressor, name)

    def __repr__(self) -> str:
        return f"CompiledCodec({self.compressor!r})"

    def compress_segments(self, flat: torch.Tensor, segments: Segments) -> Any:
        return self._run("compress_segments", segments, flat, segments)

    def decompress_segments(self, payload: Any, ctx: Any, segments: Segments, out: torch.Tensor | None = None) -> Any:
        return self._run("decompress_segments", segments, payload, ctx, segments, out)

    def aggregate_segments(self, gathered: Any, ctx: Any, segments: Segments, out: torch.Tensor | None = None) -> Any:
        return self._run("aggregate_segments", segments, gathered, ctx, segments, out)

    def residual_segments(self, corrected: torch.Tensor, payload: Any, ctx: Any, segments: Segments) -> Any:
        return self._run("residual_segments", segments, corrected, payload, ctx, segments)

    def _run(self, name: str, segments: Segments, *args: Any) -> Any:
        try:
            return self._pass(name, segments)(*args)
        except torch._dynamo.exc.BackendCompilerFailed as exc:
            method = self.compressor.name or type(self.compressor).__name__
            cause = " ".join([line.strip() for line in str(exc).splitlines() if line.strip()][:2])
            raise RuntimeError(
                f"compression method {method!r} with compile=True: torch.compile failed on its {name} of a "
                f"bucket of {len(segments)} compressed tensors ({cause}); pass compile=False to run it eagerly"
            ) from exc

    def compiled_layouts(self) -> int:
        """How many bucket layouts have at least one pass compiled."""
        with self._lock:
            return sum(any(p is not _EAGER_ONCE for p in passes.values()) for passes in self._passes.values())

    def _pass(self, name: str, segments: Segments) -> Callable[..., Any]:
        method = getattr(self.compressor, name)
        if segments.device.type == "meta":
            return method
        with self._lock:
            passes = self._passes.setdefault(segments, {})
            found = passes.get(name)
            if found is None:
                passes[name] = _EAGER_ONCE
                return method
            if found is _EAGER_ONCE:
                label = f"{self.compressor.name or type(self.compressor).__name__}_{name}_{len(self._passes)}"
                found = passes[name] = torch.compile(_own_code(method, label), **self._settings)
            return found


def codec(compressor: Any, compile: bool) -> Any:
    """What the hook encodes and decodes with: ``compressor`` itself, or with ``compile`` its
    :class:`CompiledCodec`."""
    return CompiledCodec(compressor) if compile else compressor
