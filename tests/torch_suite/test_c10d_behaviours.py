"""The DDP behaviours torch's own c10d tests check on CPU/gloo, checked on gradcomm's DDP beside torch's.

torch's ``test/distributed/test_c10d_gloo.py`` and ``test_c10d_common.py`` hold most of torch's CPU/gloo DDP
coverage but are not installed with torch; :mod:`tests.torch_suite.c10d_checks` restates what their cases
check, in our own code, and runs each check with torch's DDP (the reference) and gradcomm's on 2 gloo ranks.
All checks run once, in one spawned group (:func:`_outcomes`); each check is one test id. Checks that fail
with gradcomm's DDP are strict xfails carrying the first line of what fails, so a fix shows as XPASS.

``MIRRORED`` maps each check to the torch cases it mirrors; ``NOT_MIRRORED`` names the DDP and comm-hook
cases of those files that are not mirrored, with the reason. Cases of both files that build no DDP
(process-group collectives, stores, backends, rendezvous) are out of scope: ``OUT_OF_SCOPE`` lists their
classes. Several mirrored cases are gated on 2 GPUs in torch only because they also build a CUDA replica or
pass ``device_ids``; the behaviour they check does not depend on the device, so it is checked here on CPU. Two
hook cases of ``test_c10d_nccl.py`` (hooks defined inside a test method, capturing the per-rank ``self``) are
mirrored the same way, on CPU over gloo, and so is the unused-parameter error of torch's installed
``distributed_test.py`` (CUDA-gated there).
"""

from __future__ import annotations

import functools

import pytest

from gradcomm.testing import run_on_ranks
from tests.torch_suite.c10d_checks import CHECKS, PASS, REFERENCE, run_checks

GLOO = "test_c10d_gloo.py::DistributedDataParallelTest"
COMMON = "test_c10d_common.py::CommonDistributedDataParallelTest"
BUCKETS = "test_c10d_common.py::ComputeBucketAssignmentTest"
NCCL = "test_c10d_nccl.py::DistributedDataParallelTest"

