"""torch's own DDP and communication-hook test cases, run against gradcomm's DistributedDataParallel on gloo.

:mod:`tests.torch_suite.runner` runs cases of the installed
``torch/testing/_internal/distributed/distributed_test.py`` with torch's assertions unchanged, in a fresh
process in which torch's DDP names are gradcomm's; :mod:`tests.torch_suite.cases` selects them and holds the
one table of cases excluded as tests of torch internals. ``benchmarks/torch_suite_report.py`` runs the whole
selection; ``test_torch_suite.py`` runs the CI subset.
"""
