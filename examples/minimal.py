"""The README's minimal example: `torchrun --nproc-per-node 2 examples/minimal.py`."""

import torch
import torch.distributed as dist

import gradcomm
from gradcomm.hooks import default_hooks

dist.init_process_group("gloo")  # torchrun sets RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
torch.manual_seed(0)
target = torch.randn(32, 1)  # the same function to learn on every rank
torch.manual_seed(1 + dist.get_rank())  # each rank its own data; the DDP broadcasts rank 0's parameters
model = gradcomm.DistributedDataParallel(torch.nn.Linear(32, 1))
model.register_comm_hook(None, default_hooks.fp16_compress_hook)  # the one line that changes traffic

optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(20):
    x = torch.randn(64, 32)
    y = x @ target
    loss = torch.nn.functional.mse_loss(model(x), y)
    optimizer.zero_grad()
    loss.backward()  # buckets are reduced by the hook while backward runs
    optimizer.step()

total = model.comm_stats().total
print(f"rank {dist.get_rank()}: loss {loss.item():.4f}, {total.bytes_sent} bytes sent in {total.steps} steps")
dist.destroy_process_group()