MIRRORED: dict[str, list[str]] = {
    "cpu_module_matches_local_training": [f"{GLOO}.test_gloo_backend_cpu_module"],
    "cpu_module_matches_local_training_grad_is_view": [f"{GLOO}.test_gloo_backend_cpu_module_grad_is_view"],
    "ignored_output": [f"{GLOO}.test_ignored_output"],
    "ignored_output_with_unused_parameters": [f"{GLOO}.test_ignored_output_with_unused_parameters"],
    "sparse_gradients": [f"{GLOO}.test_sparse_gradients"],
    "sparse_gradients_grad_is_view": [f"{GLOO}.test_sparse_gradients_grad_is_view"],
    "sparse_gradients_with_allreduce_hook": [f"{GLOO}.test_ddp_comm_hook_sparse_gradients"],
    "hook_future_then_value_becomes_gradient": [f"{GLOO}.test_ddp_comm_hook_future_passing_cpu"],
    "hook_in_test_case_allreduce_future": [f"{NCCL}.test_ddp_comm_hook_allreduce_hook_nccl"],
    "hook_in_test_case_allreduce_with_then": [f"{NCCL}.test_ddp_comm_hook_allreduce_with_then_hook_nccl"],
    "hook_not_callable_type_error": [f"{GLOO}.test_ddp_invalid_comm_hook_init"],
    "hook_bucket_annotation_value_error": [f"{GLOO}.test_ddp_invalid_comm_hook_init"],
    "hook_return_annotation_value_error": [f"{GLOO}.test_ddp_invalid_comm_hook_return_type"],
    "hook_returning_non_future_runtime_error": [f"{GLOO}.test_ddp_invalid_comm_hook_return_type"],
    "hook_registered_twice_runtime_error": [f"{GLOO}.test_ddp_comm_hook_register_just_once"],
    "globally_unused_grad_none_locally_unused_reduced": [f"{GLOO}.test_global_local_unused_params_grad"],
    "globally_unused_grad_none_locally_unused_reduced_grad_is_view": [
        f"{GLOO}.test_global_local_unused_params_grad_with_grad_is_view"
    ],
    "globally_unused_grad_none_locally_unused_reduced_static_graph": [
        f"{GLOO}.test_global_local_unused_params_grad_with_static_graph"
    ],
    "unused_on_some_ranks_used_on_others_all_reduced": [
        f"{GLOO}.test_find_unused_parameters_when_unused_parameters_empty"
    ],
    "state_dict_save_load_resumes_exactly": [f"{GLOO}.test_save_load_checkpoint"],
    "checkpointing_once": [f"{COMMON}.test_ddp_checkpointing_once_use_reentrant_True"],
    "checkpointing_once_non_reentrant": [f"{COMMON}.test_ddp_checkpointing_once_use_reentrant_False"],
    "checkpointing_once_static_graph": [f"{COMMON}.test_ddp_checkpointing_once_use_reentrant_True"],
    "checkpointing_once_static_graph_find_unused": [f"{COMMON}.test_ddp_checkpointing_once_use_reentrant_True"],
    "checkpointing_unused_params_reentrant_runtime_error": [
        f"{COMMON}.test_ddp_checkpointing_unused_params_use_reentrant_True"
    ],
    "checkpointing_unused_params_non_reentrant": [
        f"{COMMON}.test_ddp_checkpointing_unused_params_use_reentrant_False"
    ],
    "checkpointing_unused_params_static_graph": [
        f"{COMMON}.test_ddp_checkpointing_unused_params_use_reentrant_True"
    ],
    "checkpointing_twice_reentrant_runtime_error": [f"{COMMON}.test_ddp_checkpointing_twice_use_reentrant_True"],
    "checkpointing_twice_reentrant_find_unused_runtime_error": [
        f"{COMMON}.test_ddp_checkpointing_twice_use_reentrant_True"
    ],
    "checkpointing_twice_non_reentrant": [f"{COMMON}.test_ddp_checkpointing_twice_use_reentrant_False"],
    "checkpointing_twice_static_graph": [f"{COMMON}.test_ddp_checkpointing_twice_static_graph_use_reentrant_True"],
    "checkpointing_dynamic_module": [f"{COMMON}.test_ddp_checkpointing_dynamic_module"],
    "checkpointing_dynamic_weight_sharing": [f"{COMMON}.test_ddp_checkpointing_dynamic_weight_sharing"],
    "checkpointing_whole_model_weight_sharing": [
        f"{COMMON}.test_ddp_checkpointing_weight_sharing_use_reentrant_True"
    ],
    "checkpointing_whole_model_weight_sharing_non_reentrant": [
        f"{COMMON}.test_ddp_checkpointing_weight_sharing_use_reentrant_False"
    ],
    "checkpointing_whole_model_weight_sharing_static_graph": [
        f"{COMMON}.test_ddp_checkpointing_weight_sharing_use_reentrant_True"
    ],
    "checkpointing_twice_weight_sharing_static_graph": [f"{COMMON}.test_ddp_checkpointing_twice_weight_sharing"],
    "two_forwards_one_backward_batchnorm_buffers": [f"{COMMON}.test_ddp_buffer_sync_multi_forward_with_batchnorm"],
    "dataclass_output": [f"{COMMON}.test_dataclass_output"],
    "dataclass_output_unused_param": [f"{COMMON}.test_dataclass_output_unused_param"],
    "invalid_powersgd_state_value_error": [f"{COMMON}.test_invalid_powerSGD_state"],
    "bucket_assignment_single_limit_single_dtype": [f"{BUCKETS}.test_single_limit_single_dtype"],
    "bucket_assignment_single_limit_multi_dtype": [f"{BUCKETS}.test_single_limit_multi_dtype"],
    "bucket_assignment_default_limits_first_bucket_smaller": [
        f"{BUCKETS}.test_multi_limit_single_dtype",
        f"{BUCKETS}.test_multi_limit_multi_dtype",
    ],
    "construction_broadcasts_rank0_state_mixed_dtypes": ["test_c10d_gloo.py::CommTest.test_broadcast_coalesced_gloo_cpu"],
    "unused_parameter_second_iteration_runtime_error": [
        "distributed_test.py::DistributedTest.test_ddp_unused_params_rebuild_buckets_exception"
    ],
}

