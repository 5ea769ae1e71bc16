# SPDX-License-Identifier: Apache-2.0
"""The cells of the GPU contract matrix and how to run them on one group of two ranks.

A cell is a ``tests.unit.contract.runner.run_cell`` dict (with ``device="cuda"``: the models, the reference and the
batches on the rank's GPU) plus an ``"id"``. ``run_matrix`` starts the ranks once and runs every cell in turn; a
failing cell costs a restart of the ranks (their collectives may be out of step), the other cells still run.
``DS_GPU_TESTS_ON_CPU=1`` runs the same cells on two CPU ranks over gloo (to check this code without GPUs).
"""

import itertools
import os
import time

import torch

# DS_GPU_WORLD=1 runs the matrix on one GPU (no collectives: the world-of-one paths, the CUDA kernels, offload).
WORLD_SIZE = int(os.environ.get("DS_GPU_WORLD", "2"))
CELL_TIMEOUT_S = 120.0
MATRIX_BUDGET_S = float(os.environ.get("DS_GPU_MATRIX_BUDGET_S", "900"))
ON_CPU = os.environ.get("DS_GPU_TESTS_ON_CPU") == "1"

SHAPES = [
    "plain", "unused_param", "two_losses_retained", "ckpt_reentrant", "two_engines_direct", "mixed_submodule_direct",
    "scale_backward"
]
OVERLAP = {"overlap_comm": True, "contiguous_gradients": True}
OFFLOAD = dict(OVERLAP, offload_optimizer={"device": "cpu", "pin_memory": True})
SERIAL = {"overlap_comm": False, "reduce_scatter": False}
UNITS3 = {"stage3_param_persistence_threshold": 0, "stage3_prefetch_bucket_size": 100}
SHAPES3 = [
    "plain", "unused_param_all_ranks", "two_losses_retained", "two_losses_retained_zero_grad", "ckpt_reentrant",
    "ckpt_non_reentrant", "two_engines_direct", "mixed_submodule_direct", "scale_backward", "tied_weights"
]


def _cell(stage, shape, dtype, gas, zero_extra=None, bucket=64, tag=""):
    cell = dict(stage=stage, shape=shape, dtype=dtype, gas=gas, bucket=bucket, device="cpu" if ON_CPU else "cuda")
    if zero_extra:
        cell["zero_extra"] = dict(zero_extra)
    cell["id"] = f"z{stage}-{shape}-{dtype}-gas{gas}{tag}"
    return cell


def contract_cells():
    """Every cell of the GPU matrix, each a ``run_cell`` dict with an extra ``"id"``."""
    cells = []
    for stage, shape, dtype, gas in itertools.product([0, 1, 2], SHAPES, ["bf16", "fp16"], [1, 2]):
        cells.append(_cell(stage, shape, dtype, gas, OVERLAP if stage else None))
    for stage, shape, gas in itertools.product([1, 2], ["plain", "unused_param"], [1, 2]):
        cells.append(_cell(stage, shape, "bf16", gas, OFFLOAD, tag="-offload"))
    cells.append(_cell(2, "plain", "fp16", 2, OFFLOAD, tag="-offload"))
    for stage, shape in itertools.product([1, 2], ["plain", "two_losses_retained"]):
        cells.append(_cell(stage, shape, "bf16", 2, SERIAL, bucket=int(5e8), tag="-serial-onebucket"))
    # deepspeedai/DeepSpeed#8224: an encoder used twice (engine and engine.module), ZeRO-2, overlap, GAS 8
    for shape in ["mixed_submodule", "mixed_submodule_direct"]:
        cells.append(_cell(2, shape, "bf16", 8, OVERLAP, tag="-encoder-twice"))
    for shape, dtype, gas in itertools.product(SHAPES3, ["bf16", "fp16"], [1, 2]):
        cells.append(_cell(3, shape, dtype, gas, UNITS3))
    for shape in ["plain", "ckpt_reentrant", "tied_weights"]:
        cell = _cell(3, shape, "bf16", 2, UNITS3, tag="-zinit")
        cell["zero_init"] = True
        cells.append(cell)
        cells.append(
            _cell(3,
                  shape,
                  "bf16",
                  2,
                  dict(UNITS3,
                       offload_optimizer={
                           "device": "cpu",
                           "pin_memory": True
                       },
                       offload_param={"device": "cpu"}),
                  tag="-offload"))
    return cells


CELLS = contract_cells()


def skip_reason():
    """Why the matrix cannot run here, or None."""
    if ON_CPU:
        return None
    if not torch.cuda.is_available() or torch.cuda.device_count() < WORLD_SIZE:
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        return f"needs {WORLD_SIZE} CUDA devices, found {count}"
    if not torch.distributed.is_nccl_available():
        return "torch.distributed has no NCCL backend"
    return None


def run_matrix_cell(cell):
    """Rank body of one cell: ``run_cell`` without the id; returns (checked steps, seconds)."""
    from tests.unit.contract.runner import run_cell
    cell = {k: v for k, v in cell.items() if k != "id"}
    start = time.perf_counter()
    checked = run_cell(cell)
    if cell["device"] == "cuda":
        torch.cuda.synchronize()
    return checked, time.perf_counter() - start


def run_matrix(cells, on_result=None, budget_s=MATRIX_BUDGET_S):
    """Run ``cells`` on one group of ranks; returns {id: (passed, message)}; ``on_result(id, passed, message)``.

    Cells still waiting when ``budget_s`` has passed, or after the ranks failed to start twice, fail unrun.
    """
    from tests.gpu.workers import RankGroup
    environ = {"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"} if ON_CPU else {"DS_ACCELERATOR": "cuda"}
    group = RankGroup(WORLD_SIZE, "gloo" if ON_CPU else "nccl", environ)
    results = {}
    start_failures = []
    deadline = time.monotonic() + budget_s
    try:
        for cell in cells:
            if len(start_failures) >= 2:
                passed, message = False, f"not run: the ranks failed to start twice; last error:\n{start_failures[-1]}"
            elif time.monotonic() > deadline:
                passed, message = False, f"not run: the matrix used up its {budget_s:.0f}s budget"
            else:
                try:
                    outcomes = group.call(run_matrix_cell, (cell, ), timeout=CELL_TIMEOUT_S)
                except RuntimeError as exc:  # the ranks did not start
                    start_failures.append(str(exc))
                    passed, message = False, str(exc)
                else:
                    passed, message = _judge(outcomes)
            results[cell["id"]] = (passed, message)
            if on_result is not None:
                on_result(cell["id"], passed, message)
    finally:
        group.close()
    return results


def _judge(outcomes):
    if not all(o.ok for o in outcomes):
        return False, "\n".join(o.report() for o in outcomes)
    checked = [o.value[0] for o in outcomes]
    seconds = max(o.value[1] for o in outcomes)
    if not all(c >= 2 for c in checked):
        return False, f"too few checked steps per rank: {checked}"
    return True, f"{min(checked)} steps checked, {seconds:.2f}s"
