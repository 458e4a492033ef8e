"""The former home of ``make_ddp``, kept so that imports written before :mod:`tests.support` still resolve;
new code imports from :mod:`tests.support.ranks`."""

from tests.support.ranks import DDP_KINDS, make_ddp

__all__ = ["DDP_KINDS", "make_ddp"]
