"""A stranger against a running job's rendezvous (issue 21, item 1). rendezvous_stranger_test.sh starts
a coordinator and two workers with a cluster token; this script watches the workers' listening
sockets, and every port a worker opens after the submit (the job's rendezvous, Gloo's listeners) is
attacked at once, as a hostile client on the cluster network would: with torch.distributed.TCPStore
(Debian's python3-torch) as a client, reading the ranks' keys, writing 64 MiB values and the
`world/0/1` key the job's ranks wait for. Then:
  - no read returns anything, and nothing answers the stranger's store protocol;
  - the workers' memory does not grow with what the stranger wrote;
  - the job becomes READY and answers an Infer;
  - the rendezvous (the port that greets with bertshard's handshake) listens on 127.0.0.1 only,
    the workers' advertised host, not on every interface.
"""
import argparse
import json
import os
import socket
import subprocess
import sys
import threading
import time

# One operation per child process: TCPStore's client may hang, or abort, on a server that does
# not speak its protocol, and the next operation must still be tried.
STRANGER = r"""
import datetime, sys
import torch.distributed as dist
host, port, op = sys.argv[1], int(sys.argv[2]), sys.argv[3]
store = dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=2))
kind, _, key = op.partition(" ")
if kind == "set":
    store.set(key, b"garbage")
elif kind == "set64":
    store.set(key, b"x" * (64 << 20))
elif kind == "get":
    print(repr(store.get(key))[:200])
elif kind == "num_keys":
    print(store.num_keys())
elif kind == "add":
    print(store.add(key, 1))
print("DONE")
"""
# The key the job's ranks wait for first, then reads of what the ranks publish (Gloo addresses,
# the shared-memory segment's name and token), through torch's own client.
OPERATIONS = ["set world/0/1", "get world/0", "get shm/tp0/segment", "num_keys"]
# TCPStore's wire format (LibTorch 1.13 TCPStore.cpp: a query-type byte, then size_t-prefixed key
# and value), for the raw stranger: torch's client aborts on bertshard's greeting before it sends
# anything, a stranger writing the bytes itself does not.
SET, GET, GETNUMKEYS = 0, 2, 6


def tcpstore_query(kind, key=None, value=None):
    out = bytes([kind])
    for part in ([] if key is None else [key.encode()]) + ([] if value is None else [value]):
        out += len(part).to_bytes(8, "little") + part
    return out


def raw_stranger(port, big_key, value_bytes):
    """Writes `world/0/1` and `big_key` (a value of `value_bytes`), then reads the segment key and the
    key count, in TCPStore's protocol on a raw socket; returns every byte the server sent back."""
    received = b""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
            s.settimeout(3)
            try:
                s.sendall(tcpstore_query(SET, "world/0/1", b"garbage") + tcpstore_query(SET, big_key, b"x" * value_bytes) +
                          tcpstore_query(GET, "shm/tp0/segment") + tcpstore_query(GET, "world/0") +
                          tcpstore_query(GETNUMKEYS))
            except OSError:
                pass  # the server closed on us mid-write
            while True:
                chunk = s.recv(65536)
                if not chunk:
                    break
                received += chunk
    except OSError:
        pass
    return received

READ_OPS = ("get ", "num_keys", "raw ")
GREETING = b"BSRDV1S\n"


def listening(pid):
    """{port: local address} of the TCP sockets process `pid` listens on."""
    inodes = set()
    for fd in os.listdir("/proc/%d/fd" % pid):
        try:
            target = os.readlink("/proc/%d/fd/%s" % (pid, fd))
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            next(f)
            for line in f:
                fields = line.split()
                local, state, inode = fields[1], fields[3], fields[9]
                if state != "0A" or inode not in inodes:
                    continue
                address, port = local.split(":")
                found[int(port, 16)] = address
    return found


def rss_kib(pid):
    with open("/proc/%d/status" % pid) as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def greets_as_rendezvous(port):
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=2) as s:
            s.settimeout(2)
            data = b""
            while len(data) < len(GREETING):
                chunk = s.recv(len(GREETING) - len(data))
                if not chunk:
                    break
                data += chunk
            return data == GREETING
    except OSError:
        return False


