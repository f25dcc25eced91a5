"""A real three-node SLURM cluster on this one machine, for the tests that run the sbatch wrapper.

Debian's munge, slurmctld and slurmd (installed with apt when missing), started by hand in a
temporary directory: one munged, one slurmctld, three slurmd (node1 to node3) on 127.0.0.1, each
on its own free port, and stopped by PID (two train and one stands by in the standby tests; the
others ask for two). Root only: slurmd starts jobs as their user, and the node names must resolve
(``127.0.0.1 node1 node2 node3`` is added to /etc/hosts, and taken out again).
"""

import contextlib
import fcntl
import os
import random
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Dict, Iterator, List, Optional

import psutil

PACKAGES = ["slurmctld", "slurmd", "slurm-client", "munge"]
NODES = ("node1", "node2", "node3")
_RDZV_BASE = 29400  # ftlaunch's endpoint under SLURM: first host, 29400 + job id % 1000
_LOCK = Path(tempfile.gettempdir()) / "ftlaunch-tests-slurm.lock"


@contextlib.contextmanager
def one_cluster_at_a_time(timeout: float = 500.0) -> Iterator[None]:
    """Two clusters on one machine fight (over /etc/hosts, and a cluster's clean-up kills every
    slurmstepd younger than itself: the other cluster's, whose srun then aborts the job). make
    test keeps the SLURM tests on one worker; this holds even where that grouping fails (it did
    with pytest 9.2, pytest-xdist#1386) or two test runs share the machine: the second waits."""
    with open(_LOCK, "a") as handle:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise AssertionError(f"another SLURM cluster held {_LOCK} for {timeout:g} s") from None
                time.sleep(0.2)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def port_is_free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def why_not_here() -> Optional[str]:
    """Why this machine cannot run the cluster, or None."""
    if os.geteuid() != 0:
        return "a real SLURM cluster needs root (slurmd runs jobs as their user; /etc/hosts)"
    return None


def install_if_missing() -> None:
    if all(shutil.which(tool) for tool in ("slurmctld", "slurmd", "sbatch", "munged")):
        return
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", "--no-install-recommends", *PACKAGES]
    if subprocess.run(install, env=env, capture_output=True).returncode != 0:
        subprocess.run(["apt-get", "update"], env=env, capture_output=True, check=True)
        subprocess.run(install, env=env, capture_output=True, check=True)


