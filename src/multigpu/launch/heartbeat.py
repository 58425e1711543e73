"""The nodes of a run over several machines watch one another: every node arrives, or one sentence says which did
not; a node that dies or drops off the network is named within seconds, and every node stops.

Why: the workers' collectives wait for a lost peer until the collective timeout (30 minutes by default), silently;
a node that never starts leaves the others waiting as long. The launchers, idle while their workers train, watch
instead, over a channel no collective blocks: node 0's launcher keeps a board (who arrived, when each node last
beat, who ended, who was lost) and serves it at --master-port + 1; every other node's launcher asks it, one short
connection per question, each with a timeout. (torch's TCPStore would serve too, but its calls to a node beyond a
downed link wait until the link is back, whatever their timeout, and its client cannot then be closed.)

- Arrival, before each start of the workers: each node posts its address and processes; node 0 waits for all
  of them until --join-timeout, then posts the roll, or says which nodes did not come.
- Heartbeat, while the workers run: each node beats every second. Node 0 counts a node lost when it has not
  beaten for --node-timeout seconds, and posts that; a node counts node 0 lost when it has not answered for as
  long. A node whose workers ended posts how (finished, failed), so that the others need not wait for a timeout.
- A lost node: the launcher stops its own workers (the SIGTERM a Ctrl-C's stop also sends) and says which node,
  with its ranks and address, and what was seen. With --max-restarts, every node arrives again and the workers
  restart from the last checkpoint. Each start is a round of its own, so nothing of an earlier round is read.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field

from multigpu.core.errors import UsageError

BEAT_S = 1.0  # how often a node beats
ASK_S = 2.0  # how long one question to node 0 may take


def heartbeat_port(master_port: int) -> int:
    """Where node 0's launcher serves the board: the port after the workers' rendezvous."""
    return master_port + 1


def check_node_timeouts(join_s: float, timeout_s: float) -> None:
    if join_s <= 0:
        raise UsageError(f"--join-timeout must be more than 0 seconds (got {join_s:g}).")
    if timeout_s < 3 * BEAT_S:
        raise UsageError(
            f"--node-timeout must be at least {3 * BEAT_S:g} seconds (got {timeout_s:g}): a node beats every "
            f"{BEAT_S:g} s."
        )


@dataclass(frozen=True)
class NodeInfo:
    rank: int
    address: str
    nproc: int


def describe(node: NodeInfo, nodes: list[NodeInfo], nnodes: int) -> str:
    """'node 1 of 2 (ranks 2-3, 10.231.0.2)'."""
    first = sum(other.nproc for other in nodes if other.rank < node.rank)
    ranks = f"rank {first}" if node.nproc == 1 else f"ranks {first}-{first + node.nproc - 1}"
    return f"node {node.rank} of {nnodes} ({ranks}, {node.address})"


class NodeLost(Exception):
    """A node did not arrive, was lost or failed; the message is the sentence that says which and how."""


@dataclass
class Round:
    """Node 0's board for one start of the workers."""

    nodes: dict[int, NodeInfo] = field(default_factory=dict)
    beats: dict[int, float] = field(default_factory=dict)  # rank -> when node 0 last heard it (its own clock)
    ended: dict[int, str] = field(default_factory=dict)  # rank -> "finished" or "failed"
    roll: list[int] | None = None  # the ranks that arrived, once all did
    missing: list[int] | None = None  # the ranks that did not, once the join timeout ran out
    lost: str | None = None  # the sentence, once a node is lost
    gone: bool = False  # whether it stopped beating (not: ended with a failure of its own)
    told: set[int] = field(default_factory=set)  # the nodes that have heard the roll or the missing ones


