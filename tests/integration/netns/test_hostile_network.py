"""A hostile network (issue 42): a 3-host job (`fabriclite run`, the suite's job secret) and a fourth namespace on the
same subnet that holds no secret and replays every attack of the issue against node 0's port while the job trains:
a forged failure and pulse, a forged restart decision, a `rank_zero_first` release, a forged check-in count,
`list_keys` and `get`, torch's process-group keys overwritten, a flood of 200 MiB, silence, torch's own greeting,
and a fourth node started with another secret. The attacked job ends as the same job unattacked does, weights equal
bit for bit, with no failure event and no key the attacker named; each raw connection is closed within the
handshake time; the secret is in no process's command line, log, events record or store value. While the job
trains, no host has a listening socket of the job on every interface, and from another subnet (a second network
between node 0 and the hostile host, which the job does not use) every port the job listens on in node 0 refuses
the connection.

Under `--fault-tolerant` torchft's lighthouse kill endpoint and its Managers' `Kill` RPC stay open (no handshake of
ours fits torchft's clients): docs/security.md says so, and the last test checks that it does."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, List, Optional, Tuple

import pytest
import torch

from cluster import Cluster
from fabriclite.distributed.control_plane import keys

pytestmark = [pytest.mark.netns, pytest.mark.slow, pytest.mark.timeout(600)]

HERE = Path(__file__).parent
REPO = HERE.parents[2]
JOB, ATTACKER = str(HERE / "hostile_job.py"), str(HERE / "hostile_attacks.py")
NODES, HOSTILE = 3, 3
START_S = 180.0  # 3 supervisors and their ranks importing torch on 2 loaded cores, to the attack step
#: a raw connection is closed at the relay's handshake deadline (1 s); the relay's thread and the attacker's read on
#: a loaded 2-core machine add scheduler slices (measured 1.00-1.05 s in the unit tests with 2 busy loops): 0.5 s
CLOSE_BOUND_S = 1.5
#: a node with the wrong secret ends within 5 s of its start-up (the handshake itself takes milliseconds); its
#: start-up (the interpreter importing fabriclite and torch) is measured in the same namespace just before
WRONG_SECRET_BOUND_S = 5.0
_port = [29810]
#: a second network between node 0 and the hostile host only (the job meets on the cluster's 10.250.0.0/24)
OTHER_SUBNET = "10.251.0"
#: connects to each ADDR:PORT given, printing [target, "connected" or the errno's name] per line
_PROBE = """
import errno, json, socket, sys
for target in sys.argv[1:]:
    host, port = target.rsplit(":", 1)
    try:
        socket.create_connection((host, int(port)), timeout=2).close()
        print(json.dumps([target, "connected"]), flush=True)
    except OSError as err:
        print(json.dumps([target, errno.errorcode.get(err.errno, str(err))]), flush=True)