class SlurmCluster:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.conf = root / "slurm.conf"
        self._procs: List[subprocess.Popen] = []
        self._hosts_line = ""  # the line this cluster added to /etc/hosts ("": none)
        self._started_at = time.time()

    @property
    def env(self) -> Dict[str, str]:
        """What a client (sbatch, scontrol, and srun inside a job) needs to reach this cluster."""
        return {"SLURM_CONF": str(self.conf)}

    def start(self) -> None:
        install_if_missing()
        self._add_hosts_line()
        for sub in ("state", "log", *(f"spool/{node}" for node in NODES)):
            (self.root / sub).mkdir(parents=True)
        key = self.root / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o600)
        self._spawn(
            "munged",
            "--foreground",
            "--force",
            f"--socket={self.root / 'munge.sock'}",
            f"--key-file={key}",
            f"--pid-file={self.root / 'munged.pid'}",
            f"--seed-file={self.root / 'munged.seed'}",
            f"--log-file={self.root / 'log/munged.log'}",
        )
        self._wait_for(lambda: (self.root / "munge.sock").exists(), "munged's socket")
        self.conf.write_text(self._config())
        self._spawn("slurmctld", "-D", "-i", "-f", str(self.conf))
        for node in NODES:
            self._spawn("slurmd", "-D", "-N", node, "-f", str(self.conf))
        self._wait_for(self._nodes_idle, "every node idle in sinfo", timeout=60)

    def stop(self) -> None:
        """Every job cancelled, then the daemons, newest first, by PID, then any slurmstepd
        (slurmd's job helpers, which detach from it) that outlived them."""
        try:
            if self._procs and all(proc.poll() is None for proc in self._procs):
                self.run("scancel", "--user=root", check=False)
                self._wait_for(lambda: not self.run("squeue", "-h", check=False).strip(), "empty queue", 60)
        finally:
            for proc in reversed(self._procs):
                if proc.poll() is None:
                    proc.terminate()
                    try:
                        proc.wait(15)
                    except subprocess.TimeoutExpired:
                        proc.kill()
                        proc.wait()
            for proc in psutil.process_iter(["name", "create_time"]):
                if proc.info["name"] == "slurmstepd" and proc.info["create_time"] >= self._started_at:
                    proc.kill()
            self._remove_hosts_line()
            shutil.rmtree(self.root, ignore_errors=True)  # its config, spool and logs: /tmp kept clean

    def run(self, *argv: str, check: bool = True) -> str:
        done = subprocess.run(
            argv, env={**os.environ, **self.env}, capture_output=True, text=True, timeout=60
        )
        if check and done.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} exited {done.returncode}: {done.stderr.strip()}")
        return done.stdout

    def job(self, job_id: int) -> Dict[str, str]:
        """``scontrol show job`` as a dict (JobState, Restarts, ExitCode ...)."""
        fields = {}
        for word in self.run("scontrol", "show", "job", "-o", str(job_id)).split():
            key, _, value = word.partition("=")
            fields.setdefault(key, value)
        return fields

    def _config(self) -> str:
        host = socket.gethostname().split(".")[0]
        ports = [free_port() for _ in range(1 + len(NODES))]  # slurmctld, then each slurmd
        # Job ids start where ftlaunch's rendezvous port (29400 + id % 1000) is free.
        first_job = next(
            job
            for job in (random.randrange(1000, 100000) for _ in range(100))
            if all(port_is_free(_RDZV_BASE + (job + k) % 1000) for k in range(5))
        )
        r = self.root
        nodes = "\n".join(
            f"NodeName={node} NodeHostname=localhost NodeAddr=127.0.0.1 Port={port} CPUs=1 State=UNKNOWN"
            for node, port in zip(NODES, ports[1:])
        )
        return f"""\
ClusterName=ftlaunchtest
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ports[0]}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# cred_expire: a requeued job may start again this many seconds later (120 by default)
AuthInfo=socket={r}/munge.sock,cred_expire=10
StateSaveLocation={r}/state
SlurmdSpoolDir={r}/spool/%n
SlurmctldPidFile={r}/slurmctld.pid
SlurmdPidFile={r}/slurmd.%n.pid
SlurmctldLogFile={r}/log/slurmctld.log
SlurmdLogFile={r}/log/slurmd.%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SchedulerType=sched/builtin
# sched_interval: how often pending jobs are looked at (60 s by default); a requeued job that has
# waited out cred_expire starts at the next look, not at the next submit or exit as others do.
SchedulerParameters=sched_interval=1
SelectType=select/linear
MpiDefault=none
ReturnToService=2
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
SwitchType=switch/none
FirstJobId={first_job}
KillWait=30
# Two settings a site may have that end a step when one task ends (default: off): the wrapper turns
# both off for its step, so that a node that exits early (8: unhealthy) leaves the others training.
KillOnBadExit=1
WaitTime=2
{nodes}
PartitionName=debug Nodes={",".join(NODES)} Default=YES MaxTime=INFINITE State=UP
"""

    def _spawn(self, *argv: str) -> None:
        log = open(self.root / "log" / f"{argv[0]}.{len(self._procs)}.out", "wb")
        with log:
            env = {**os.environ, **self.env}
            proc = subprocess.Popen(
                argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        self._procs.append(proc)

    def _nodes_idle(self) -> bool:
        states = self.run("sinfo", "-h", "-N", "-o", "%N %T", check=False).split("\n")
        return sorted(line.split()[1] for line in states if line.strip()) == ["idle"] * len(NODES)

    def _wait_for(self, ready, what: str, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            dead = [p.args[0] for p in self._procs if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                raise RuntimeError(f"no {what} (dead: {dead}); logs in {self.root / 'log'}")
            time.sleep(0.2)

    def _add_hosts_line(self) -> None:
        hosts = Path("/etc/hosts")
        known = hosts.read_text()
        names = {name for line in known.splitlines() for name in line.split("#")[0].split()[1:]}
        # Only the names not there (ours from an earlier cluster, or a host's: never shadowed).
        missing = [node for node in NODES if node not in names]
        if not missing:
            return
        self._hosts_line = "127.0.0.1 " + " ".join(missing) + "  # ftlaunch tests"
        with hosts.open("a") as out:
            out.write(("" if known.endswith("\n") else "\n") + self._hosts_line + "\n")

    def _remove_hosts_line(self) -> None:
        if self._hosts_line:
            hosts = Path("/etc/hosts")
            lines = hosts.read_text().splitlines(keepends=True)
            hosts.write_text("".join(line for line in lines if line.rstrip("\n") != self._hosts_line))


def start_cluster() -> SlurmCluster:
    cluster = SlurmCluster(Path(tempfile.mkdtemp(prefix="ftl-slurm-")))
    try:
        cluster.start()
    except BaseException:
        cluster.stop()
        raise
    return cluster