class Board:
    """Node 0's record of every round, served to the other nodes (`answer`) and read by node 0 itself."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.rounds: dict[int, Round] = {}

    def round(self, number: int) -> Round:
        return self.rounds.setdefault(number, Round())

    def answer(self, request: dict) -> dict:
        with self.lock:
            state = self.round(request["round"])
            rank = request.get("rank")
            if request["op"] == "arrive":
                state.nodes[rank] = NodeInfo(**request["node"])
                state.beats[rank] = time.monotonic()
            elif request["op"] == "beat":
                state.beats[rank] = time.monotonic()
            elif request["op"] == "ended":
                state.ended[rank] = request["how"]
            if state.roll is not None or state.missing is not None:
                state.told.add(rank)
            return {
                "roll": state.roll,
                "missing": state.missing,
                "nodes": [asdict(node) for node in state.nodes.values()],
                "lost": state.lost,
                "gone": state.gone,
                "failed": sorted(r for r, how in state.ended.items() if how == "failed"),
            }


class BoardServer:
    """Serves a Board on `port` (every address), a thread per question, until the process ends."""

    def __init__(self, board: Board, port: int) -> None:
        self.board = board
        if socket.has_dualstack_ipv6():
            self.sock = socket.create_server(("", port), family=socket.AF_INET6, dualstack_ipv6=True, reuse_port=False)
        else:
            self.sock = socket.create_server(("", port))
        threading.Thread(target=self._serve, daemon=True, name="node-board").start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._reply, args=(conn,), daemon=True).start()

    def _reply(self, conn: socket.socket) -> None:
        with conn, contextlib.suppress(OSError, ValueError, KeyError, TypeError):
            conn.settimeout(ASK_S)
            request = json.loads(_read_line(conn))
            conn.sendall(json.dumps(self.board.answer(request)).encode() + b"\n")


def _read_line(conn: socket.socket) -> bytes:
    data = b""
    while not data.endswith(b"\n"):
        chunk = conn.recv(65536)
        if not chunk:
            raise OSError("closed before a whole line")
        data += chunk
    return data


def ask(address: str, port: int, request: dict, timeout: float = ASK_S) -> dict:
    """One question to node 0's board; raises OSError when it cannot be asked or does not answer in time."""
    with socket.create_connection((address, port), timeout=timeout) as conn:
        conn.sendall(json.dumps(request).encode() + b"\n")
        return json.loads(_read_line(conn))


