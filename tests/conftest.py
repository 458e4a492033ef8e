"""Shared pytest configuration: the project root on sys.path so spawned ranks can import ``tests.*``, and
``run_on_ranks`` forking ranks from a server that imported torch once (instead of each rank importing it)."""

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

os.environ.setdefault("GRADCOMM_RANKS_START_METHOD", "forkserver")
