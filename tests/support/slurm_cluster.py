"""A real SLURM cluster of three nodes on this machine, for the SLURM engine lane (and benchmarks/engine_parts/slurm.py).

Debian's slurm-wlm (built with multiple-slurmd) and munge, installed by scripts/engines/slurm.sh. Everything lives in
one temporary folder: a munge key and its own ``munged`` socket, ``slurm.conf`` (one ``slurmctld``, three ``slurmd
-N n1|n2|n3``, each on its own free port, ``NodeAddr=127.0.0.1``), state, spool and logs. The node names must
resolve, as on a real cluster (fabriclite's ranks meet at the first node of the job's node list): the cluster adds
``127.0.0.1 n1 n2 n3`` to /etc/hosts, marked with its own comment, and removes that line when it stops. Every job runs
through the real sbatch / srun / scontrol / scancel against these daemons.
"""
from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from typing import Callable, Dict, List, Optional, Sequence

from helpers import free_port  # below the ephemeral range, this run's own (FL_TEST_PORTS)

NODES = ("n1", "n2", "n3")
#: CPUs each node declares (slurmd's config_overrides: more than the machine has, so 3 x 2 tasks and a second
#: job fit; the jobs are small)
CPUS_PER_NODE = 8
HOSTS_FILE = "/etc/hosts"
SBIN = ("/usr/sbin", "/sbin")


def _which(tool: str) -> Optional[str]:
    return shutil.which(tool) or shutil.which(tool, path=os.pathsep.join(SBIN))


def missing_tools() -> List[str]:
    """SLURM / munge programs this cluster needs that are not installed."""
    return [t for t in ("munged", "slurmctld", "slurmd", "sbatch", "srun", "scontrol", "scancel") if not _which(t)]


class SlurmError(RuntimeError):
    """The cluster did not come up or a SLURM command failed (the message holds the command and the logs' tail)."""


