"""Gradient compression in the style of GRACE: compressor, memory and communicator as separate pieces.

GRACE: Xu et al., "GRACE: A Compressed Communication Framework for Distributed Machine Learning", ICDCS 2021.

* A :class:`~gradcomm.compression.base.Compressor` encodes one tensor into a payload and decodes it
  (one module per method, below).
* A :class:`~gradcomm.compression.memory.Memory` applies error feedback around it.
* A :class:`~gradcomm.compression.communicators.Communicator`, named by the compressor, moves payloads
  between ranks through :mod:`gradcomm.comm`.

:func:`gradcomm.hooks.compression_hook.compressed_allreduce_hook`, with its
:class:`~gradcomm.hooks.compression_hook.CompressionState`, combines them into a DDP communication hook::

    from gradcomm.compression import TopK
    from gradcomm.hooks.compression_hook import CompressionState, compressed_allreduce_hook

    ddp.register_comm_hook(CompressionState(TopK(ratio=0.01)), compressed_allreduce_hook)

Adding a method is one new module in :mod:`gradcomm.compression.methods` with one ``Compressor``
subclass declared with ``name=`` and ``summary=``: ``compress``/``decompress``, a ``communicator``
(:data:`~gradcomm.compression.communicators.ALLREDUCE` if payloads can be summed,
:data:`~gradcomm.compression.communicators.ALLGATHER` otherwise, or an exchange of its own), an
``error_feedback`` policy and, if it draws random numbers,
:class:`~gradcomm.compression.base.RandomizedCompressor` as base. It registers itself
(:mod:`gradcomm.compression.registry`): it is then a hook of the registry, a choice of ``gradcomm bench``,
exported here, and covered by the test suites that parametrise over the registry. A method written for a
whole bucket (:class:`~gradcomm.compression.base.SegmentedCompressor`, every registered one) encodes a bucket's
tensors at once, each with its own statistics (:mod:`gradcomm.compression.segments`), in a number of torch
calls that does not grow with the number of tensors.
"""

from gradcomm.compression.base import (
    Compressor,
    ErrorFeedback,
    RandomizedCompressor,
    RowwiseCompressor,
    SegmentedCompressor,
    SegmentedRowwiseCompressor,
)
from gradcomm.compression.memory import Memory, NoMemory, ResidualMemory
from gradcomm.compression.methods.identity import NoCompression
from gradcomm.compression.registry import methods as _methods

globals().update({method.__name__: method for method in _methods().values()})

__all__ = [
    "Compressor",
    "ErrorFeedback",
    "Memory",
    "NoCompression",
    "NoMemory",
    "RandomizedCompressor",
    "ResidualMemory",
    "RowwiseCompressor",
    "SegmentedCompressor",
    "SegmentedRowwiseCompressor",
    *sorted(method.__name__ for method in _methods().values()),
]
