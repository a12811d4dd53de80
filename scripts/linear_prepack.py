"""Float32 linear layers of SmolLM2's MLP shape (576 -> 1536, 1 thread) at 1, 8 and 32 rows: plain
``F.linear`` (MKL sgemm, which packs the weight on every call), MKL's pre-packed GEMM
(``torch.ops.mkl._mkl_linear``), oneDNN with a reordered weight (``mkldnn_linear``) and bf16;
microseconds per call (docs/results/main_job.md section 11).

Usage: python scripts/linear_prepack.py
"""
import time

import torch

torch.set_num_threads(1)
K, N = 576, 1536
w = torch.randn(N, K)
w_mkldnn = w.to_mkldnn()
w_bf16 = w.bfloat16()
packed = {m: torch.ops.mkl._mkl_reorder_linear_weight(w, m) for m in (1, 8, 32)}


def bench(fn, x, n: int = 200) -> float:
    for _ in range(10):
        fn(x)
    t = time.perf_counter()
    for _ in range(n):
        fn(x)
    return (time.perf_counter() - t) / n * 1e6


for m in (1, 8, 32):
    x = torch.randn(m, K)
    r = {
        "fp32": bench(lambda x: torch.nn.functional.linear(x, w), x),
        "bf16": bench(lambda x: torch.nn.functional.linear(x.bfloat16(), w_bf16), x),
        "mkldnn_fp32": bench(lambda x: torch._C._nn.mkldnn_linear(x.to_mkldnn(), w_mkldnn, None).to_dense(), x),
        "mkl_prepacked_fp32": bench(lambda x, m=m: torch.ops.mkl._mkl_linear(x, packed[m], w, None, m), x),
    }
    print(f"{m:3d} rows: " + ", ".join(f"{k} {v:.0f} us" for k, v in r.items()))
