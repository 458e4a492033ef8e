"""All-or-nothing checkpoints of a data-parallel run: model, optimizer, hook state and extras, per rank.

* :mod:`~gradcomm.checkpoint.save_load`: :func:`save_checkpoint` and :func:`load_checkpoint`, the protocol
  by which every rank writes its own file and a manifest commits them;
* :mod:`~gradcomm.checkpoint.layout`: the folder's names, the manifest, durable writes.

It needs nothing of the DDPs but their public methods (``state_dict``, ``bucket_layout``).
"""

from gradcomm.checkpoint.layout import CheckpointError
from gradcomm.checkpoint.save_load import (
    FORMAT,
    MANIFEST,
    from_every_rank,
    load_checkpoint,
    rank_file,
    save_checkpoint,
)

__all__ = [
    "FORMAT",
    "MANIFEST",
    "CheckpointError",
    "from_every_rank",
    "load_checkpoint",
    "rank_file",
    "save_checkpoint",
]
