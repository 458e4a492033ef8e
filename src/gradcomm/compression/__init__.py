"""Gradient compression in the style of GRACE: compressor, memory and communicator as separate pieces.

GRACE: Xu et al., "GRACE: A Compressed Communication Framework for Distributed Machine Learning", ICDCS 2021.

* A :class:`~gradcomm.compression.base.Compressor` encodes one tensor into a payload and decodes it
  (one module per method, below).
* A :class:`~gradcomm.compression.memory.Memory` applies error feedback around it.
* A :class:`~gradcomm.compression.communicators.Communicator`, named by the compressor, moves payloads
  between ranks through :mod:`gradcomm.comm`.

:func:`gradcomm.hooks.compression_hook.compression_hook` combines them into a DDP communication hook::

    from gradcomm.compression import TopK
    from gradcomm.hooks.compression_hook import compression_hook

    ddp.register_comm_hook(*compression_hook(TopK(ratio=0.01)))

Adding a method is one new module here with one ``Compressor`` subclass: ``compress``/``decompress``, a
``communicator`` (:data:`~gradcomm.compression.communicators.ALLREDUCE` if payloads can be summed,
:data:`~gradcomm.compression.communicators.ALLGATHER` otherwise, or an exchange of its own), an
``error_feedback`` policy and, if it draws random numbers,
:class:`~gradcomm.compression.base.RandomizedCompressor` as base. Nothing else changes; listing it below
only shortens its import.
"""

from gradcomm.compression.base import Compressor, ErrorFeedback, RandomizedCompressor, RowwiseCompressor
from gradcomm.compression.bytegrad import ByteGrad
from gradcomm.compression.efsign import EFSignSGD
from gradcomm.compression.identity import NoCompression
from gradcomm.compression.memory import Memory, NoMemory, ResidualMemory
from gradcomm.compression.onebit import OneBit
from gradcomm.compression.qsgd import QSGD
from gradcomm.compression.randomk import RandomK
from gradcomm.compression.signsgd import SignSGD
from gradcomm.compression.terngrad import TernGrad
from gradcomm.compression.topk import TopK

__all__ = [
    "QSGD",
    "ByteGrad",
    "Compressor",
    "EFSignSGD",
    "ErrorFeedback",
    "Memory",
    "NoCompression",
    "NoMemory",
    "OneBit",
    "RandomK",
    "RandomizedCompressor",
    "ResidualMemory",
    "RowwiseCompressor",
    "SignSGD",
    "TernGrad",
    "TopK",
]
