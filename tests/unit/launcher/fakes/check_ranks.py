# SPDX-License-Identifier: Apache-2.0
"""The job the end-to-end launcher tests start: one record per rank of what it was given, and an all-reduce.

``check_ranks.py OUT_DIR [FAIL_RANK]``: writes ``OUT_DIR/rank<R>.json``; with ``FAIL_RANK``, every rank writes
its pid to ``OUT_DIR/pid<R>``, then that rank exits 3 while the others wait (to be stopped by the launcher).
"""

import json
import os
import sys
import time

local_rank_args = [a.split("=", 1)[1] for a in sys.argv[1:] if a.startswith("--local_rank=")]
positional = [a for a in sys.argv[1:] if not a.startswith("--local_rank=")]
out_dir = positional[0]
fail_rank = int(positional[1]) if len(positional) > 1 else -1

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import deepspeed  # noqa: E402

deepspeed.init_distributed(dist_backend="gloo", verbose=False)
rank, world_size = dist.get_rank(), dist.get_world_size()
total = torch.tensor([float(rank + 1)])
dist.all_reduce(total)
record = {
    "rank": rank,
    "world_size": world_size,
    "local_rank_env": os.environ.get("LOCAL_RANK"),
    "local_rank_args": local_rank_args,
    "cross_rank": os.environ.get("CROSS_RANK"),
    "all_reduce": total.item(),
}
for key in ("PYTHON_MARK", "DS_FILE_VALUE", "NCCL_MARK", "NOT_EXPORTED"):
    record[key] = os.environ.get(key)
with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as handle:
    json.dump(record, handle)
if fail_rank >= 0:
    with open(os.path.join(out_dir, f"pid{rank}"), "w") as handle:
        handle.write(str(os.getpid()))
    dist.barrier()
    if rank == fail_rank:
        os._exit(3)
    time.sleep(600)
dist.destroy_process_group()
