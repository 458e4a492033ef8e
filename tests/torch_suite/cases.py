"""Which of torch's ``distributed_test`` cases run against gradcomm's DDP, and which are left out and why.

:func:`selected_cases` reads the installed ``torch/testing/_internal/distributed/distributed_test.py`` and
picks every case of ``DistributedTest._DistTestBase`` whose name names a DDP feature (:data:`NAME_PATTERN`)
or which builds a ``DistributedDataParallel``, directly or through one of the class's ``self._helpers``.
:data:`EXCLUDED` is the one table of selected cases we do not run, each with its reason: they test torch
internals (the C++ reducer and logger, ``_get_ddp_logging_data``, profiler event names, fused optimizers,
``torch.compile``), not the behaviour of a DDP. :data:`GRADCOMM_FAILURES` holds the cases measured to fail
with gradcomm's DDP while passing with torch's, with the first line of torch's failing assertion.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import re

NAME_PATTERN = re.compile(
    r"ddp|distributeddataparallel|comm_hook|powersgd|localsgd|join|static_graph|no_sync|uneven|sparse_error",
    re.IGNORECASE,
)

_INTERNAL_LOGGING = "reads torch's C++ logger (_get_ddp_logging_data), which gradcomm's Python reducer does not feed"

EXCLUDED: dict[str, str] = {
    "test_ddp_logging_data_cpu": _INTERNAL_LOGGING,
    "test_ddp_logging_data_gpu": _INTERNAL_LOGGING,
    "test_ddp_comm_hook_logging": _INTERNAL_LOGGING,
    "test_sync_bn_logged": _INTERNAL_LOGGING,
    "test_ddp_python_error_logged": _INTERNAL_LOGGING,
    "test_static_graph_api_cpu": _INTERNAL_LOGGING,
    "test_dump_DDP_relevant_env_vars": "tests torch.nn.parallel.distributed._dump_DDP_relevant_env_vars; builds no DDP",
    "test_compute_bucket_assignment_by_size_sparse_error_without_logger": (
        "tests the C++ dist._compute_bucket_assignment_by_size; builds no DDP"
    ),
    "test_compute_bucket_assignment_by_size_sparse_error_with_logger": (
        "tests the C++ dist._compute_bucket_assignment_by_size with a C++ dist.Logger"
    ),
    "test_verify_model_across_rank_with_logger": "tests the C++ dist._verify_params_across_processes and dist.Logger",
    "test_verify_model_across_rank_without_logger": "tests the C++ dist._verify_params_across_processes",
    "test_ddp_build_debug_param_to_name_mapping": "tests the private _build_debug_param_to_name_mapping of torch's DDP",
    "test_ddp_build_debug_param_to_name_mapping_requires_grad": (
        "tests the private _build_debug_param_to_name_mapping of torch's DDP"
    ),
    "test_ddp_profiling_autograd_profiler": "asserts the profiler event names of torch's C++ reducer",
    "test_ddp_profiling_torch_profiler": "asserts the profiler event names of torch's C++ reducer",
    "test_ddp_profiling_execution_trace": "asserts the execution-trace nodes of torch's C++ reducer",
    "test_ddp_compile_static_graph": "tests torch.compile's DDP optimizer (dynamo) on torch's reducer",
}

# Measured with benchmarks/torch_suite_report.py (each passes with torch's DDP): case -> what fails.
GRADCOMM_FAILURES: dict[str, str] = {}

# The cases CI runs (tests/torch_suite/test_torch_suite.py): every selected, not excluded case that passes
# with gradcomm's DDP on CPU/gloo, 2 ranks.
CI_PASSING: tuple[str, ...] = (
    "test_DistributedDataParallelCPU",
    "test_DistributedDataParallelCPU_grad_is_view",
    "test_DistributedDataParallel_requires_grad",
    "test_accumulate_gradients_no_sync",
    "test_accumulate_gradients_no_sync_grad_is_view",
    "test_accumulate_gradients_no_sync_allreduce_hook",
    "test_accumulate_gradients_no_sync_allreduce_with_then_hook",
    "test_ddp_create_graph",
    "test_grads_same_across_ranks_with_no_sync",
)


@functools.lru_cache(maxsize=1)
def _test_base_methods() -> dict[str, str]:
    """Name -> source lines of every method of the installed ``DistributedTest._DistTestBase``, found without
    importing it (importing needs the environment :mod:`tests.torch_suite.runner` sets)."""
    spec = importlib.util.find_spec("torch.testing._internal.distributed.distributed_test")
    if spec is None or spec.origin is None:
        raise RuntimeError("torch's distributed_test module is not installed with this torch")
    with open(spec.origin) as f:
        source = f.read()
    base = next(
        node for node in ast.walk(ast.parse(source)) if isinstance(node, ast.ClassDef) and node.name == "_DistTestBase"
    )
    lines = source.splitlines(keepends=True)  # once: ast.get_source_segment splits the whole file per call
    return {
        node.name: "".join(lines[node.lineno - 1 : node.end_lineno])
        for node in base.body
        if isinstance(node, ast.FunctionDef)
    }


def _builds_ddp(name: str, methods: dict[str, str], seen: set[str]) -> bool:
    if name in seen or name not in methods:
        return False
    seen.add(name)
    source = methods[name]
    if "DistributedDataParallel" in source:
        return True
    return any(_builds_ddp(helper, methods, seen) for helper in re.findall(r"self\.(_\w+)\(", source))


def selected_cases() -> list[str]:
    """The DDP-related cases of torch's ``distributed_test``, in source order."""
    methods = _test_base_methods()
    return [
        name
        for name in methods
        if name.startswith("test_") and (NAME_PATTERN.search(name) or _builds_ddp(name, methods, set()))
    ]
