# SPDX-License-Identifier: Apache-2.0
"""Stand-ins for ssh, pdsh, srun and mpirun that run every "node" on this machine (no network, no real ssh).

``install(bin_dir)`` writes executables named ``ssh``, ``pdsh``, ``srun`` and ``mpirun`` into ``bin_dir``, each
running this file with its own name. They keep what the tests rely on from the real programs:

* ssh and pdsh run the remote command with ``sh -c`` in a fresh login-like environment (``PATH`` and ``HOME``
  only), so only what the launcher exports reaches the node; ssh exits 255 for a host named in
  ``FAKE_SSH_UNREACHABLE`` and never starts the command for one in ``FAKE_SSH_SILENT``; pdsh replaces ``%n``
  with the host's index and, with ``-S``, exits with the largest status.
* srun hands its whole environment to each task (``--export=ALL``) and adds ``SLURM_PROCID``, ``SLURM_NTASKS``,
  ``SLURM_LOCALID``, ``SLURM_NODEID``, ``SLURMD_NODENAME`` and the node list; with ``--kill-on-bad-exit`` a
  failing task ends the others.
* mpirun (Open MPI's options) gives each task only ``-x`` variables plus ``OMPI_COMM_WORLD_*``, and ends the
  other tasks when one fails, as Open MPI does.
"""

import os
import signal
import subprocess
import sys
import time

FRESH_ENV_KEYS = ("PATH", "HOME")


def install(bin_dir):
    for name in ("ssh", "pdsh", "srun", "mpirun"):
        path = os.path.join(bin_dir, name)
        with open(path, "w") as handle:
            handle.write(f"#!/bin/sh\nexec {sys.executable} {os.path.abspath(__file__)} {name} \"$@\"\n")
        os.chmod(path, 0o755)


def _load_env_module():
    """deepspeed/comm/env.py by path, without importing deepspeed (and torch) into the fake."""
    import importlib.util
    path = os.path.join(os.path.dirname(__file__), "..", "..", "..", "..", "deepspeed", "comm", "env.py")
    spec = importlib.util.spec_from_file_location("_fake_srun_env", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _fresh_env():
    return {key: os.environ[key] for key in FRESH_ENV_KEYS if key in os.environ}


def _wait_all(procs, kill_on_failure):
    """Wait for every process; on the first failure (when asked) terminate the rest. Returns their statuses."""
    codes = [None] * len(procs)
    while any(code is None for code in codes):
        for index, proc in enumerate(procs):
            if codes[index] is None and proc.poll() is not None:
                codes[index] = proc.returncode
                if proc.returncode != 0 and kill_on_failure:
                    for other in procs:
                        if other.poll() is None:
                            other.terminate()
        time.sleep(0.05)
    return [128 - code if code < 0 else code for code in codes]


def _forward_terminate(procs):

    def handler(signum, _frame):
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signum)

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)


def fake_ssh(argv):
    index = 0
    while index < len(argv) and argv[index].startswith("-"):
        index += 2 if argv[index] in ("-o", "-p", "-i", "-l") else 1
    host, command = argv[index], " ".join(argv[index + 1:])
    if host in os.environ.get("FAKE_SSH_UNREACHABLE", "").split(","):
        print(f"ssh: connect to host {host} port 22: Connection refused", file=sys.stderr)
        return 255
    if host in os.environ.get("FAKE_SSH_SILENT", "").split(","):
        time.sleep(3600)  # connected, but the remote command never starts
    os.execve("/bin/sh", ["sh", "-c", command], _fresh_env())


def fake_pdsh(argv):
    hosts, largest, index = [], False, 0
    while argv[index].startswith("-"):
        if argv[index] == "-w":
            hosts = argv[index + 1].split(",")
            index += 2
        elif argv[index] == "-f":
            index += 2
        else:
            largest |= argv[index] == "-S"
            index += 1
    command = " ".join(argv[index:])
    procs = [
        subprocess.Popen(["sh", "-c", command.replace("%n", str(rank)).replace("%h", host)], env=_fresh_env())
        for rank, host in enumerate(hosts)
    ]
    _forward_terminate(procs)
    codes = _wait_all(procs, kill_on_failure=False)
    return max(codes) if largest else 0


def fake_srun(argv):
    ntasks, per_node, nodelist, kill, index = 1, None, "localhost", False, 0
    while argv[index].startswith("-"):
        option, _, value = argv[index].partition("=")
        if option == "-n":
            ntasks, index = int(argv[index + 1]), index + 2
            continue
        if option == "--ntasks-per-node":
            per_node = int(value)
        elif option == "--nodelist":
            nodelist = value
        elif option == "--kill-on-bad-exit":
            kill = value != "0"
        index += 1
    nodes = _load_env_module().expand_hostlist(nodelist)
    per_node = per_node or -(-ntasks // len(nodes))
    procs = []
    for task in range(ntasks):
        node = task // per_node
        env = dict(os.environ,
                   SLURM_PROCID=str(task),
                   SLURM_NTASKS=str(ntasks),
                   SLURM_LOCALID=str(task % per_node),
                   SLURM_NODEID=str(node),
                   SLURM_NNODES=str(len(nodes)),
                   SLURMD_NODENAME=nodes[node],
                   SLURM_STEP_NODELIST=nodelist,
                   SLURM_JOB_NODELIST=nodelist)
        procs.append(subprocess.Popen(argv[index:], env=env))
    _forward_terminate(procs)
    return max(_wait_all(procs, kill_on_failure=kill))


def fake_mpirun(argv):
    ntasks, hosts, per_node, exports, index = 1, ["localhost"], None, {}, 0
    while argv[index].startswith("-"):
        option = argv[index]
        value = argv[index + 1]
        if option in ("-n", "-np"):
            ntasks = int(value)
        elif option in ("--host", "-H"):
            hosts = value.split(",")
        elif option == "--map-by" and value.startswith("ppr:"):
            per_node = int(value.split(":")[1])
        elif option == "-x":
            key, sep, val = value.partition("=")
            exports[key] = val if sep else os.environ.get(key, "")
        index += 2
    per_node = per_node or -(-ntasks // len(hosts))
    procs = []
    for task in range(ntasks):
        env = dict(_fresh_env(), **exports)
        env.update(OMPI_COMM_WORLD_RANK=str(task),
                   OMPI_COMM_WORLD_SIZE=str(ntasks),
                   OMPI_COMM_WORLD_LOCAL_RANK=str(task % per_node),
                   OMPI_COMM_WORLD_LOCAL_SIZE=str(min(per_node, ntasks)),
                   OMPI_COMM_WORLD_NODE_RANK=str(task // per_node))
        procs.append(subprocess.Popen(argv[index:], env=env))
    _forward_terminate(procs)
    codes = _wait_all(procs, kill_on_failure=True)
    return next((code for code in codes if code != 0), 0)


if __name__ == "__main__":
    program = {"ssh": fake_ssh, "pdsh": fake_pdsh, "srun": fake_srun, "mpirun": fake_mpirun}[sys.argv[1]]
    sys.exit(program(sys.argv[2:]))
