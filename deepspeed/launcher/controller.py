# SPDX-License-Identifier: Apache-2.0
"""The job controller: one TCP line protocol between the ``deepspeed`` command and the node agent on every node.

Whatever starts the nodes (ssh, pdsh, mpirun, srun), each node agent (``deepspeed.launcher.launch``) connects back
to the command that started it and says ``hello``; when its workers end it says ``exit`` with the exit code and the
rank that failed first. The controller's answer to a failure, a lost node or Ctrl-C is ``stop`` to every node,
whose agent then stops its workers. A node agent whose controller goes away stops too, so no process outlives the
command. Messages are JSON objects, one per line, each carrying the job's token; a connection with another token
is dropped.

Note: the transports' own ways of stopping (pdsh cannot forward stdin, closing an ssh client does not always end
the remote command, MPI and Slurm each have their own) differ too much to be relied on; this channel is the same
for all of them, and torchrun's rendezvous store is left to torchrun.
"""

import json
import os
import secrets
import selectors
import socket
import sys
import threading
import time
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

HELLO = "hello"
EXIT = "exit"
STOP = "stop"
CONNECT_TIMEOUT_S = 30.0
# Exit status of a node whose workers were stopped on request (128 + SIGTERM, as a shell reports it).
STOPPED_EXIT_CODE = 143


def new_token() -> str:
    return secrets.token_hex(8)


def _encode(message: dict) -> bytes:
    return (json.dumps(message, sort_keys=True) + "\n").encode("utf-8")


@dataclass
class NodeReport:
    """What the controller knows about one node."""

    node: int
    host: str = ""
    connected: bool = False
    exit_code: Optional[int] = None
    failed_rank: Optional[int] = None
    stopped: bool = False
    exit_time: float = 0.0


@dataclass
class Failure:
    """The first real failure of the job: where, and with which exit code."""

    node: int
    host: str
    rank: Optional[int]
    exit_code: int
    reason: str = ""

    def describe(self) -> str:
        where = f"node {self.node} ({self.host})" if self.host else f"node {self.node}"
        who = f", rank {self.rank}," if self.rank is not None else ""
        return f"{where}{who} failed first with exit code {self.exit_code}{self.reason}"


class JobController:
    """The head side: accepts the node agents' connections and tells them to stop.

    ``poll(timeout)`` handles whatever arrived (call it from the launcher's wait loop); ``stop_all()`` sends ``stop``
    to every connected node and to nodes that connect later. Not thread safe: one thread drives it.
    """

    def __init__(self, hosts: List[str], bind_addr: str = "", token: Optional[str] = None):
        num_nodes = len(hosts)
        self.num_nodes = num_nodes
        self.token = token or new_token()
        self.nodes: Dict[int, NodeReport] = {i: NodeReport(i, host) for i, host in enumerate(hosts)}
        self.failures: List[Failure] = []
        self.stopping = False
        self._selector = selectors.DefaultSelector()
        self._server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._server.bind((bind_addr, 0))
        self._server.listen(max(16, num_nodes))
        self._server.setblocking(False)
        self._selector.register(self._server, selectors.EVENT_READ, None)
        self._buffers: Dict[socket.socket, bytes] = {}
        self._node_of: Dict[socket.socket, int] = {}

    @property
    def port(self) -> int:
        return self._server.getsockname()[1]

    def all_exited(self) -> bool:
        return all(report.exit_code is not None for report in self.nodes.values())

    def all_connected(self) -> bool:
        return all(report.connected or report.exit_code is not None for report in self.nodes.values())

    def poll(self, timeout: float) -> None:
        for key, _ in self._selector.select(timeout):
            if key.data is None:
                self._accept()
            else:
                self._read(key.fileobj)

    def _accept(self) -> None:
        try:
            conn, _ = self._server.accept()
        except (BlockingIOError, InterruptedError):
            return
        conn.setblocking(False)
        self._buffers[conn] = b""
        self._selector.register(conn, selectors.EVENT_READ, "node")

    def _drop(self, conn: socket.socket) -> None:
        self._selector.unregister(conn)
        self._buffers.pop(conn, None)
        node = self._node_of.pop(conn, None)
        conn.close()
        if node is not None and self.nodes[node].exit_code is None:
            # A node agent that goes away without reporting is lost (killed, its host down): the job cannot go on.
            self._record_exit(node, 1, None, stopped=self.stopping, reason=": its node agent went away")

    def _read(self, conn: socket.socket) -> None:
        try:
            data = conn.recv(65536)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._drop(conn)
            return
        buffer = self._buffers[conn] + data
        *lines, rest = buffer.split(b"\n")
        self._buffers[conn] = rest
        for line in lines:
            try:
                message = json.loads(line)
            except ValueError:
                self._drop(conn)
                return
            if message.get("token") != self.token or not 0 <= int(message.get("node", -1)) < self.num_nodes:
                self._drop(conn)
                return
            self._handle(conn, message)

    def _handle(self, conn: socket.socket, message: dict) -> None:
        node = int(message["node"])
        report = self.nodes[node]
        if message.get("type") == HELLO:
            self._node_of[conn] = node
            report.connected = True
            if self.stopping:
                self._send(conn, {"type": STOP})
        elif message.get("type") == EXIT:
            rank = message.get("rank")
            self._record_exit(node, int(message["code"]), None if rank is None else int(rank),
                              bool(message.get("stopped")))

    def _record_exit(self, node: int, code: int, rank: Optional[int], stopped: bool, reason: str = "") -> None:
        report = self.nodes[node]
        if report.exit_code is not None:
            return
        report.exit_code, report.failed_rank, report.stopped, report.exit_time = code, rank, stopped, time.time()
        if code != 0 and not stopped:
            self.failures.append(Failure(node, report.host, rank, code, reason))
            self.stop_all()

    def record_transport_failure(self, node: Optional[int], code: int, reason: str) -> None:
        """A transport (ssh, pdsh, mpirun, srun) failed: fail the nodes it served that never reported (all of them
        when ``node`` is None), giving ``reason``."""
        nodes = [node] if node is not None else list(self.nodes)
        for index in nodes:
            report = self.nodes[index]
            if report.exit_code is None:
                self._record_exit(index, code, None, stopped=self.stopping, reason=f": {reason}")

    def stop_all(self) -> None:
        self.stopping = True
        for conn in list(self._node_of):
            self._send(conn, {"type": STOP})

    def _send(self, conn: socket.socket, message: dict) -> None:
        try:
            conn.setblocking(True)
            conn.sendall(_encode(message))
            conn.setblocking(False)
        except OSError:
            pass

    def first_failure(self) -> Optional[Failure]:
        return self.failures[0] if self.failures else None

    def worst_exit_code(self) -> int:
        """The largest exit code of a node that failed on its own (0 when none did)."""
        return max((failure.exit_code for failure in self.failures), default=0)

    def close(self) -> None:
        for conn in list(self._buffers):
            try:
                self._selector.unregister(conn)
            except (KeyError, ValueError):
                pass
            conn.close()
        self._selector.unregister(self._server)
        self._server.close()
        self._selector.close()


