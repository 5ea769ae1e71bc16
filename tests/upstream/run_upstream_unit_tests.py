# SPDX-License-Identifier: Apache-2.0
"""Run upstream DeepSpeed's CPU unit tests against an installed ``deepspeed`` and compare two runs.

Upstream's tests are an outside check of drop-in behaviour; their code is upstream's and never lives in this
repository. Given a checkout of upstream's ``tests/`` tree (``<checkout>/tests/unit``, ``tests/pytest.ini``,
``tests/conftest.py``), this runs the tests upstream's CPU workflow runs (``cd tests; pytest --forked unit/``
under upstream's ``pytest.ini`` markers, ``DS_ACCELERATOR=cpu``, gloo) one file at a time, each test in a
forked child with a time limit, and records one status per test:

    python tests/upstream/run_upstream_unit_tests.py run --checkout CHECKOUT --python VENV/bin/python --out DIR
    python tests/upstream/run_upstream_unit_tests.py compare UPSTREAM_DIR OURS_DIR [--markdown]

``run`` needs ``pytest==8.3.5`` (upstream's pin), ``pytest-forked`` and ``pytest-timeout`` importable by the
interpreter (``--pythonpath`` prepends a folder of test-only packages, so the package's own venv stays as it
is). A file that ends early (a hang upstream's harness turns into ``pytest.exit``, or the file's time limit) is
resumed after the last test that started, which is recorded as ``HANG``. ``compare`` prints, of the tests the
first run passed, how many the second passes, overall, per category and per file; the categories that other
parts of the project own are reported beside the figure without them.

Not collected by this repository's pytest run (``testpaths = tests/unit``).
"""

import argparse
import collections
import os
import re
import signal
import subprocess
import sys
import time

PARAMS = re.compile(r"\[.*\]$")
# Worst outcome wins when a test reports twice (a teardown error after a pass).
RANK = {"PASSED": 0, "XPASS": 0, "XFAIL": 1, "SKIPPED": 1, "FAILED": 2, "ERROR": 2, "HANG": 3}
HERE = os.path.dirname(os.path.abspath(__file__))

# Categories: (pattern on the node id, name), the first match wins, so narrower patterns come first. Those in
# OUT_OF_SCOPE are owned by other parts of the project: reported beside the figure, and the figure without them. The
# rest are counted in the figure and named only to read the table.
CATEGORIES = [
    (r"test_ds_config_dict\.py::.*(fp16|loss_scale)|test_precision_config_loss_scale|"
     r"test_precision_config_dynamic_scale|test_ds_config_model|test_zero_optim_overflow|TestCheckOverflow",
     "config/fp16/overflow"),
    (r"ZenFlowSelectiveAdamW_stage3|zenflow/test_zf\.py::.*[\[-]3[-\]]", "zenflow-stage3"),
    (r"zenflow|test_zf_torch_adam|ZenFlow", "zenflow"),
    (r"/pipe/|test_pipe|test_reshape_checkpoint|checkpoint/test_pipeline|test_configurable_parallel_pp|"
     r"test_pipeline_checkpoint", "pipeline"),
    (r"autotp|tensor_parallel|test_tp_|model_parallelism/|module_inject/|test_moe_tp|_tp\.py|AutoTP", "tensor"),
    (r"nvme|_aio|/aio|swap_tensor", "nvme"),
    (r"unit/compile/|unit/v1/compile/", "deepcompile"),
    (r"unit/inference/", "inference"),
    (r"test_autoep", "autoep"),
    (r"sequence|ulysses", "sequence"),
    (r"unit/launcher/", "launcher"),
    (r"unit/checkpoint/", "checkpoint"),
    (r"zero", "zero"),
]
OUT_OF_SCOPE = {"zenflow-stage3", "pipeline", "tensor", "nvme"}

NOT_BUILT = re.compile(r"ModuleNotFoundError: No module named 'deepspeed\.")


