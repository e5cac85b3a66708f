"""A plain PyTorch loop that knows nothing of ftkit or HF Trainer: ftkit cannot see its steps.

``python plain_loop.py SECONDS``: trains a tiny linear model for that long, prints its last loss, exits 0. It first
prints the variables a script reads from its environment (its data directory, the library path of a CUDA install).
"""

import os
import sys
import time

import torch

for name in ("MY_DATA_DIR", "LD_LIBRARY_PATH"):
    print(f"{name}={os.environ.get(name)}", flush=True)
torch.manual_seed(0)
model = torch.nn.Linear(8, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
x, y = torch.randn(64, 8), torch.randn(64, 1)
end = time.monotonic() + float(sys.argv[1])
while time.monotonic() < end:
    loss = torch.nn.functional.mse_loss(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    time.sleep(0.05)
print(f"plain loop done, loss {loss.item():.4f}", flush=True)
