"""tests/forked_workers.py: a forked worker that has ended stays signallable until the launcher reads its exit code,
as a Popen'd child stays a zombie until it is waited for. torch elastic signals each survivor it polled as running
(`os.killpg`); where two workers end at once, one may end between that poll and the signal, and a worker the server
had already reaped made the signal raise ProcessLookupError in the launcher."""

import sys

from tests.dist import run_command

# In a fresh interpreter, so that nothing forks from pytest's threads: a server, one worker that exits with code 2
# (json.tool refuses a file that is not there), the signal after it ended, then its code.
ENDED_THEN_SIGNALLED = """
import os, signal, socket, sys, time
from tests import forked_workers

ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
if os.fork() == 0:
    ours.close()
    forked_workers._serve(theirs)
    os._exit(0)
theirs.close()
server = forked_workers.WorkerServer(ours)
null = os.open(os.devnull, os.O_RDWR)
argv = [sys.executable, "-u", "-m", "json.tool", "/nonexistent.json"]
worker = forked_workers.ForkedWorker(server, argv, dict(os.environ), [null] * 3)

def state():
    try:
        with open(f"/proc/{worker.pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return "gone"

deadline = time.monotonic() + 60
while state() not in ("Z", "gone") and time.monotonic() < deadline:
    time.sleep(0.05)
time.sleep(0.5)  # ten of the server's rounds: a worker it reaps unasked would be gone by now
print("ended:", state())
os.killpg(worker.pid, signal.SIGTERM)  # what torch elastic sends a survivor it polled before this one ended
print("exit code:", worker.wait(30))
deadline = time.monotonic() + 10
while state() != "gone" and time.monotonic() < deadline:
    time.sleep(0.05)
print("after its code was read:", state())
"""


def test_a_worker_that_ended_is_signalled_without_error_until_its_code_is_read() -> None:
    result = run_command([sys.executable, "-c", ENDED_THEN_SIGNALLED], timeout=90)
    assert result.returncode == 0, result.stdout
    assert result.stdout.splitlines() == ["ended: Z", "exit code: 2", "after its code was read: gone"]
