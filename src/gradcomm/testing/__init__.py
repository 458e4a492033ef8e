"""Tools for testing distributed code on one machine: local ranks, and shaped networks between them.

* :mod:`~gradcomm.testing.ranks`: :func:`run_on_ranks` runs a function on N local gloo ranks, never hanging;
* :mod:`~gradcomm.testing.network`: network namespaces joined by links with a bandwidth and latency
  (Linux, root), so that communication costs what it would between machines.
"""

from gradcomm.testing.ranks import RankError, free_port, run_on_ranks

__all__ = ["RankError", "free_port", "run_on_ranks"]
