"""gradcomm: data-parallel training on PyTorch with pluggable gradient communication.

The engine is :class:`DistributedDataParallel`: gradients are grouped into buckets during backward and each
bucket is handed to a communication hook ``hook(state, bucket) -> torch.futures.Future[torch.Tensor]``,
the contract of PyTorch's DDP communication hooks. Hooks live in :mod:`gradcomm.hooks`;
:class:`LegacyDistributedDataParallel` reduces explicitly after backward through the same hooks.
"""

# First, so that an unsupported torch is refused with the fix before any module touches torch's internals.
from gradcomm import _torch_version  # noqa: F401
from gradcomm.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from gradcomm.comm.agreement import RanksDisagreeError
from gradcomm.comm.faults import NonFiniteGradientError, ParameterDriftError, PeerLostError
from gradcomm.ddp.distributed import DistributedDataParallel, ParameterMismatchError
from gradcomm.ddp.legacy import LegacyDistributedDataParallel
from gradcomm.ddp.torch_compat import UnsupportedArgumentError, UnsupportedTorchMethodError
from gradcomm.diloco import DiLoCo
from gradcomm.errors import GradcommError
from gradcomm.hooks.averagers import PeriodicModelAverager
from gradcomm.hooks.contract import CommHookError, CommHookResultError, CommHookTypeError
from gradcomm.hooks.grad_bucket import GradBucket

__all__ = [
    "CheckpointError",
    "CommHookError",
    "CommHookResultError",
    "CommHookTypeError",
    "DiLoCo",
    "DistributedDataParallel",
    "GradBucket",
    "GradcommError",
    "LegacyDistributedDataParallel",
    "NonFiniteGradientError",
    "ParameterDriftError",
    "ParameterMismatchError",
    "PeriodicModelAverager",
    "PeerLostError",
    "RanksDisagreeError",
    "UnsupportedArgumentError",
    "UnsupportedTorchMethodError",
    "load_checkpoint",
    "save_checkpoint",
]

__version__ = "0.1.0"
