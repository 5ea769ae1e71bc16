# SPDX-License-Identifier: Apache-2.0
"""One rank of a short training job whose exit must be clean (run by test_clean_exit.py, not by pytest).

``python exit_job.py destroy|keep``: a ZeRO-1 fp32 job on gloo (6 optimizer steps of 2 micro-batches).
With ``destroy`` the script calls ``engine.destroy()`` and ``destroy_process_group()`` itself; with ``keep``
it exits with the process group still alive, as many training scripts do.

Besides the exit code and stderr the test reads, the job checks what makes an exit clean on Linux: no
gloo worker thread (``pt_gloo_runloop``) may still run when the interpreter starts shutting down, since a
worker that releases its last tensors then ends in ``std::terminate``. The check runs from the first
``atexit`` hook registered, so it runs after every hook registered later (deepspeed's included).
"""

import atexit
import os
import sys

EXIT_THREADS_AFTER_DESTROY = 3
EXIT_THREADS_AT_EXIT = 4


def gloo_worker_threads():
    """The number of live gloo worker threads of this process (-1 where /proc is not available)."""
    tasks = f"/proc/{os.getpid()}/task"
    if not os.path.isdir(tasks):
        return -1
    count = 0
    for task in os.listdir(tasks):
        try:
            with open(os.path.join(tasks, task, "comm")) as handle:
                count += handle.read().strip() == "pt_gloo_runloop"
        except OSError:  # the thread ended meanwhile
            pass
    return count


def _check_at_exit():
    alive = gloo_worker_threads()
    if alive > 0:
        sys.stderr.write(f"exit_job: {alive} gloo worker threads still running at interpreter exit\n")
        sys.stderr.flush()
        os._exit(EXIT_THREADS_AT_EXIT)


atexit.register(_check_at_exit)


def main(mode):
    import torch

    import deepspeed
    import deepspeed.comm as dist

    deepspeed.init_distributed()
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 2,
        "optimizer": {
            "type": "AdamW",
            "params": {
                "lr": 1e-3
            }
        },
        "zero_optimization": {
            "stage": 1
        },
    }
    engine, _, _, _ = deepspeed.initialize(model=model, config=config)
    generator = torch.Generator().manual_seed(rank)
    for _ in range(6 * engine.gradient_accumulation_steps()):
        x = torch.randn(4, 16, generator=generator)
        loss = engine(x).square().mean()
        engine.backward(loss)
        engine.step()
    if mode == "destroy":
        engine.destroy()
        dist.destroy_process_group()
        alive = gloo_worker_threads()
        if alive > 0:
            sys.stderr.write(f"exit_job: {alive} gloo worker threads still running after destroy_process_group()\n")
            sys.stderr.flush()
            os._exit(EXIT_THREADS_AFTER_DESTROY)


if __name__ == "__main__":
    main(sys.argv[1])
