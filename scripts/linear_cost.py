"""Seconds per call of one linear layer of SmolLM2's MLP shape (576 -> 1536), bf16 and float32, 1 thread,
for 1 to 64 rows: how much of a forward pass is reading the weights (docs/results/main_job.md section 6).

Usage: python scripts/linear_cost.py
"""
import time

import torch

torch.set_num_threads(1)
for dt in (torch.bfloat16, torch.float32):
    lin = torch.nn.Linear(576, 1536, bias=False).to(dt)
    for M in (1, 2, 5, 8, 16, 30, 64):
        x = torch.randn(M, 576, dtype=dt)
        with torch.inference_mode():
            for _ in range(20):
                lin(x)
            t, n = time.perf_counter(), 200
            for _ in range(n):
                lin(x)
            dtm = (time.perf_counter() - t) / n
        print(dt, M, f"{dtm*1e6:.0f} us", f"{2*M*576*1536/dtm/1e9:.1f} GFLOP/s")