"""


def _env(**extra: str) -> dict:
    keep = ("FABRICLITE_JOB_SECRET_FILE",)
    base = {k: v for k, v in os.environ.items()
            if k in keep or not k.startswith(("FABRICLITE_", "MASTER_", "SLURM_", "TORCHELASTIC_"))}
    return {**base, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), **extra}


class Job:
    def __init__(self, cluster: Cluster, folder: Path, attacked: bool) -> None:
        folder.mkdir(parents=True)
        _port[0] += 1
        self.cluster, self.folder, self.port = cluster, folder, _port[0]
        self.done = folder / "attacks-done"
        if not attacked:
            self.done.touch()
        self.weights, self.keys, self.logs_dir = folder / "w.pt", folder / "keys.json", folder / "logs"
        self.out = [folder / f"node{k}.out" for k in range(NODES)]
        self.err = [folder / f"node{k}.err" for k in range(NODES)]
        self.procs: List[subprocess.Popen] = []
        for k in range(NODES):
            cmd = [sys.executable, "-m", "fabriclite.cli", "run", "--accelerator", "cpu", "--devices", "1",
                   "--num-nodes", str(NODES), "--node-rank", str(k), "--main-address", cluster.host(0),
                   "--main-port", str(self.port), "--timeout", "60", "--log-dir", str(self.logs_dir / f"node{k}"),
                   JOB]
            env = _env(OUT=str(self.weights), KEYS=str(self.keys), ATTACKS_DONE=str(self.done))
            with self.out[k].open("w") as o, self.err[k].open("w") as e:
                self.procs.append(cluster.exec(k, cmd, env, stdout=o, stderr=e))

    def wait_for_attack_step(self) -> None:
        deadline = time.monotonic() + START_S
        while "AT" not in self.out[0].read_text():
            if time.monotonic() > deadline or any(p.poll() is not None for p in self.procs):
                self.cluster.kill_all()
                raise AssertionError(f"the job never reached the attack step:\n{self.logs()}")
            time.sleep(0.05)

    def finish(self) -> None:
        deadline = time.monotonic() + START_S
        while any(p.poll() is None for p in self.procs):
            if time.monotonic() > deadline:
                self.cluster.kill_all()
                raise AssertionError(f"the job did not end:\n{self.logs()}")
            time.sleep(0.1)
        assert [p.returncode for p in self.procs] == [0] * NODES, self.logs()

    def events(self) -> List[dict]:
        return [json.loads(line) for path in self.logs_dir.rglob("events-node*.jsonl")
                for line in path.read_text().splitlines() if line.strip()]

    def logs(self) -> str:
        return "\n".join(f"--- node {k} (exit {p.returncode}) ---\n{self.err[k].read_text()[-3000:]}"
                         for k, p in enumerate(self.procs))


def _run_in(cluster: Cluster, cmd: List[str], env: dict, folder: Path, timeout: float = 120) -> Tuple[int, str, str]:
    """Run ``cmd`` in the hostile namespace: its exit code, stdout and stderr (files in ``folder``); killed, with
    what it said, after ``timeout``."""
    folder.mkdir(parents=True, exist_ok=True)
    out, err = folder / "out", folder / "err"
    with out.open("w") as o, err.open("w") as e:
        proc = cluster.exec(HOSTILE, cmd, env, stdout=o, stderr=e)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        left = cluster.pids(HOSTILE)
        cluster.kill_all()
        raise AssertionError(f"{cmd} still running after {timeout:.0f} s (processes {left}):\n"
                             f"{out.read_text()[-2000:]}\n{err.read_text()[-3000:]}") from None
    return proc.returncode, out.read_text(), err.read_text()


def _cmdlines() -> List[bytes]:
    lines = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                lines.append(Path(f"/proc/{pid}/cmdline").read_bytes())
            except OSError:
                pass
    return lines


@contextmanager
def _second_network(cluster: Cluster) -> Iterator[str]:
    """A veth link between node 0 and the hostile host on OTHER_SUBNET (made inside both namespaces, removed
    after): node 0's address there."""
    ends = [(cluster.host(0), 0), (cluster.host(HOSTILE), HOSTILE)]
    subprocess.run(["ip", "link", "add", "eth1", "netns", ends[0][0], "type", "veth", "peer", "name", "eth1",
                    "netns", ends[1][0]], check=True, capture_output=True)
    try:
        for ns, node in ends:
            subprocess.run(["ip", "-n", ns, "addr", "add", f"{OTHER_SUBNET}.{10 + node}/24", "dev", "eth1"],
                           check=True)
            subprocess.run(["ip", "-n", ns, "link", "set", "eth1", "up"], check=True)
        yield f"{OTHER_SUBNET}.10"
    finally:
        subprocess.run(["ip", "-n", ends[0][0], "link", "del", "eth1"], capture_output=True)


def _assert_closed_to_other_subnets(cluster: Cluster, job: Job, folder: Path) -> None:
    """No host listens on every interface; from another subnet every port the job listens on in node 0 (its
    store relay, the store on loopback, its rank's gloo listeners) refuses the connection, while the relay's
    port on the job's own network does connect (the probe can tell an open port from a closed one)."""
    for node in range(NODES):
        wide = cluster.wildcard_listeners(node)
        assert not wide, f"node {node} listens on every interface:\n" + "\n".join(wide)
    ports = sorted({int(address.rsplit(":", 1)[1]) for address in cluster.listeners(0)})
    assert job.port in ports, (job.port, cluster.listeners(0))
    own = f"{cluster.addr(0)}:{job.port}"
    with _second_network(cluster) as other:
        code, out, err = _run_in(cluster, [sys.executable, "-c", _PROBE, own, *(f"{other}:{p}" for p in ports)],
                                 _env(), folder, 60)
    answers = dict(json.loads(line) for line in out.splitlines() if line.startswith("["))
    assert code == 0 and answers.pop(own, None) == "connected", (code, answers, err)
    assert len(answers) == len(ports) and set(answers.values()) == {"ECONNREFUSED"}, answers


