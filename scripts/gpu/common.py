"""Helpers shared by the GPU scripts (checks.py, batch_bench.py); run on the GPU machine."""
import time

import torch


def d2d_bandwidth():
    """Device-to-device copy of 4 GiB, bytes read + written per second (the decode roofline's
    denominator), best of 20 after 3 warm-up copies. The buffers are handed back to the driver
    afterwards, so models loaded next have the whole card."""
    n = 1 << 31
    x = torch.empty(n, dtype=torch.bfloat16, device="cuda")
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    best = 1e9
    for _ in range(20):
        torch.cuda.synchronize(); t = time.perf_counter()
        y.copy_(x)
        torch.cuda.synchronize(); best = min(best, time.perf_counter() - t)
    del x, y
    torch.cuda.empty_cache()
    return 2 * n * 2 / best
