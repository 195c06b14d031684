"""A real Slurm cluster of two "nodes" on this host, for testing the sbatch templates: Debian's
munged, slurmctld and one slurmd per node (n1, n2: localhost on ports of their own), started
from a temporary configuration and torn down afterwards. Needs the packages install.sh
installs (slurmctld slurmd slurm-client munge) and root (slurmd runs the jobs' steps)."""
from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

NODES = ("n1", "n2")
HOSTS_LINE = "127.0.0.1 " + " ".join(NODES) + "  # rlfactory-megatron slurm test"


RAY_WORKER_PORTS_END = 19_999  # Ray's default max_worker_port


def free_ports(count: int) -> list[int]:
    """Ports that are free now, each with the next one free too (train.sbatch's Ray head takes
    MASTER_PORT + 1), below the kernel's ephemeral range: a port picked now is bound later by
    slurmctld, slurmd or a job's rendezvous, and in between any process binding port 0 or opening a
    connection may be handed a port of the ephemeral range, never one below it. Above Ray's worker
    ports (10002-19999, its default): Ray refuses a head port among them, and its workers bind them."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    ports: list[int] = []
    for port in random.Random().sample(range(RAY_WORKER_PORTS_END + 1, low - 1, 2), 200):
        if all(_bindable(p) for p in (port, port + 1)):
            ports.append(port)
            if len(ports) == count:
                return ports
    raise RuntimeError(f"no {count} free port pairs below the ephemeral range (< {low})")


def _bindable(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _path_with_sbin() -> str:
    path = os.environ.get("PATH", "")
    return ":".join([path, *(d for d in ("/usr/sbin", "/sbin") if d not in path.split(":"))])


def missing() -> str | None:
    """Why no cluster can start here, or None."""
    tools = [t for t in ("munged", "slurmctld", "slurmd", "sbatch", "scontrol")
             if shutil.which(t, path=_path_with_sbin()) is None]
    if tools:
        return f"Slurm/munge binaries missing: {', '.join(tools)} (install.sh installs them)"
    if os.geteuid() != 0:
        return "the Slurm test cluster needs root (slurmd runs the jobs)"
    return None


@dataclass
class SlurmCluster:
    root: Path
    cpus_per_node: int = 2
    procs: list[subprocess.Popen] = field(default_factory=list)

    @property
    def conf(self) -> Path:
        return self.root / "etc" / "slurm.conf"

    def env(self) -> dict[str, str]:
        return dict(os.environ, SLURM_CONF=str(self.conf), PATH=_path_with_sbin())

    def start(self) -> "SlurmCluster":
        for sub in ("etc", "state", "log", "munge", *(f"spool/{n}" for n in NODES)):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        munge = self.root / "munge"
        os.chmod(munge, 0o700)
        key = munge / "munge.key"
        key.write_bytes(os.urandom(1024))
        os.chmod(key, 0o400)
        socket_path = munge / "munge.socket"
        self.procs.append(subprocess.Popen(
            [shutil.which("munged", path=_path_with_sbin()), "--foreground", "--force", f"--key-file={key}", f"--socket={socket_path}",
             f"--pid-file={munge / 'munged.pid'}", f"--log-file={munge / 'munged.log'}",
             f"--seed-file={munge / 'munged.seed'}"], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT))
        self._wait(lambda: socket_path.exists(), "munged's socket")
        ctl, *node_ports = free_ports(1 + len(NODES))
        memory_mb = 4096
        nodes = "\n".join(f"NodeName={n} NodeHostname=localhost NodeAddr=127.0.0.1 Port={p} "
                          f"CPUs={self.cpus_per_node} RealMemory={memory_mb} State=UNKNOWN"
                          for n, p in zip(NODES, node_ports))
        self.conf.write_text(f"""ClusterName=rlftest
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort={ctl}
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={socket_path}
SlurmUser=root
SlurmdUser=root
StateSaveLocation={self.root / 'state'}
SlurmdSpoolDir={self.root / 'spool'}/%n
SlurmctldPidFile={self.root / 'slurmctld.pid'}
SlurmdPidFile={self.root / 'spool'}/%n/slurmd.pid
SlurmctldLogFile={self.root / 'log' / 'slurmctld.log'}
SlurmdLogFile={self.root / 'log'}/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
MpiDefault=none
MailProg=/bin/true
ReturnToService=2
SchedulerType=sched/backfill
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
KillWait=5
InactiveLimit=0
{nodes}
PartitionName=debug Nodes={','.join(NODES)} Default=YES MaxTime=INFINITE State=UP
""")
        env = self.env()
        self.procs.append(subprocess.Popen([shutil.which("slurmctld", path=env["PATH"]), "-D", "-i"], env=env, stdout=subprocess.DEVNULL,
                                           stderr=subprocess.STDOUT))
        for node in NODES:
            self.procs.append(subprocess.Popen([shutil.which("slurmd", path=env["PATH"]), "-D", "-N", node], env=env, stdout=subprocess.DEVNULL,
                                               stderr=subprocess.STDOUT))
        self._wait(self._nodes_idle, "both slurmd nodes idle", timeout=60)
        return self

    def _nodes_idle(self) -> bool:
        out = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %t"], env=self.env(), capture_output=True, text=True)
        states = dict(line.split() for line in out.stdout.splitlines() if line.strip())
        return all(states.get(n) == "idle" for n in NODES)

    def _wait(self, ready, what: str, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            dead = [p.args[0] for p in self.procs if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                logs = "\n".join(f"--- {p.name}:\n{p.read_text()[-1500:]}" for p in (self.root / "log").glob("*.log"))
                raise RuntimeError(f"Slurm test cluster: no {what} ({'exited: ' + ', '.join(dead) if dead else 'timeout'})\n{logs}")
            time.sleep(0.2)

    def sbatch(self, *args: str, cwd: Path, env: dict[str, str] | None = None, timeout: float = 900):
        """`sbatch --wait ...`: returns when the job ends, with its exit status as the return code."""
        env = {**self.env(), **(env or {})}
        # The templates' default port (20000 + job id) may be held by another test's process on
        # this one host; a free one keeps the jobs apart (a cluster's nodes run one job each).
        env.setdefault("MASTER_PORT", str(free_ports(1)[0]))
        return subprocess.run(["sbatch", "--wait", *args], cwd=cwd, env=env,
                              capture_output=True, text=True, timeout=timeout)

    def squeue(self) -> str:
        return subprocess.run(["squeue", "-h"], env=self.env(), capture_output=True, text=True).stdout

    def stop(self) -> None:
        for proc in reversed(self.procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()


def add_hosts_entry() -> bool:
    """n1/n2 resolve to this host (the templates use node names as addresses, as on a cluster)."""
    hosts = Path("/etc/hosts")
    text = hosts.read_text()
    if HOSTS_LINE in text:
        return False
    hosts.write_text(text.rstrip("\n") + "\n" + HOSTS_LINE + "\n")
    return True


def remove_hosts_entry() -> None:
    hosts = Path("/etc/hosts")
    hosts.write_text("".join(line + "\n" for line in hosts.read_text().splitlines() if line != HOSTS_LINE))
