"""Shared pytest configuration: the project root on sys.path so spawned ranks can import ``tests.*``."""

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
