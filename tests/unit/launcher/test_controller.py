# SPDX-License-Identifier: Apache-2.0
"""The control channel between the deepspeed command and the node agents, in one process over 127.0.0.1."""

import threading
import time

from deepspeed.launcher.controller import ControllerLink, JobController


def _pump(controller, until, timeout=20.0):
    deadline = time.monotonic() + timeout
    while not until() and time.monotonic() < deadline:
        controller.poll(0.05)
    assert until(), "the controller did not see what it waited for"


def test_failure_stops_the_other_nodes_and_is_named():
    controller = JobController(["h0", "h1", "h2"], bind_addr="127.0.0.1")
    stopped = [threading.Event() for _ in range(3)]
    address = f"127.0.0.1:{controller.port}"
    links = [ControllerLink(address, controller.token, i, f"h{i}", stopped[i].set) for i in range(3)]
    try:
        _pump(controller, controller.all_connected)
        links[1].report_exit(3, 5, stopped=False)
        _pump(controller, lambda: controller.stopping)
        assert stopped[0].wait(10) and stopped[2].wait(10)
        links[0].report_exit(143, None, stopped=True)
        links[2].report_exit(1, 9, stopped=True)
        _pump(controller, controller.all_exited)
        failure = controller.first_failure()
        assert (failure.node, failure.host, failure.rank, failure.exit_code) == (1, "h1", 5, 3)
        assert failure.describe() == "node 1 (h1), rank 5, failed first with exit code 3"
        assert controller.worst_exit_code() == 3  # nodes stopped on request do not count
    finally:
        for link in links:
            link.close()
        controller.close()


def test_lost_node_and_wrong_token():
    controller = JobController(["h0", "h1"], bind_addr="127.0.0.1")
    address = f"127.0.0.1:{controller.port}"
    stopped = threading.Event()
    intruder = ControllerLink(address, "not-the-token", 0, "h0", lambda: None)
    survivor = ControllerLink(address, controller.token, 0, "h0", stopped.set)
    lost = ControllerLink(address, controller.token, 1, "h1", lambda: None)
    try:
        _pump(controller, controller.all_connected)
        lost.close()  # gone without a word: its node agent died
        _pump(controller, lambda: controller.stopping)
        assert stopped.wait(10)
        assert controller.first_failure().node == 1 and "went away" in controller.first_failure().describe()
    finally:
        for link in (intruder, survivor):
            link.close()
        controller.close()


def test_stop_reaches_nodes_that_connect_late():
    controller = JobController(["h0"], bind_addr="127.0.0.1")
    controller.stop_all()
    stopped = threading.Event()
    link = ControllerLink(f"127.0.0.1:{controller.port}", controller.token, 0, "h0", stopped.set)
    try:
        _pump(controller, controller.all_connected)
        assert stopped.wait(10)
    finally:
        link.close()
        controller.close()