class SlurmCluster:
    """``start()`` the daemons, run jobs with :meth:`sbatch` / :meth:`srun`, watch them with :meth:`job`,
    ``stop()`` everything (every daemon is started here, and stopped by its pid)."""

    def __init__(self, root: Optional[str] = None, nodes: Sequence[str] = NODES) -> None:
        self.root = root or tempfile.mkdtemp(prefix="fabriclite-slurm-")
        self.nodes = tuple(nodes)
        self.conf = os.path.join(self.root, "slurm.conf")
        self.munge_socket = os.path.join(self.root, "munge", "munge.sock")
        self.hosts_marker = f"# fabriclite slurm lane {os.getpid()} {self.root}"
        self.daemons: Dict[str, int] = {}

    # ------------------------------------------------------------------ lifecycle
    def env(self, extra: Optional[Dict[str, str]] = None) -> Dict[str, str]:
        """This process's environment without another job's variables, pointed at this cluster."""
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_", "SRUN_", "MASTER_",
                                                                         "FABRICLITE_", "TORCHELASTIC_"))
               or k == "FABRICLITE_JOB_SECRET_FILE"}  # the suite's job secret (tests/conftest.py): jobs run closed
        env.update({"SLURM_CONF": self.conf, "PATH": os.pathsep.join([env.get("PATH", ""), *SBIN])})
        env.update(extra or {})
        return env

    def start(self, timeout: float = 90) -> "SlurmCluster":
        missing = missing_tools()
        if missing:
            raise SlurmError(f"SLURM / munge programs missing: {missing}; run scripts/engines/slurm.sh as root.")
        munge = os.path.join(self.root, "munge")
        os.makedirs(munge, mode=0o700, exist_ok=True)
        os.chmod(self.root, 0o755)  # munged wants its socket's folders searchable
        key = os.path.join(munge, "munge.key")
        with open(key, "wb") as f:
            f.write(os.urandom(128))
        os.chmod(key, 0o600)
        self._run([_which("munged"), "-f", f"--socket={self.munge_socket}", f"--key-file={key}",
                   f"--log-file={munge}/munged.log", f"--pid-file={munge}/munged.pid", f"--seed-file={munge}/seed"])
        self.daemons["munged"] = self._pid(f"{munge}/munged.pid", timeout=20)
        self._write_conf()
        self._map_hosts()
        self._run([_which("slurmctld"), "-i", "-f", self.conf])
        self.daemons["slurmctld"] = self._pid(os.path.join(self.root, "slurmctld.pid"), timeout=30)
        for node in self.nodes:
            os.makedirs(os.path.join(self.root, "spool", node), exist_ok=True)
            self._run([_which("slurmd"), "-N", node, "-f", self.conf])
            self.daemons[f"slurmd-{node}"] = self._pid(os.path.join(self.root, f"slurmd-{node}.pid"), timeout=30)
        self.wait(lambda: self.idle_nodes() == len(self.nodes), timeout, "every node idle")
        return self

    def stop(self) -> None:
        """Cancel every job, stop the daemons (slurmd first), remove the hosts line. Safe to call twice."""
        if "slurmctld" in self.daemons:
            subprocess.run(["scancel", "--full", "--user=root"], env=self.env(), capture_output=True, timeout=30)
        for name in [n for n in self.daemons if n.startswith("slurmd")] + ["slurmctld", "munged"]:
            pid = self.daemons.pop(name, None)
            if pid is None:
                continue
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                continue
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline and _alive(pid):
                time.sleep(0.1)
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        self._unmap_hosts()

    def __enter__(self) -> "SlurmCluster":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ------------------------------------------------------------------ jobs
    def command(self, args: Sequence[str], env: Optional[Dict[str, str]] = None, timeout: float = 60,
                check: bool = True, cwd: Optional[str] = None) -> subprocess.CompletedProcess:
        """A SLURM command (sbatch, scontrol, scancel, srun, ...) against this cluster."""
        done = subprocess.run(list(args), env=self.env(env), capture_output=True, text=True, timeout=timeout,
                              cwd=cwd or self.root)
        if check and done.returncode != 0:
            raise SlurmError(f"{' '.join(args)} exited {done.returncode}: {done.stderr.strip()}\n{self.logs_tail()}")
        return done

    def sbatch(self, script: Optional[str], args: Sequence[str] = (), env: Optional[Dict[str, str]] = None,
               cwd: Optional[str] = None) -> str:
        """Submit ``script`` (a file; None with ``--wrap=...`` in ``args``) with sbatch ``args``; the job id."""
        done = self.command(["sbatch", "--parsable", *args, *([script] if script else [])], env, cwd=cwd)
        return done.stdout.strip().split(";")[0]

    def job(self, job_id: str) -> Dict[str, str]:
        """``scontrol show job -o``'s fields (JobState, Restarts, ExitCode, ...); {} once SLURM forgot the job.
        An array job's id gives its first task; use ``array_tasks`` for every task."""
        tasks = self.array_tasks(job_id)
        return tasks[0] if tasks else {}

    def array_tasks(self, job_id: str) -> List[Dict[str, str]]:
        done = self.command(["scontrol", "show", "job", "-o", job_id], check=False)
        return [_fields(line) for line in done.stdout.splitlines() if line.strip()]

    def state(self, job_id: str) -> str:
        return self.job(job_id).get("JobState", "")

    def wait_state(self, job_id: str, states: Sequence[str], timeout: float, what: str = "") -> Dict[str, str]:
        """Wait until the job is in one of ``states``; its fields. SlurmError naming the job's last state."""
        seen: Dict[str, str] = {}

        def reached() -> bool:
            seen.clear()
            seen.update(self.job(job_id))
            return seen.get("JobState") in states

        self.wait(reached, timeout, what or f"job {job_id} in {'/'.join(states)} (last: {seen.get('JobState')})")
        return dict(seen)

    def start_now(self, job_id: str) -> None:
        """The test harness's speed-up after a requeue: SLURM holds a requeued job for about 2 minutes (its begin
        time); ``scontrol update JobId=... StartTime=now`` lets it start at once. Nothing else changes. It waits
        first until no node is still completing a job, and 2 s past the requeue: slurmd revokes the job's old
        credential at the requeue, to the second, and a start within that second is refused ("Job credential
        revoked"), which SLURM's own delay never meets."""
        self.wait(lambda: not self.completing(), 120, "the nodes done with the requeued job")
        time.sleep(2)  # past the revocation's second (see above)
        self.command(["scontrol", "update", f"JobId={job_id}", "StartTime=now"])

    def completing(self) -> List[str]:
        """Nodes still completing a job (sinfo's ``comp`` state)."""
        done = self.command(["sinfo", "-h", "-N", "-o", "%N %t"], check=False)
        return [line.split()[0] for line in done.stdout.splitlines() if "comp" in line]

    def idle_nodes(self) -> int:
        done = self.command(["sinfo", "-h", "-N", "-o", "%N %t"], check=False)
        return sum(1 for line in done.stdout.splitlines() if line.split()[-1:] == ["idle"])

    def wait(self, condition: Callable[[], bool], timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            if time.monotonic() > deadline:
                raise SlurmError(f"timed out after {timeout:g} s waiting for {what}\n{self.logs_tail()}")
            time.sleep(0.25)

    def logs_tail(self, lines: int = 15) -> str:
        out = []
        for name in ["slurmctld.log", *(f"slurmd-{n}.log" for n in self.nodes)]:
            path = os.path.join(self.root, name)
            if os.path.exists(path):
                with open(path, errors="replace") as f:
                    out.append(f"--- {name}\n" + "".join(f.readlines()[-lines:]))
        return "\n".join(out)

    # ------------------------------------------------------------------ internals
    def _write_conf(self) -> None:
        host = socket.gethostname().split(".")[0]
        r = self.root
        lines = [
            "ClusterName=fabriclite",
            f"SlurmctldHost={host}(127.0.0.1)",
            f"SlurmctldPort={free_port()}",
            "AuthType=auth/munge", "CredType=cred/munge", f"AuthInfo=socket={self.munge_socket}",
            "SlurmUser=root", "SlurmdUser=root",
            f"StateSaveLocation={r}/state", f"SlurmdSpoolDir={r}/spool/%n",
            f"SlurmctldPidFile={r}/slurmctld.pid", f"SlurmdPidFile={r}/slurmd-%n.pid",
            f"SlurmctldLogFile={r}/slurmctld.log", f"SlurmdLogFile={r}/slurmd-%n.log",
            "SlurmctldDebug=info", "SlurmdDebug=info",
            # no cgroups: the machine may be a container; processes are tracked through their parents
            "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none", "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none", "JobCompType=jobcomp/none", "MpiDefault=none",
            "SchedulerType=sched/builtin", "SelectType=select/cons_tres", "SelectTypeParameters=CR_CPU",
            "SlurmdParameters=config_overrides", "ReturnToService=2", "JobRequeue=1",
            # SLURM's defaults where a preempted job's timing depends on them (KillWait: SIGTERM -> SIGKILL)
            "KillWait=30", "MinJobAge=3600",
        ]
        os.makedirs(os.path.join(r, "state"), exist_ok=True)
        for node in self.nodes:
            lines.append(f"NodeName={node} NodeHostname={host} NodeAddr=127.0.0.1 Port={free_port()} "
                         f"CPUs={CPUS_PER_NODE} State=UNKNOWN")
        lines.append(f"PartitionName=main Nodes={','.join(self.nodes)} Default=YES MaxTime=INFINITE State=UP")
        with open(self.conf, "w") as f:
            f.write("\n".join(lines) + "\n")

    def _map_hosts(self) -> None:
        self._unmap_hosts(stale_only=True)  # a lane killed before its stop() left its line: drop it
        unresolved = [n for n in self.nodes if not _resolves_to_loopback(n)]
        if not unresolved:
            return
        with open(HOSTS_FILE, "a") as f:
            f.write(f"127.0.0.1 {' '.join(unresolved)} {self.hosts_marker}\n")

    def _unmap_hosts(self, stale_only: bool = False) -> None:
        try:
            with open(HOSTS_FILE) as f:
                lines = f.readlines()
        except OSError:
            return

        def drop(line: str) -> bool:
            if stale_only:
                match = re.search(r"# fabriclite slurm lane (\d+) ", line)
                return match is not None and not _alive(int(match.group(1)))
            return self.hosts_marker in line

        kept = [line for line in lines if not drop(line)]
        if len(kept) != len(lines):
            # in place (/etc/hosts may be a bind mount), and never empty on the way: the file is written over, then
            # cut to length. Our line is appended last, so the kept lines are the file's first bytes and a process
            # that resolves a name meanwhile (tests run beside this lane) reads a whole hosts file.
            with open(HOSTS_FILE, "r+") as f:
                f.write("".join(kept))
                f.truncate()

    def _run(self, args: Sequence[str]) -> None:
        done = subprocess.run(list(args), env=self.env(), capture_output=True, text=True, timeout=60)
        if done.returncode != 0:
            raise SlurmError(f"{' '.join(args)} exited {done.returncode}: {done.stderr.strip()}\n{self.logs_tail()}")

    def _pid(self, pid_file: str, timeout: float) -> int:
        self.wait(lambda: os.path.exists(pid_file) and open(pid_file).read().strip().isdigit(), timeout, pid_file)
        with open(pid_file) as f:
            return int(f.read().strip())


def _fields(line: str) -> Dict[str, str]:
    """``scontrol show job -o``'s ``Key=Value`` pairs (values may hold '=' but no spaces, except Command's)."""
    fields: Dict[str, str] = {}
    for match in re.finditer(r"(\w[\w:/]*)=(\S*)", line):
        fields.setdefault(match.group(1), match.group(2))
    return fields


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie of ours counts as gone
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _resolves_to_loopback(name: str) -> bool:
    try:
        return socket.gethostbyname(name).startswith("127.")
    except OSError:
        return False