def test_strangers_on_the_network_change_nothing(cluster: Cluster, tmp_path: Path) -> None:
    secret = Path(os.environ["FABRICLITE_JOB_SECRET_FILE"]).read_bytes().strip()
    reference = Job(cluster, tmp_path / "reference", attacked=False)
    reference.finish()

    job = Job(cluster, tmp_path / "attacked", attacked=True)
    job.wait_for_attack_step()
    assert not any(secret in line for line in _cmdlines()), "the job secret is on a command line"
    host0 = cluster.host(0)
    code, out, err = _run_in(cluster, [sys.executable, ATTACKER, host0, str(job.port)], _env(), tmp_path / "attack")
    results = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert {r["attack"] for r in results} == {
        "forged_failure", "forged_restart_decision", "rank_zero_first_release", "check_in_count",
        "list_keys_and_get", "overwrite_process_group_keys", "flood", "silence", "torch_greeting"}, (code, err)
    assert all(r["ok"] for r in results), results
    for r in results:
        if "closed_s" in r:
            assert r["closed_s"] <= CLOSE_BOUND_S, r
    flood = next(r for r in results if r["attack"] == "flood")
    assert flood["sent"] < 16 << 20, flood  # closed after the handshake's bytes, long before 200 MiB went in

    # a fourth node with another secret: refused, named, within 5 s of its start-up
    wrong = tmp_path / "wrong.secret"
    from fabriclite.distributed import job_secret
    job_secret.write_new_secret(str(wrong))
    started = time.monotonic()
    assert _run_in(cluster, [sys.executable, "-c", "import fabriclite.cli"], _env(), tmp_path / "startup")[0] == 0
    startup = time.monotonic() - started
    started = time.monotonic()
    code, _, err = _run_in(cluster, [
        sys.executable, "-m", "fabriclite.cli", "run", "--accelerator", "cpu", "--devices", "1", "--num-nodes",
        str(NODES), "--node-rank", "2", "--main-address", host0, "--main-port", str(job.port),
        "--job-secret-file", str(wrong), JOB], _env(FABRICLITE_JOB_SECRET_FILE=str(wrong)), tmp_path / "intruder", 60)
    took = time.monotonic() - started
    assert code not in (0, None), err
    assert f"{host0}:{job.port}" in err and "job secret" in err, err
    assert took <= startup + WRONG_SECRET_BOUND_S, (took, startup, err)

    _assert_closed_to_other_subnets(cluster, job, tmp_path / "other-subnet")

    job.done.touch()
    job.finish()
    want, got = torch.load(reference.weights), torch.load(job.weights)
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    events = job.events()
    assert events and not [e for e in events if e["event"] == "failure"], events
    assert [e for e in events if e["event"] == "store_refused"], "no refusal was recorded"
    stored, unattacked = json.loads(job.keys.read_text()), json.loads(reference.keys.read_text())
    # no key of theirs: the same keys as the unattacked run, but for the records the job writes only because the
    # attacked run lasts longer: its ranks' collective progress (published while they wait out the attacks in an
    # all-reduce) and its supervisors' straggler reports (one per window, two windows kept; control_plane/keys.py)
    waiting = {f"{keys.PREFIX}/{keys.collective_progress(rank)}" for rank in range(NODES)}
    waiting |= {f"{keys.PREFIX}/{keys.straggler_report(window, node)}" for node in range(NODES) for window in (0, 1)}
    assert set(stored["keys"]) - waiting == set(unattacked["keys"]) - waiting, \
        set(stored["keys"]) ^ set(unattacked["keys"])
    assert not stored["attacker_in_a_value"] and not stored["secret_in_a_value"]
    for path in [*job.logs_dir.rglob("*"), *job.out, *job.err]:
        if path.is_file():
            assert secret not in path.read_bytes(), f"the job secret is in {path}"


def test_what_stays_open_under_fault_tolerant_is_written_down() -> None:
    text = (REPO / "docs" / "security.md").read_text()
    for open_door in ("POST /replica/<id>/kill", "`Kill` RPC", "ManagerServer binds"):
        assert open_door in text, open_door
