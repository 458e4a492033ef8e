"""What the test modules share, importable by spawned ranks as ``tests.support.*``.

* :mod:`tests.support.ranks`: where the rank groups run (device, backend, world sizes), the two DDP kinds one
  test body checks, and what a rank hands back to the parent (error texts, counted point-to-point messages);
* :mod:`tests.support.models`: small models every rank builds identically;
* :mod:`tests.support.training`: seeded batches, one training step, parameters and gradients as numpy arrays.
"""
