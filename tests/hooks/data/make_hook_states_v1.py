"""Wrote hook_states_v1.pt, run with gradcomm before the options dataclasses (commit a088c3c):

    git archive a088c3c src | tar -x -C old && PYTHONPATH=old/src python tests/hooks/data/make_hook_states_v1.py OUT

Kept to show what the file holds; tests/hooks/test_hook_options.py loads it with the current code.
"""
import sys

import torch

from gradcomm.hooks.auto_hook import AutoHookState
from gradcomm.hooks.hierarchical_hook import HierarchicalState
from gradcomm.hooks.post_localSGD_hook import PostLocalSGDState
from gradcomm.hooks.powerSGD_hook import PowerSGDState, powerSGD_hook

powersgd = PowerSGDState(None, 2, 10, random_seed=5, use_error_feedback=True)
powersgd.error_dict = {"layer.weight": torch.arange(6.0).view(2, 3)}
powersgd.q_memory_dict = {"layer.weight": torch.ones(3, 2)}
powersgd.parameter_shapes = {"layer.weight": (2, 3)}
powersgd.bucket_layout = [("layer.weight",)]
powersgd.iter, powersgd.total_numel_before_compression, powersgd.total_numel_after_compression = 12, 60, 25
powersgd.rng.randn(7)
post = PostLocalSGDState(None, None, 4, post_local_gradient_allreduce=False)
post.iter = 3
auto = AutoHookState(candidates="allreduce+fp16_compress", error_bound=0.2, trial_steps=2)
hierarchical = HierarchicalState(powerSGD_hook, PowerSGDState(None, 4, 20), 2)
states = {"powersgd": powersgd, "post_localsgd": post, "auto": auto, "hierarchical": hierarchical}
torch.save({"pickled": states, "state_dicts": {k: s.state_dict() for k, s in states.items()}}, sys.argv[1])
