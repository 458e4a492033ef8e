"""``gradcomm bench``: train a real workload once per hook on N ranks and compare them.

:mod:`~gradcomm.bench.workloads` holds the models and data, :mod:`~gradcomm.bench.runner` what each rank
does, :mod:`~gradcomm.bench.launch` starts, watches and ends the local rank processes,
:mod:`~gradcomm.bench.report` the table and files, :mod:`~gradcomm.bench.options` the command line's
arguments and their checks, and :mod:`~gradcomm.bench.cli` runs what passed them.
:mod:`~gradcomm.bench.timing` times DDPs side by side for the scripts under ``benchmarks/``, and
:mod:`~gradcomm.bench.demo` is ``gradcomm demo``, the smallest end-to-end run. All benchmark code lives
here; ``benchmarks/`` holds only the entry scripts and their results (``benchmarks/RESULTS.md``).
"""
