"""Integrations of gradcomm with training frameworks, one optional module each.

Each module imports its framework (an optional extra: ``pip install gradcomm[lightning]``) and is imported only
when asked for, e.g. ``from gradcomm.integrations.lightning import GradcommDDPStrategy``; this package imports
nothing itself.
"""
