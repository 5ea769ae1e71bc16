# SPDX-License-Identifier: Apache-2.0
"""Peak memory of the boundary-step ops on one flat fp32 partition past 2**31 elements (a probe, one GPU)."""

import sys

import torch

sys.path.insert(0, ".")
from deepspeed.ops.adam import FusedAdam  # noqa: E402

GIB = 2**30
n = int(sys.argv[1]) if len(sys.argv) > 1 else 4_070_000_000
master = torch.nn.Parameter(torch.zeros(n, device="cuda"))
master.grad = torch.full((n, ), 1e-3, device="cuda")
opt = FusedAdam([master], lr=1e-4, weight_decay=0.1)


def probe(name, fn):
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    print(f"{name:<28} extra peak {(torch.cuda.max_memory_allocated() - base) / GIB:7.2f} GiB", flush=True)


probe("vector_norm", lambda: torch.linalg.vector_norm(master.grad, 2.0, dtype=torch.float32))
probe("mul_", lambda: master.grad.mul_(torch.tensor(0.5, device="cuda")))
probe("adam step 1 (state init)", opt.step)
probe("adam step 2", opt.step)
probe("to(bf16) slice 1e8", lambda: master.data.narrow(0, 0, 100_000_000).to(torch.bfloat16))
print("kernel:", {k: opt.param_groups[0].get(k) for k in ("fused", "foreach")})
