# SPDX-License-Identifier: Apache-2.0
"""The gradient contract on NCCL and CUDA: two ranks, one GPU each, bf16 and fp16, ZeRO stages 0, 1 and 2.

Each cell is one ``tests.unit.contract.runner.run_cell`` (the engines train and every gradient and parameter is
compared with the plain-torch reference) with the models, the reference and the batches on the rank's GPU. The
matrix (``tests.gpu.contract_matrix``): the graph shapes x stages 0, 1, 2 x bf16, fp16 x GAS 1, 2 (stages 1 and 2
with ``overlap_comm`` and small buckets), plus optimizer offload to the CPU and the non-overlapped, one-bucket path
on a few shapes. The two ranks are started once per module and run every cell.

* ``python -m pytest tests/gpu`` : one test per cell; skipped without 2 CUDA devices.
* ``python -m tests.gpu.test_nccl_contract [SUBSTRING...]`` : one line per cell (only cells whose id contains one
  of the substrings, if given), then ``N passed, M failed``; exit code 1 if any failed.
* ``DS_GPU_TESTS_ON_CPU=1`` runs the same cells on two CPU ranks over gloo (to check this file without GPUs).
"""

import sys
import time

import pytest

from tests.gpu.contract_matrix import CELLS, ON_CPU, run_matrix, skip_reason

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def matrix_results(request):
    """Runs, once, the cells this pytest session selected (``-k`` applies) on one group of ranks."""
    reason = skip_reason()
    if reason is not None:
        pytest.skip(reason)
    selected = {
        item.callspec.params["cell_id"]
        for item in request.session.items if item.module is request.module and hasattr(item, "callspec")
    }
    return run_matrix([c for c in CELLS if c["id"] in selected])


@pytest.mark.parametrize("cell_id", [c["id"] for c in CELLS])
def test_nccl_contract(matrix_results, cell_id):
    passed, message = matrix_results[cell_id]
    assert passed, f"cell {cell_id} failed:\n{message}"


def main(argv):
    reason = skip_reason()
    if reason is not None:
        print(f"skipped: {reason}")
        print("0 passed, 0 failed")
        return 0
    cells = [c for c in CELLS if not argv or any(s in c["id"] for s in argv)]
    failed = []

    def report(cell_id, passed, message):
        print(f"{'PASS' if passed else 'FAIL'} {cell_id}: {message.splitlines()[0] if passed else ''}", flush=True)
        if not passed:
            failed.append(cell_id)
            print(message, flush=True)

    start = time.perf_counter()
    results = run_matrix(cells, report)
    print(f"{len(results) - len(failed)} passed, {len(failed)} failed ({time.perf_counter() - start:.0f}s, "
          f"{'gloo/CPU' if ON_CPU else 'NCCL/CUDA'})")
    if failed:
        print("failed: " + " ".join(failed))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