def controller_candidates(address: str, environ=None) -> List[Tuple[str, int]]:
    """Where a node agent looks for its controller: the address it was given, after (over ssh) the head's address
    as the node sees it (``SSH_CLIENT``), which is routable by construction."""
    environ = os.environ if environ is None else environ
    host, _, port_text = address.rpartition(":")
    port = int(port_text)
    candidates = []
    ssh_client = environ.get("SSH_CLIENT", "").split()
    if ssh_client:
        candidates.append((ssh_client[0], port))
    candidates.append((host, port))
    return candidates


class ControllerLink:
    """The node side: the connection to the controller, and a thread that waits for ``stop``.

    ``on_stop`` is called (once, from the reader thread) on ``stop`` or when the controller goes away.
    """

    def __init__(self, address: str, token: str, node: int, host: str, on_stop):
        self.node, self.token, self._on_stop = node, token, on_stop
        self.stop_requested = threading.Event()
        errors = []
        self._sock = None
        for candidate in controller_candidates(address):
            try:
                self._sock = socket.create_connection(candidate, timeout=CONNECT_TIMEOUT_S)
                break
            except OSError as err:
                errors.append(f"{candidate[0]}:{candidate[1]}: {err}")
        if self._sock is None:
            raise ConnectionError(f"node {node} ({host}) cannot reach the deepspeed command that started it ("
                                  f"{'; '.join(errors)}); set DS_LAUNCHER_CONTROLLER_ADDR on the launching node to "
                                  "an address of it this node can reach")
        self._sock.settimeout(None)
        self._lock = threading.Lock()
        self._send({"type": HELLO, "host": host, "pid": os.getpid()})
        self._reader = threading.Thread(target=self._read_loop, name="ds-controller-link", daemon=True)
        self._reader.start()

    def _send(self, message: dict) -> None:
        message = dict(message, token=self.token, node=self.node)
        with self._lock:
            self._sock.sendall(_encode(message))

    def _read_loop(self) -> None:
        buffer = b""
        while True:
            try:
                data = self._sock.recv(4096)
            except OSError:
                data = b""
            if not data:
                break
            buffer += data
            if b'"type": "stop"' in buffer:
                break
        if not self.stop_requested.is_set():
            self.stop_requested.set()
            self._on_stop()

    def report_exit(self, code: int, rank: Optional[int], stopped: bool) -> None:
        try:
            self._send({"type": EXIT, "code": code, "rank": rank, "stopped": stopped})
        except OSError as err:
            print(f"[deepspeed launch] node {self.node}: could not report its exit: {err}", file=sys.stderr)

    def close(self) -> None:
        self.stop_requested.set()  # what follows is our own closing, not a stop
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