NOT_MIRRORED: dict[str, str] = {
    f"{GLOO}.test_gloo_backend_1gpu_module_device_ids_integer_list": "needs CUDA (a GPU module per rank)",
    f"{GLOO}.test_gloo_backend_1gpu_module_device_ids_torch_device_list": "needs CUDA (a GPU module per rank)",
    f"{GLOO}.test_gloo_backend_2gpu_module": "needs 4 GPUs (multi-device module); gradcomm takes one device",
    f"{GLOO}.test_gloo_backend_4gpu_module": "needs 8 GPUs (multi-device module); gradcomm takes one device",
    f"{GLOO}.test_ignored_sharded_tensor": "needs CUDA (ShardedTensor on GPUs) and the private "
    "_set_params_and_buffers_to_ignore_for_model",
    f"{GLOO}.test_ddp_comm_hook_future_passing_gpu_gloo": "needs CUDA; its CPU twin is mirrored",
    "test_c10d_gloo.py::ReducerTest (7 cases)": "drive torch's C++ dist.Reducer directly, not a DDP",
    f"{COMMON}.test_sync_batch_norm_only_empty_input": "needs CUDA (SyncBatchNorm's forward is CUDA-only)",
    f"{COMMON}.test_sync_batch_norm_empty_input": "needs CUDA (SyncBatchNorm's forward is CUDA-only)",
    "verify_ddp_error_logged (inside test_ddp_invalid_comm_hook_return_type)": "reads torch's C++ logger "
    "(_get_ddp_logging_data); the error itself is mirrored",
    "_get_ddp_logging_data()['static_graph'] (inside _test_ddp_checkpointing)": "reads torch's C++ logger; "
    "the training it guards is mirrored",
    "_get_ddp_logging_data()['is_multi_device_module'] (inside _test_ddp_with_process_group)": "reads torch's "
    "C++ logger; the training it guards is mirrored",
    "test_c10d_gloo.py::CommTest.test_bool_tensors": "a broadcast of bool tensors; builds no DDP",
}

OUT_OF_SCOPE = [
    "test_c10d_gloo.py: RendezvousEnvTest, TimeoutTest, ProcessGroupGlooTest, ProcessGroupGlooLazyInitTest, "
    "GlooProcessGroupWithDispatchedCollectivesTests, LargeCommTest, CommTest's other (CUDA) cases",
    "test_c10d_common.py: TimeoutTest, BackendEntryPointTest, DefaultBackendTypeTest, AbstractCommTest's "
    "sequence-number/membership/dtype cases, CommTest.test_debug_level, BackendRegistrationTest, "
    "PythonProcessGroupExtensionTest, SplitGroupOptionsTest, ProcessGroupWithDispatchedCollectivesTests, "
    "ReduceOpTest, LocalRankTest, RecordCommTest",
]

GRADCOMM_FAILURES: dict[str, str] = {}
"""Checks that fail with gradcomm's DDP: check name -> the first line of what fails (strict xfails)."""

RUN_TIMEOUT = 240


@functools.lru_cache(maxsize=1)
def _outcomes() -> dict[str, str]:
    """Run every check once on 2 ranks; a check's outcome is the first non-passing rank's, else ``pass``."""
    names = list(CHECKS)
    per_rank = run_on_ranks(run_checks, world_size=2, args=(names,), timeout=RUN_TIMEOUT)
    merged = {}
    for name in names:
        failing = [f"rank {rank}: {outcome[name]}" for rank, outcome in enumerate(per_rank) if outcome[name] != PASS]
        merged[name] = failing[0] if failing else PASS
    return merged


def _check(name: str) -> None:
    outcome = _outcomes()[name]
    assert REFERENCE not in outcome, f"{name}: the check is wrong, torch's own DDP fails it: {outcome}"
    assert outcome == PASS, f"{name} with gradcomm's DDP: {outcome}"


@pytest.mark.slow
@pytest.mark.timeout(RUN_TIMEOUT + 60)
@pytest.mark.parametrize(
    "name",
    [
        pytest.param(name, marks=pytest.mark.xfail(strict=True, reason=GRADCOMM_FAILURES[name]))
        if name in GRADCOMM_FAILURES
        else name
        for name in CHECKS
    ],
)
def test_behaviour(name: str) -> None:
    _check(name)


def test_tables_cover_every_check() -> None:
    """Every check names the torch cases it mirrors, every table entry is a check, no case is in both tables."""
    assert set(MIRRORED) == set(CHECKS), sorted(set(MIRRORED) ^ set(CHECKS))
    assert not set(GRADCOMM_FAILURES) - set(CHECKS), sorted(set(GRADCOMM_FAILURES) - set(CHECKS))
    mirrored_cases = {case for cases in MIRRORED.values() for case in cases}
    assert not mirrored_cases & set(NOT_MIRRORED), sorted(mirrored_cases & set(NOT_MIRRORED))