def category(nodeid):
    for pattern, name in CATEGORIES:
        if re.search(pattern, nodeid):
            return name
    return "other"


def pytest_env(args, events):
    env = dict(os.environ)
    env.update({
        "DS_ACCELERATOR": "cpu",
        "CUDA_VISIBLE_DEVICES": "",
        # upstream's CPU accelerator counts NUMA nodes as devices unless told the node's process count: without
        # this every test of more than one rank skips on a one-socket machine
        "LOCAL_SIZE": str(args.local_size),
        "DS_UNITTEST_TIMEOUT": str(args.test_timeout),
        "DS_UNITTEST_START_METHOD": args.start_method,
        "HF_HOME": os.path.join(args.out, "hf_home"),
        "TORCH_EXTENSIONS_DIR": os.path.join(args.out, "torch_extensions"),
        "OMP_NUM_THREADS": "1",
        "PYTHONDONTWRITEBYTECODE": "1",
        "UPSTREAM_CHECK_STATUS_FILE": events,
    })
    # as in an activated venv: the tests run the `deepspeed` command
    env["PATH"] = os.pathsep.join([os.path.dirname(args.python), env.get("PATH", "")])
    path = [p for p in (args.pythonpath, HERE, env.get("PYTHONPATH")) if p]
    env["PYTHONPATH"] = os.pathsep.join(path)
    return env


def run_pytest(args, extra, log_path, events, time_limit, env_extra=None):
    """Run pytest in ``<checkout>/tests`` in a session of its own, killed as a whole past ``time_limit``, or when
    one test has run longer than the per-test limit (a hang pytest's own timeout did not end)."""
    cmd = [
        "nice", "-n",
        str(args.nice), args.python, "-m", "pytest", "-p", "no:cacheprovider", "-p", "no:randomly", "-p",
        "upstream_status_plugin", "--forked", f"--timeout={args.test_timeout + 60}", "-rN"
    ] + extra
    env = pytest_env(args, events)
    env.update(env_extra or {})
    per_test = args.test_timeout + 120
    offset = os.path.getsize(events) if os.path.exists(events) else 0
    with open(log_path, "a") as log:
        log.write(f"\n### {' '.join(cmd)}\n")
        log.flush()
        proc = subprocess.Popen(cmd,
                                cwd=os.path.join(args.checkout, "tests"),
                                stdout=log,
                                stderr=subprocess.STDOUT,
                                env=env,
                                start_new_session=True)
        start = time.time()
        running, since = None, start
        try:
            while proc.poll() is None:
                time.sleep(5)
                if os.path.exists(events):
                    with open(events, errors="replace") as f:
                        f.seek(offset)
                        for line in f:
                            fields = line.rstrip("\n").split("\t")
                            if fields[0] == "START":
                                running, since = fields[1], time.time()
                            elif fields[0] == "STATUS" and len(fields) > 1 and fields[1] == running:
                                running = None
                        offset = f.tell()
                now = time.time()
                if now - start > time_limit or (running is not None and now - since > per_test):
                    log.write(f"\n### killed after {now - start:.0f} s (test running: {running})\n")
                    return -signal.SIGKILL
            return proc.returncode
        finally:
            # forked children, process pools and their forkservers share the session: leave none behind
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()


def read_events(path, offset=0):
    """(collected, collect errors, statuses {nodeid: (status, message)}, the last test started without a status)."""
    collected, errors, statuses, started = [], {}, {}, None
    if not os.path.exists(path):
        return collected, errors, statuses, started
    with open(path, errors="replace") as f:
        f.seek(offset)
        for line in f:
            fields = line.rstrip("\n").split("\t")
            kind = fields[0]
            if kind == "COLLECTED":
                collected.append((fields[1], int(fields[2]) if len(fields) > 2 else 0))
            elif kind == "COLLECTERROR":
                errors[fields[1]] = fields[2] if len(fields) > 2 else ""
            elif kind == "START":
                started = fields[1]
            elif kind == "STATUS" and len(fields) >= 3:
                nodeid, status = fields[1], fields[2]
                if RANK[status] >= RANK.get(statuses.get(nodeid, ("", ))[0], -1):
                    statuses[nodeid] = (status, fields[3] if len(fields) > 3 else "")
                if started == nodeid:
                    started = None
    return collected, errors, statuses, started


