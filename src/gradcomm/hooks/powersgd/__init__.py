"""PowerSGD, split by job: :mod:`.state` (options, per-bucket buffers, checkpoints), :mod:`.kernel` (the
linear algebra) and :mod:`.hook` (what each bucket compresses and the order of its collectives).

The public, torch-compatible import path is :mod:`gradcomm.hooks.powerSGD_hook`.
"""

from gradcomm.hooks.powersgd.hook import batched_powerSGD_hook, powerSGD_hook
from gradcomm.hooks.powersgd.state import PowerSGDState

__all__ = ["PowerSGDState", "batched_powerSGD_hook", "powerSGD_hook"]

# Named by their public, torch-compatible module: in error messages, the ranks' hook fingerprints, and pickles
# (``torch.save(state)``), which then load whatever the internal layout.
for _public in (PowerSGDState, batched_powerSGD_hook, powerSGD_hook):
    _public.__module__ = "gradcomm.hooks.powerSGD_hook"
