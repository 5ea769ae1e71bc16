# SPDX-License-Identifier: Apache-2.0
"""A pytest plugin that appends one line per event to ``$UPSTREAM_CHECK_STATUS_FILE`` as it happens.

Loaded by run_upstream_unit_tests.py with ``-p upstream_status_plugin``. Lines are tab-separated:
``COLLECTED nodeid``, ``COLLECTERROR path message``, ``START nodeid``, ``STATUS nodeid status message``.
Written and flushed at once, so a run that is killed still says which test was running.
"""

import os

_STATUS_FILE = None


def _write(*fields):
    global _STATUS_FILE
    if _STATUS_FILE is None:
        _STATUS_FILE = open(os.environ["UPSTREAM_CHECK_STATUS_FILE"], "a")
    line = "\t".join(str(f).replace("\t", " ").replace("\n", " ") for f in fields)
    _STATUS_FILE.write(line[:2000] + "\n")
    _STATUS_FILE.flush()


def _message(report):
    """One line saying why: the exception line of a failure's traceback (else its first ``E`` line), or a skip's
    reason."""
    if isinstance(report.longrepr, tuple):  # a skip: (path, line, reason)
        return report.longrepr[2]
    text = str(report.longrepr or "")
    errors = [line[1:].strip() for line in text.splitlines() if line.startswith("E ")]
    raised = [line for line in errors if "Error" in line.split(":")[0] or "Exception" in line.split(":")[0]]
    if raised or errors:
        return (raised or errors)[-1 if raised else 0]
    return text.strip().splitlines()[-1] if text.strip() else ""


def _ranks(item):
    """How many processes the test starts: upstream's ``DistributedTest`` classes (``world_size``, or a
    ``world_size`` mark) start that many; 0 for a test that runs in the pytest process."""
    cls = getattr(item, "cls", None)
    if not getattr(cls, "is_dist_test", False):
        return 0
    mark = item.get_closest_marker("world_size")
    size = mark.args[0] if mark is not None and mark.args else getattr(cls, "world_size", 2)
    return max(size) if isinstance(size, (list, tuple)) else size


def pytest_collectreport(report):
    if report.failed:
        _write("COLLECTERROR", report.nodeid, _message(report))


def pytest_collection_finish(session):
    if os.environ.get("UPSTREAM_CHECK_COLLECT_ONLY"):
        for item in session.items:
            _write("COLLECTED", item.nodeid, _ranks(item))


def pytest_runtest_logstart(nodeid, location):
    _write("START", nodeid)


def pytest_runtest_logreport(report):
    if report.when == "call":
        if hasattr(report, "wasxfail"):
            status = "XPASS" if report.passed else "XFAIL"
        else:
            status = report.outcome.upper()
    elif report.failed:
        status = "ERROR"
    elif report.skipped:
        status = "SKIPPED"
    else:
        return
    _write("STATUS", report.nodeid, status, _message(report) if status != "PASSED" else "")