def sample(collected, per_function, dist_per_class=0):
    """The tests to run, from ``[(nodeid, ranks)]`` in collection order: every test, or (``per_function``) at most
    that many evenly spaced parametrizations of each test function; with ``dist_per_class``, of the tests that
    start processes (``ranks`` > 0) only the first parametrization of the first ``dist_per_class`` test functions
    of each test class."""
    if not per_function:
        return [nodeid for nodeid, _ in collected]
    groups = collections.OrderedDict()
    for nodeid, ranks in collected:
        groups.setdefault(PARAMS.sub("", nodeid), []).append((nodeid, ranks))
    chosen, functions_of_class = set(), collections.Counter()
    for function, group in groups.items():
        if dist_per_class and group[0][1] > 0:
            cls = function.rsplit("::", 1)[0]
            functions_of_class[cls] += 1
            if functions_of_class[cls] <= dist_per_class:
                chosen.add(group[0][0])
            continue
        n = len(group)
        k = min(n, per_function)
        chosen.update(group[(i * (n - 1)) // max(k - 1, 1)][0] for i in range(k))
    return [nodeid for nodeid, _ in collected if nodeid in chosen]


def collect(args):
    """Node ids per file of what upstream's CPU workflow selects (its pytest.ini deselects by marker)."""
    events = os.path.join(args.out, "collect.events")
    for path in (events, os.path.join(args.out, "collect.log")):
        if os.path.exists(path):
            os.remove(path)
    run_pytest(args, ["--collect-only", "-q", "--continue-on-collection-errors"] + (args.paths or ["unit/"]),
               os.path.join(args.out, "collect.log"), events, 1800, {"UPSTREAM_CHECK_COLLECT_ONLY": "1"})
    collected, errors, _, _ = read_events(events)
    wanted = None
    if args.only_passed_in:  # the figure needs only the tests the reference run passes
        wanted = {n for n, (s, _) in load(args.only_passed_in).items() if s in ("PASSED", "XPASS")}
    if args.only:  # a listing of node ids (a rerun of the failures, say)
        listed = {line.rstrip("\n") for line in open(args.only) if line.strip()}
        wanted = listed if wanted is None else wanted & listed
    if args.without:  # categories other parts of the project own
        skip = set(args.without.split(","))
        wanted_before = wanted
        wanted = {n for n, _ in collected if category(n) not in skip}
        wanted = wanted if wanted_before is None else wanted & wanted_before
    if args.categories:  # only these categories, sampled among their own parametrizations
        keep = set(args.categories.split(","))
        collected = [(n, ranks) for n, ranks in collected if category(n) in keep]
    per_file = collections.OrderedDict()
    for nodeid in sample(collected, args.per_function, args.dist_per_class):
        if wanted is not None and nodeid not in wanted:
            continue
        per_file.setdefault(nodeid.split("::")[0], []).append(nodeid)
    return per_file, errors


def run(args):
    os.makedirs(os.path.join(args.out, "logs"), exist_ok=True)
    per_file, errors = collect(args)
    with open(os.path.join(args.out, "sample.txt"), "w") as listing:  # what compare counts
        listing.writelines(f"{nodeid}\n" for nodeids in per_file.values() for nodeid in nodeids)
    total = sum(len(v) for v in per_file.values())
    print(f"{total} tests in {len(per_file)} files, {len(errors)} files that do not collect", flush=True)
    results_path = os.path.join(args.out, "results.tsv")
    done = {n: s for n, s, _ in load_rows(results_path)} if os.path.exists(results_path) else {}
    with open(results_path, "a") as results:

        def record(nodeid, status, message=""):
            done[nodeid] = status
            results.write(f"{nodeid}\t{status}\t{message}\n")
            results.flush()

        for path, message in errors.items():
            if f"{path}::<collection>" not in done:
                record(f"{path}::<collection>", "ERROR", message)
        for path, nodeids in per_file.items():
            todo = [n for n in nodeids if n not in done]
            if not todo:
                continue
            stem = os.path.join(args.out, "logs", path.replace("/", "__"))
            start = time.time()
            while todo:
                offset = os.path.getsize(stem + ".events") if os.path.exists(stem + ".events") else 0
                time_limit = args.file_timeout + (args.test_timeout + 60) * len(todo)
                run_pytest(args, todo, stem + ".log", stem + ".events", time_limit)
                _, _, statuses, started = read_events(stem + ".events", offset)
                for nodeid, (status, message) in statuses.items():
                    if nodeid in todo:
                        record(nodeid, status, message)
                todo = [n for n in nodeids if n not in done]
                if started in todo:  # the test that was running when the file ended
                    record(started, "HANG", "the file ended (or was killed) while it ran")
                elif todo and not statuses:  # nothing ran: record the rest rather than loop
                    for nodeid in todo:
                        record(nodeid, "ERROR", "not run: pytest ended before it")
                todo = [n for n in nodeids if n not in done]
            counts = collections.Counter(done.get(n) for n in nodeids)
            print(f"{path}: {dict(counts)} in {time.time() - start:.0f} s", flush=True)


def load_rows(path):
    for line in open(path, errors="replace"):
        fields = line.rstrip("\n").split("\t")
        yield fields[0], fields[1], fields[2] if len(fields) > 2 else ""


def load(outs):
    """Statuses of one results folder, or of several separated by commas (shards of one run)."""
    return {n: (s, m) for out in outs.split(",") for n, s, m in load_rows(os.path.join(out, "results.tsv"))}


def sampled(outs):
    """The node ids the runs of ``outs`` chose (their ``sample.txt``), or None when a run did not record one."""
    chosen = set()
    for out in outs.split(","):
        path = os.path.join(out, "sample.txt")
        if not os.path.exists(path):
            return None
        chosen.update(line.rstrip("\n") for line in open(path))
    return chosen


def compare(args):
    base, other = load(args.base), load(args.other)
    chosen = sampled(args.base)
    passed = sorted(n for n, (s, _) in base.items() if s in ("PASSED", "XPASS") and (chosen is None or n in chosen))
    by_cat, by_file = collections.defaultdict(lambda: [0, 0]), collections.defaultdict(lambda: [0, 0])
    failing = []
    for nodeid in passed:
        ok = other.get(nodeid, ("NOT RUN", ""))[0] in ("PASSED", "XPASS")
        for table, key in ((by_cat, category(nodeid)), (by_file, nodeid.split("::")[0])):
            table[key][0] += ok
            table[key][1] += 1
        if not ok:
            failing.append((nodeid, ) + other.get(nodeid, ("NOT RUN", "")))

    def figure(cats):
        a = sum(v[0] for k, v in by_cat.items() if k in cats)
        b = sum(v[1] for k, v in by_cat.items() if k in cats)
        return f"{a} of {b} ({100.0 * a / max(b, 1):.1f}%)"

    print(f"tests the first run passes: {len(passed)} (of {len(base)} recorded)")
    print(f"all categories: {figure(set(by_cat))}")
    print(f"without {', '.join(sorted(OUT_OF_SCOPE))}: {figure(set(by_cat) - OUT_OF_SCOPE)}")
    # files that cannot import because a whole deepspeed module (a feature) does not exist in the second run
    absent = {n.split("::")[0] for n, (s, m) in other.items() if n.endswith("::<collection>") and NOT_BUILT.match(m)}
    kept = [n for n in passed if category(n) not in OUT_OF_SCOPE and n.split("::")[0] not in absent]
    ok = sum(other.get(n, ("", ))[0] in ("PASSED", "XPASS") for n in kept)
    print(f"and without the {len(absent)} files that import a deepspeed module the second run does not have: "
          f"{ok} of {len(kept)} ({100.0 * ok / max(len(kept), 1):.1f}%)")
    print("\n| category | pass here | upstream passes |\n| --- | --- | --- |")
    for key in sorted(by_cat):
        print(f"| {key} | {by_cat[key][0]} | {by_cat[key][1]} |")
    if args.files:
        print("\n| file | pass here | upstream passes |\n| --- | --- | --- |")
        for key in sorted(by_file):
            print(f"| {key} | {by_file[key][0]} | {by_file[key][1]} |")
    if args.failing:
        print()
        for nodeid, status, message in failing:
            print(f"{status}\t{category(nodeid)}\t{nodeid}\t{message}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="run upstream's CPU unit tests against the deepspeed PYTHON imports")
    r.add_argument("--checkout", required=True, help="folder holding upstream's tests/ tree")
    r.add_argument("--python", default=sys.executable, help="interpreter whose deepspeed is under test")
    r.add_argument("--pythonpath", default="", help="folder of test-only packages put first on PYTHONPATH")
    r.add_argument("--out", required=True, help="results folder (results.tsv, logs/); a rerun resumes it")
    r.add_argument("--test-timeout", type=int, default=180, help="seconds per test (DS_UNITTEST_TIMEOUT)")
    r.add_argument("--file-timeout", type=int, default=300, help="seconds per file beyond the per-test limits")
    r.add_argument("--nice", type=int, default=19)
    r.add_argument("--local-size", type=int, default=4, help="LOCAL_SIZE: ranks the CPU accelerator offers")
    r.add_argument("--start-method", default="fork", help="DS_UNITTEST_START_METHOD (needs the harness patch)")
    r.add_argument("--per-function",
                   type=int,
                   default=0,
                   help="at most this many evenly spaced parametrizations of each test function (0: all)")
    r.add_argument("--dist-per-class",
                   type=int,
                   default=0,
                   help="of tests that start processes, only the first parametrization of the first N test functions "
                   "of each class (0: as --per-function)")
    r.add_argument("--paths-from", help="a file listing paths under tests/, one a line (a shard of the run)")
    r.add_argument("--only-passed-in", help="results folder(s), comma-separated: run only the tests they passed")
    r.add_argument("--only", help="a file of node ids, one a line: run only those (with --only-passed-in: both)")
    r.add_argument("--without",
                   help="categories to leave out, comma-separated (e.g. " + ",".join(sorted(OUT_OF_SCOPE)) + ")")
    r.add_argument("--categories",
                   help="run only these categories, comma-separated (e.g. " + ",".join(sorted(OUT_OF_SCOPE)) +
                   "); the sample is taken among their tests (a test function's first parametrization in them)")
    r.add_argument("paths", nargs="*", help="paths under tests/ (default: unit/, as upstream's CPU workflow)")
    c = sub.add_parser("compare", help="of the tests BASE passed, how many OTHER passes")
    c.add_argument("base", help="results folder (or folders, comma-separated) of the reference run")
    c.add_argument("other", help="results folder(s) of the run compared with it")
    c.add_argument("--files", action="store_true", help="also per file")
    c.add_argument("--failing", action="store_true", help="also list the tests OTHER does not pass")
    args = parser.parse_args(argv)
    if args.command == "run":
        if args.paths_from:
            args.paths = args.paths + [line.strip() for line in open(args.paths_from) if line.strip()]
        args.out = os.path.abspath(args.out)
        args.checkout = os.path.abspath(args.checkout)
        run(args)
    else:
        compare(args)


if __name__ == "__main__":
    main()
