# SPDX-License-Identifier: Apache-2.0
"""How many times one optimizer step reads each page of the NVMe optimizer tier (CPU only, no model).

    python benchmarks/paged_store_reads.py --folder /var/tmp/psr --pages 32 --slots 4 --page-mib 8

Builds a :class:`~deepspeed.runtime.swap_tensor.disk_tier.DiskTier` with the optimizer tier's three fp32 fields
(``fp32``, ``exp_avg``, ``exp_avg_sq``) over ``--pages`` pages and ``--slots`` cache slots (the ``+nvme`` keys give
32 pages of 2**24 elements and ``buffer_count`` 4 slots for the 0.5e9 GPT), writes every page once, then runs
``--steps`` passes, each page taken, given ``--work-ms`` of work standing in for the host Adam op and released dirty
(``flush`` at the end), in one of two orders:

* ``runtime``: ``DiskTier.acquire(page)`` (pin the page, then read ahead past it), what
  ``OptimizerStateSwap.step_range`` and the parameter tier call;
* ``before``: ``read_ahead(page)`` before ``store.acquire(page)``, the order the tiers used until 2026-12-03. Before
  the store kept the pages about to be used out of a read-ahead's evictions, it read the page about to be stepped
  twice (1.88 reads a page: docs/performance.md, "NVMe offload", "Where the time goes").

Printed per order: page reads per pass (1.0 is every page once), the wall time, and which pages were read more than
once.
"""

import argparse
import collections
import os
import shutil
import sys
import time

_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _REPO_ROOT not in sys.path:
    sys.path.insert(0, _REPO_ROOT)
if os.environ.get("NVP_DS_ROOT"):
    sys.path.insert(0, os.path.abspath(os.environ["NVP_DS_ROOT"]))

import torch  # noqa: E402


def run(args, order):
    from deepspeed.runtime.swap_tensor import paged_store
    from deepspeed.runtime.swap_tensor.disk_tier import DiskTier
    from deepspeed.runtime.swap_tensor.swap_config import SwapConfig

    page_numel = args.page_mib * 2**20 // 4
    table = paged_store.PageTable([[(0, page_numel * args.pages)]], page_numel)
    folder = os.path.join(args.folder, f"order_{order}")
    shutil.rmtree(folder, ignore_errors=True)
    config = SwapConfig(nvme_path=args.folder, key="paged_store_reads", page_numel=page_numel, buffer_count=args.slots)
    fields = {"fp32": torch.float32, "exp_avg": torch.float32, "exp_avg_sq": torch.float32}
    tier = DiskTier(config, folder, table, fields)
    store = tier.store
    reads = collections.Counter()
    submit = store._submit

    def counted(write, page, slot):
        if not write:
            reads[page] += 1
        return submit(write, page, slot)

    store._submit = counted  # this instance only
    try:
        for page in range(len(table.pages)):  # every page on disk once (as swap_out does)
            view = store.acquire(page, read=False, modify=True)
            for t in view.fields.values():
                t.fill_(1.0)
            store.release(page, dirty=True)
        store.flush()
        store.drop_cache()
        per_pass = []
        t0 = time.perf_counter()
        for _ in range(args.steps):
            before = sum(reads.values())
            order_pages = list(range(len(table.pages)))
            tier.plan(order_pages)
            for page in order_pages:
                if order == "before":
                    tier.read_ahead(page)
                    view = store.acquire(page, modify=True)
                else:
                    view = tier.acquire(page, modify=True)
                view.fields["fp32"].add_(1.0)
                if args.work_ms:
                    time.sleep(args.work_ms / 1e3)
                store.release(page, dirty=True)
            store.flush()
            per_pass.append(sum(reads.values()) - before)
        wall = time.perf_counter() - t0
    finally:
        tier.close()
    again = sorted(p for p, n in reads.items() if n > args.steps)
    return per_pass, wall, again


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--folder", required=True)
    ap.add_argument("--pages", type=int, default=32)
    ap.add_argument("--slots", type=int, default=4)
    ap.add_argument("--page-mib", type=int, default=8, help="MiB of each field of a page")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--work-ms", type=float, default=5.0)
    ap.add_argument("--order", default="runtime,before")
    args = ap.parse_args(argv)
    os.makedirs(args.folder, exist_ok=True)
    print(f"{args.pages} pages of 3 x {args.page_mib} MiB, {args.slots} slots, {args.steps} passes, "
          f"{args.work_ms} ms of work a page")
    print(
        "| read_ahead | page reads per pass (pages: %d) | reads / pages | wall s | pages read more than once a pass |"
        % args.pages)
    print("| --- | --- | ---: | ---: | --- |")
    for order in args.order.split(","):
        per_pass, wall, again = run(args, order)
        ratio = sum(per_pass) / len(per_pass) / args.pages
        print(f"| {order} acquire | {per_pass} | {ratio:.2f} | {wall:.2f} | {again[:16]}"
              f"{' ...' if len(again) > 16 else ''} |")


if __name__ == "__main__":
    main()
