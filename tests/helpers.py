"""The former home of the shared test helpers, kept so that imports written before :mod:`tests.support` still
resolve; new code imports from :mod:`tests.support.ranks`, ``.models`` and ``.training``."""

from tests.support.models import HeadFirst
from tests.support.ranks import (
    TEST_BACKEND,
    TEST_DEVICE,
    counting_point_to_point,
    error_text,
    world_sizes_to_test,
)
from tests.support.training import flat_parameters

__all__ = [
    "TEST_BACKEND",
    "TEST_DEVICE",
    "HeadFirst",
    "counting_point_to_point",
    "error_text",
    "flat_parameters",
    "world_sizes_to_test",
]
