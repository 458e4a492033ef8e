"""The data-parallel engine: the DDPs, their reducer and buckets, and what keeps replicas in step.

* :mod:`~gradcomm.ddp.distributed`: :class:`DistributedDataParallel`, torch's DDP interface over a Python
  reducer; :mod:`~gradcomm.ddp.legacy`: the explicit, non-overlapping :class:`LegacyDistributedDataParallel`.
* :mod:`~gradcomm.ddp.reducer` (buckets, readiness, launching in order) and :mod:`~gradcomm.ddp.bucketing`
  (which parameters share a bucket): mechanism only, knowing nothing of any particular hook.
* :mod:`~gradcomm.ddp.agreement`: the ranks compare their setup and parameters.
* :mod:`~gradcomm.ddp.telemetry`, :mod:`~gradcomm.ddp.checkpoint`, :mod:`~gradcomm.ddp.averagers`: what a
  step cost, all-or-nothing checkpoints, and periodic model averaging for local SGD.
"""

from gradcomm.ddp.distributed import DistributedDataParallel
from gradcomm.ddp.legacy import LegacyDistributedDataParallel

__all__ = ["DistributedDataParallel", "LegacyDistributedDataParallel"]
