"""Deprecated: moved to :mod:`gradcomm.checkpoint.save_load`: importing this path warns and gives that module."""

from gradcomm._moved import alias_moved_module

alias_moved_module(__name__, "gradcomm.checkpoint.save_load", advised="gradcomm.checkpoint")
