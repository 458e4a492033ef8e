"""gradcomm: data-parallel training on PyTorch with pluggable gradient communication.

The engine is :class:`DistributedDataParallel`: gradients are grouped into buckets during backward and each
bucket is handed to a communication hook ``hook(state, bucket) -> torch.futures.Future[torch.Tensor]``,
the contract of PyTorch's DDP communication hooks. Hooks live in :mod:`gradcomm.hooks`;
:class:`LegacyDistributedDataParallel` reduces explicitly after backward through the same hooks.
"""

from .agreement import RanksDisagreeError
from .distributed import DistributedDataParallel
from .faults import NonFiniteGradientError, ParameterDriftError, PeerLostError
from .grad_bucket import GradBucket
from .hook_contract import CommHookError
from .legacy import LegacyDistributedDataParallel

__all__ = [
    "CommHookError",
    "DistributedDataParallel",
    "GradBucket",
    "LegacyDistributedDataParallel",
    "NonFiniteGradientError",
    "ParameterDriftError",
    "PeerLostError",
    "RanksDisagreeError",
]

__version__ = "0.1.0"