class NodeWatch:
    """This node's side: arrival (`arrive`), then a heartbeat while `beating()`; `lost` is the sentence once a node
    is lost."""

    def __init__(
        self, nnodes: int, node: NodeInfo, master_addr: str, master_port: int, join_s: float, timeout_s: float
    ) -> None:
        self.nnodes, self.node, self.join_s, self.timeout_s = nnodes, node, join_s, timeout_s
        self.address, self.port = master_addr, heartbeat_port(master_port)
        self.nodes: list[NodeInfo] = []
        self.lost: str | None = None  # the sentence naming a node that was lost or failed
        self.gone: str | None = None  # the sentence naming a node that stopped beating or answering
        self.last_checkpoint: str | None = None  # the newest complete checkpoint any round committed
        self.round = -1
        self._stopping, self._workers_running = threading.Lock(), True
        self.board = Board() if node.rank == 0 else None
        # served until the process ends: every round's questions come to it
        self.server = BoardServer(self.board, self.port) if self.board is not None else None

    @property
    def where(self) -> str:
        return f"{self.address}:{self.port}"

    def _ask(self, op: str, **fields: object) -> dict:
        request = {"op": op, "round": self.round, "rank": self.node.rank, **fields}
        if self.board is not None:
            return self.board.answer(request)
        return ask(self.address, self.port, request)

    def describe(self, rank: int) -> str:
        node = next((n for n in self.nodes if n.rank == rank), NodeInfo(rank, "address unknown", 1))
        return describe(node, self.nodes, self.nnodes)

    # --- arrival -------------------------------------------------------------------------------------------------

    def arrive(self) -> None:
        """Waits until every node has arrived for the next round; raises NodeLost, naming who did not come."""
        self.round += 1
        self.lost, self.gone, self._workers_running = None, None, True
        deadline = time.monotonic() + self.join_s
        reached = False
        while True:
            try:
                board = self._ask("arrive", node=asdict(self.node))
            except OSError:
                board = None
            if board is not None and not reached and self.board is None:
                # node 0 decides by its own clock, which started before it answered: wait a little longer than that
                reached, deadline = True, time.monotonic() + self.join_s + 5 * ASK_S
            if board is not None and self.board is not None and board["roll"] is None:
                board = self._call_roll(deadline)
            if board is not None and (board["roll"] is not None or board["missing"] is not None):
                break
            if time.monotonic() > deadline:
                raise NodeLost(
                    self._unreached()
                    if not reached
                    else f"node 0 at {self.where} stopped answering while the nodes arrived; check that it still runs"
                )
            time.sleep(0.2)
        self.nodes = sorted((NodeInfo(**node) for node in board["nodes"]), key=lambda node: node.rank)
        if board["missing"] and self.board is not None:
            self._until_told()
        if board["missing"]:
            raise NodeLost(self._missing_sentence(board["missing"]))

    def _call_roll(self, deadline: float) -> dict:
        """On node 0: the roll once every node arrived, or the missing ones once the deadline passed."""
        state = self.board.round(self.round)
        with self.board.lock:
            if len(state.nodes) == self.nnodes:
                state.roll = sorted(state.nodes)
            elif time.monotonic() > deadline:
                state.missing = [rank for rank in range(self.nnodes) if rank not in state.nodes]
        return self._ask("look")

    def _until_told(self) -> None:
        """On node 0, before it leaves a round that cannot start: gives each node that came time to hear why."""
        state, deadline = self.board.round(self.round), time.monotonic() + 2 * ASK_S
        while time.monotonic() < deadline and len(state.told) < len(state.nodes):
            time.sleep(0.1)

    def _unreached(self) -> str:
        return (
            f"node 0 did not answer at {self.where} within {self.join_s:g} s (--join-timeout): start it (--node-rank "
            f"0, the same --master-port), or check that this machine reaches it on ports {self.port - 1} and "
            f"{self.port}"
        )

    def _missing_sentence(self, missing: list[int]) -> str:
        many = len(missing) > 1
        return (
            f"{self.nnodes - len(missing)} of {self.nnodes} nodes arrived within {self.join_s:g} s (--join-timeout); "
            f"node{'s' if many else ''} {', '.join(map(str, missing))} did not: start {'them' if many else 'it'} with "
            f"the same --nnodes, --master-addr and --master-port, or check that "
            f"{'they reach' if many else 'it reaches'} {self.where}"
        )

    # --- heartbeat -----------------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def beating(self) -> Iterator[None]:
        """Within it, a thread beats and watches; on a lost node it sets `lost` and stops this node's workers."""
        done = threading.Event()
        watch = self._watch_others if self.board is not None else self._watch_master
        thread = threading.Thread(target=watch, args=(done,), daemon=True, name="node-heartbeat")
        thread.start()
        try:
            yield
        finally:
            done.set()
            thread.join(timeout=2 * ASK_S)

    def _watch_others(self, done: threading.Event) -> None:
        state = self.board.round(self.round)
        while not done.wait(BEAT_S):
            with self.board.lock:
                failed = [rank for rank, how in state.ended.items() if how == "failed"]
                silent = [
                    rank
                    for rank, heard in state.beats.items()
                    if rank != 0 and rank not in state.ended and time.monotonic() - heard > self.timeout_s
                ]
            if failed:
                return self._lose(
                    f"{self.describe(failed[0])} ended: a worker there failed (its output says why)", gone=False
                )
            if silent:
                return self._lose(f"{self.describe(silent[0])} was lost: no heartbeat for {self.timeout_s:g} s")

    def _watch_master(self, done: threading.Event) -> None:
        heard = time.monotonic()
        while not done.wait(BEAT_S):
            try:
                board = self._ask("beat")
            except OSError:
                if time.monotonic() - heard > self.timeout_s and not done.is_set():
                    return self._lose(f"{self.describe(0)} was lost: it did not answer for {self.timeout_s:g} s")
                continue
            heard = time.monotonic()
            if board["lost"]:
                return self._lose(board["lost"], gone=board["gone"])
            failed = [rank for rank in board["failed"] if rank != self.node.rank]
            if failed:
                failure = f"{self.describe(failed[0])} ended: a worker there failed (its output says why)"
                return self._lose(failure, gone=False)

    def _lose(self, sentence: str, gone: bool = True) -> None:
        """A node was lost (`gone`: it stopped beating or answering) or ended with a failure: note it, for the other
        nodes too, and stop this node's workers if they still run."""
        if self.board is not None:
            with self.board.lock:
                state = self.board.round(self.round)
                state.lost, state.gone = sentence, gone
        self.lost, self.gone = sentence, sentence if gone else self.gone
        with self._stopping:
            if self._workers_running:  # stops them as a Ctrl-C does: the launcher reads `lost`
                os.kill(os.getpid(), signal.SIGTERM)

    def workers_ended(self) -> None:
        """From now on a lost node is only noted: this node's workers have ended, there is nothing to stop."""
        with self._stopping:
            self._workers_running = False

    def wait_for_news(self, gone_only: bool) -> str | None:
        """After this node's workers failed for want of a peer: the sentence naming the node that was lost, waiting
        for the heartbeat to tell at most --node-timeout and a beat; `gone_only`: a node that ended with a failure
        of its own does not count (its workers may have refused what these did, in the same sentence)."""
        deadline = time.monotonic() + self.timeout_s + 2 * BEAT_S
        while time.monotonic() < deadline:
            news = self.gone if gone_only else self.lost
            if news is not None:
                return news
            time.sleep(0.1)
        return None

    # --- the end -------------------------------------------------------------------------------------------------

    def ended(self, how: str) -> None:
        """Posts that this node's workers ended (`how`: "finished" or "failed"), for the other nodes."""
        with contextlib.suppress(OSError):
            self._ask("ended", how=how)

    def linger(self) -> None:
        """On node 0, once its workers finished: keeps the board up until every node has ended its own (at most
        --node-timeout), so that none takes node 0's going for a loss."""
        if self.board is None:
            return
        state, deadline = self.board.round(self.round), time.monotonic() + self.timeout_s
        while time.monotonic() < deadline and len(state.ended) < len(state.nodes):
            time.sleep(0.2)