class Stranger:
    """Watches the workers for new listening ports and attacks each once, from the first moment."""

    def __init__(self, pids):
        self.pids = pids
        self.baseline = {pid: set(listening(pid)) for pid in pids}
        self.attacked = {}  # port -> (pid, bound address, results)
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.threads = []
        self.watcher = threading.Thread(target=self.watch)
        self.watcher.start()

    def watch(self):
        while not self.stop.is_set():
            for pid in self.pids:
                try:
                    ports = listening(pid)
                except OSError:
                    continue
                for port, address in ports.items():
                    with self.lock:
                        if port in self.baseline[pid] or port in self.attacked:
                            continue
                        self.attacked[port] = [pid, address, None]
                    t = threading.Thread(target=self.attack, args=(port,))
                    t.start()
                    self.threads.append(t)
            time.sleep(0.005)

    def attack(self, port):
        results = {}
        for op in OPERATIONS:
            try:
                run = subprocess.run([sys.executable, "-c", STRANGER, "127.0.0.1", str(port), op],
                                     capture_output=True, text=True, timeout=60)
                lines = run.stdout.splitlines()
                # "ok": the client got to the end of the operation, with what it read before "DONE".
                ok = run.returncode == 0 and lines[-1:] == ["DONE"]
                results[op] = {"ok": ok, "value": lines[:-1] if ok else None,
                               "error": None if ok else (run.stderr.strip().splitlines() or ["rc %d" % run.returncode])[-1][:200]}
            except subprocess.TimeoutExpired:
                results[op] = {"ok": False, "error": "timed out"}
        # 4 x 64 MiB, and what came back: bertshard's greeting and a refusal at most.
        for i in range(4):
            got = raw_stranger(port, "big/%d" % i, 64 << 20)
            # Allowed back: the greeting (magic and a 32-byte nonce), then one verdict byte.
            read = len(got) > len(GREETING) + 32 + 1 or (got and not got.startswith(GREETING[:len(got)]))
            results["raw set 64 MiB + get %d" % i] = {"ok": bool(read), "value": repr(got[:100]),
                                                       "error": None if read else "%d bytes back" % len(got)}
        with self.lock:
            self.attacked[port][2] = results

    def finish(self):
        self.stop.set()
        self.watcher.join()
        for t in self.threads:
            t.join()


def shardctl(binary, server, args, expect_ok=True):
    result = subprocess.run([binary] + args + ["--server", server], capture_output=True, text=True, timeout=300)
    if expect_ok and result.returncode != 0:
        raise AssertionError("shardctl %s failed (%d): %s" % (" ".join(args), result.returncode, result.stderr))
    return result.stdout


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--shardctl", required=True)
    parser.add_argument("--server", required=True)
    parser.add_argument("--worker_pids", required=True)
    parser.add_argument("--model", required=True)
    args = parser.parse_args()
    pids = [int(p) for p in args.worker_pids.split(",")]
    model = os.path.abspath(args.model)

    # Both workers registered (their first listening port is the gRPC one, in the baseline).
    deadline = time.time() + 30
    while not all(listening(pid) for pid in pids):
        assert time.time() < deadline, "the workers do not listen"
        time.sleep(0.05)
    time.sleep(1)
    rss_before = {pid: rss_kib(pid) for pid in pids}
    stranger = Stranger(pids)
    job = shardctl(args.shardctl, args.server, ["submit", "--checkpoint", model, "--tp", "2", "--watch"])
    job = job.splitlines()[0].strip()
    # The job's rendezvous lives as long as the job: keep it loaded until every attack is done.
    time.sleep(2)
    stranger.finish()
    status = json.loads(shardctl(args.shardctl, args.server, ["job", job]))
    inputs = os.path.join(model, "input.json")
    shardctl(args.shardctl, args.server, ["infer", job, "--input", inputs])
    rss_after = {pid: rss_kib(pid) for pid in pids}

    failures = []
    rendezvous = []
    for port, (pid, address, results) in sorted(stranger.attacked.items()):
        results = results or {}
        print("port %d of worker %d, bound to %s: %s" % (port, pid, address, json.dumps(results)))
        for name, r in results.items():
            if name.startswith(READ_OPS) and r.get("ok"):
                failures.append("the stranger's %s on port %d returned %s" % (name, port, r.get("value")))
        if greets_as_rendezvous(port):
            rendezvous.append(port)
            if address != "0100007F":  # 127.0.0.1, as /proc/net/tcp writes it
                failures.append("the rendezvous on port %d listens on %s, not 127.0.0.1 only" % (port, address))
    # Every listening socket a worker opened for the job, whatever it is: none on every interface.
    for port, (pid, address, _) in stranger.attacked.items():
        if address.strip("0") == "":
            failures.append("worker %d listens on port %d on every interface" % (pid, port))
    if not rendezvous:
        failures.append("no port greeted as bertshard's rendezvous (ports opened: %s)" % sorted(stranger.attacked))
    if status.get("state") != "READY":
        failures.append("the job is %s, not READY: %s" % (status.get("state"), status.get("error")))
    for pid in pids:
        grown = (rss_after[pid] - rss_before[pid]) / 1024
        print("worker %d: RSS %.0f -> %.0f MiB" % (pid, rss_before[pid] / 1024, rss_after[pid] / 1024))
        # The stranger wrote 4 x 64 MiB per port under keys of their own; the test model's job adds
        # about 20 MiB.
        if grown > 100:
            failures.append("worker %d grew by %.0f MiB while the stranger wrote" % (pid, grown))
    if failures:
        print("FAILED:\n  " + "\n  ".join(failures))
        sys.exit(1)
    print("PASSED: %d port(s) attacked, %d rendezvous, job READY" % (len(stranger.attacked), len(rendezvous)))


if __name__ == "__main__":
    main()
