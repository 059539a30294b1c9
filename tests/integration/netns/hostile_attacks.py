"""The attacker of the hostile-network test, run in a namespace of its own with no job secret: each attack of
issue 42 against node 0's port, as a bare `torch.distributed.TCPStore` client or a raw socket would make it. Prints
one JSON line per attack: ``{"attack", "ok"}`` where ok means the store refused it, plus ``closed_s`` (from its
connect to the relay closing it) for the raw-socket ones."""
import json
import socket
import sys
import time
from datetime import timedelta

from torch.distributed import TCPStore

HOST, PORT = sys.argv[1], int(sys.argv[2])


def report(attack, ok, **fields):
    print(json.dumps({"attack": attack, "ok": ok, **fields}), flush=True)


def store_attack(name, act):
    """A bare TCPStore client doing ``act(store)``: refused means it raised before any request was served."""
    try:
        act(TCPStore(HOST, PORT, None, False, timedelta(seconds=2)))
    except Exception as err:  # noqa: BLE001 - any refusal will do; the test checks nothing was written
        report(name, True, error=str(err).splitlines()[0][:200])
        return
    report(name, False, error="the store answered")


def closed_after(sock, send=b""):
    """Seconds until the relay closed ``sock`` after its connect, sending ``send`` first (as far as it goes)."""
    start = time.monotonic()
    sock.settimeout(10)
    sent = 0
    try:
        if send:
            view = memoryview(send)
            while sent < len(send):
                sent += sock.send(view[sent:sent + (1 << 16)])
        while sock.recv(1 << 16):
            pass
    except (ConnectionResetError, BrokenPipeError):
        pass
    return time.monotonic() - start, sent


store_attack("forged_failure", lambda s: (s.set("fabriclite//failure", json.dumps(
    {"node": 7, "rank": 42, "message": "rank 42 raised RuntimeError: forged by attacker"})),
    s.add("fabriclite//pulse/0", 1 << 40)))
store_attack("forged_restart_decision", lambda s: s.set("restarts/1/decision", json.dumps({"delay": 1e9})))
store_attack("rank_zero_first_release", lambda s: s.add("fabriclite//rank_zero_first/0", 1 << 20))
store_attack("check_in_count", lambda s: s.add("fabriclite//arrived/count", 1 << 40))
store_attack("list_keys_and_get", lambda s: (s.list_keys(), s.get("fabriclite//failure")))
store_attack("overwrite_process_group_keys", lambda s: s.set("pg/rank_0", b"attacker"))
with socket.create_connection((HOST, PORT)) as sock:  # the flood: 200 values of 1 MiB, as fast as it goes
    took, sent = closed_after(sock, b"\x00" * (200 << 20))
report("flood", sent < (200 << 20), closed_s=took, sent=sent)
with socket.create_connection((HOST, PORT)) as sock:  # silence: connect and say nothing
    took, _ = closed_after(sock)
report("silence", True, closed_s=took)
with socket.create_connection((HOST, PORT)) as sock:  # torch's own greeting, then waiting for its answer
    took, _ = closed_after(sock, b"\x03" + (0x3C85F7CE).to_bytes(4, "little") * 2)
report("torch_greeting", True, closed_s=took)
