"""The data-parallel engine: the DDPs, their reducer and buckets, and what keeps replicas in step.

* :mod:`~gradcomm.ddp.distributed`: :class:`DistributedDataParallel`, torch's DDP interface over a Python
  reducer; :mod:`~gradcomm.ddp.legacy`: the explicit, non-overlapping :class:`LegacyDistributedDataParallel`.
* :mod:`~gradcomm.ddp.reducer` (buckets, readiness, launching in order) and :mod:`~gradcomm.ddp.bucketing`
  (which parameters share a bucket): mechanism only, knowing nothing of any particular hook.
* :mod:`~gradcomm.ddp.hook_runner` registers, checks and launches the hook for both DDPs;
  :mod:`~gradcomm.ddp.torch_compat` and :mod:`~gradcomm.ddp.join` are torch's API around the engine.

What the DDPs use but is not the engine lives beside it: the ranks' agreement checks and telemetry in
:mod:`gradcomm.comm` (:mod:`~gradcomm.comm.agreement`, :mod:`~gradcomm.comm.telemetry`), checkpoints in
:mod:`gradcomm.checkpoint`, model averagers in :mod:`gradcomm.hooks.averagers` beside the post-local SGD hook.
The old paths here (``gradcomm.ddp.checkpoint``, ``.averagers``, ``.telemetry``, ``.agreement``,
``.checkpoint_layout``) still import, with a ``DeprecationWarning``.
"""

from gradcomm.ddp.distributed import DistributedDataParallel
from gradcomm.ddp.legacy import LegacyDistributedDataParallel

__all__ = ["DistributedDataParallel", "LegacyDistributedDataParallel"]
