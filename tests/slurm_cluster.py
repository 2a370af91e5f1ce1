"""A real Slurm for the tests that need one: Debian's ``munged``, ``slurmctld`` and one
``slurmd`` per compute node, each daemon in a network namespace of its own (the controller's
and every node's, joined by a bridge), with its own hostname and ``/etc/hosts`` (a private
mount and UTS namespace), its own spool, log and pid files under the test's folder. Nothing
is installed or contacted outside what it makes; everything it started is killed and every
namespace removed when it ends.

Why the namespaces are entered with ``nsenter --net`` and ``unshare --mount --uts`` rather
than ``ip netns exec``: the latter remounts ``/sys``, which hides ``/sys/fs/cgroup``, and
slurmd then refuses to start ("Unable to initialize cgroup plugin").
"""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import netns

DAEMONS = ("munged", "slurmctld", "slurmd")
SUBNET = "10.204.0"


def missing() -> str | None:
    """Why a Slurm cannot be started here, or None."""
    absent = [d for d in (*DAEMONS, "sbatch", "nsenter", "unshare", "ip")
              if shutil.which(d) is None]
    if absent:
        return (f"Slurm's daemons are not installed ({', '.join(absent)} not found): "
                "apt-get install slurmctld slurmd munge")
    if os.geteuid() != 0:
        return "starting Slurm's daemons in network namespaces needs root"
    probe = f"dm{os.getpid()}slurmprobe"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode:
        return f"cannot make a network namespace ({made.stderr.strip()})"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


@dataclass
class SlurmCluster:
    folder: Path
    conf: Path
    controller: str           # namespace the controller (and the test's client commands) run in
    nodes: list[str]          # node names, n1..nN
    addresses: dict[str, str]  # node name -> address
    namespaces: list[str]
    environment: dict[str, str]
    daemons: list[subprocess.Popen] = field(default_factory=list)

    def command(self, *args: str, check: bool = True, timeout: float = 60,
                env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
        """A Slurm client command (sbatch, squeue, scancel, scontrol) run on the controller."""
        return subprocess.run(
            ["nsenter", f"--net=/run/netns/{self.controller}", *args], capture_output=True,
            text=True, check=check, timeout=timeout, env=dict(self.environment, **(env or {})))

    def job_state(self, job: str) -> str:
        out = self.command("scontrol", "-o", "show", "job", job, check=False).stdout
        for item in out.split():
            if item.startswith("JobState="):
                return item.split("=", 1)[1]
        return "GONE"

    def wait_for(self, job: str, states: set[str], timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while True:
            state = self.job_state(job)
            if state in states or time.monotonic() > deadline:
                return state
            time.sleep(0.3)

    def node_pids(self, node: str) -> list[int]:
        """Every process in the node's network namespace (its slurmd, steps and ranks)."""
        return netns.pids(self.namespaces[1 + self.nodes.index(node)])

    def kill_node(self, node: str) -> None:
        """Every process of the node at once, its slurmd too: a machine lost."""
        netns.kill_all(self.namespaces[1 + self.nodes.index(node)])

    def start_slurmd(self, node: str) -> None:
        """The node's slurmd (again, after :meth:`kill_node`: the machine back)."""
        namespace = self.namespaces[1 + self.nodes.index(node)]
        self.daemons.append(_in_namespace(
            namespace, node, self.folder / "run" / f"hosts-{node}",
            ["slurmd", "-D", "-N", node, "-f", str(self.conf)],
            self.folder / "log" / f"slurmd-{node}.out"))

    def node_state(self, node: str) -> str:
        out = self.command("sinfo", "-h", "-n", node, "-N", "-o", "%T", check=False).stdout
        return out.strip() or "unknown"

    def start_now(self, job: str) -> None:
        """A requeued job may start at once: Slurm otherwise holds it back for 121 s.

        Call it only after :meth:`wait_for_terminate` on a node that was lost: the 121 s
        also let the controller's retried terminate of the lost run reach the node, and
        when that lands after the job started again (same job id), slurmctld 22.05 takes
        the node out of the new run's count (srun: "SLURM_JOB_NUM_NODES ... conflicts with
        allocated node count (2 != 1)", then "Requested nodes are busy" for ever)."""
        self.command("scontrol", "update", f"JobId={job}", "StartTime=now")

    def wait_for_terminate(self, node: str, job: str, since: int, timeout: float) -> bool:
        """Until the node's slurmd, started again, has received the controller's terminate
        of ``job``'s lost run (its log past byte ``since``, from :meth:`log_size`): whether it
        did within ``timeout`` seconds (under load the controller's retry can come later;
        then leave the requeued job to Slurm's own hold, which is there for it)."""
        path = self.folder / "log" / f"slurmd-{node}.log"
        line = f"_rpc_terminate_job: uid = 0 JobId={job}\n"
        deadline = time.monotonic() + timeout
        while True:
            with path.open("rb") as f:
                f.seek(since)
                if line.encode() in f.read():
                    return True
            if time.monotonic() > deadline:
                return False
            time.sleep(0.2)

    def log_size(self, name: str) -> int:
        path = self.folder / "log" / f"{name}.log"
        return path.stat().st_size if path.exists() else 0

    def log(self, name: str) -> str:
        path = self.folder / "log" / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""


def _config(folder: Path, nodes: list[str], addresses: dict[str, str], cpus: int,
            socket: Path) -> str:
    spool, log = folder / "spool", folder / "log"
    node_lines = [f"NodeName={n} NodeHostname={n} NodeAddr={addresses[n]} CPUs={cpus} "
                  f"RealMemory=1000 State=UNKNOWN" for n in nodes]
    return "\n".join([
        "ClusterName=devmeshtest",
        f"SlurmctldHost=ctl({SUBNET}.1)",
        "SlurmUser=root",
        "SlurmdUser=root",
        "AuthType=auth/munge",
        "CredType=cred/munge",
        f"AuthInfo=socket={socket}",
        "SlurmctldPort=6817",
        "SlurmdPort=6818",
        f"StateSaveLocation={spool}/ctld",
        f"SlurmdSpoolDir={spool}/%n",
        f"SlurmctldPidFile={folder}/run/slurmctld.pid",
        f"SlurmdPidFile={folder}/run/slurmd-%n.pid",
        f"SlurmctldLogFile={log}/slurmctld.log",
        f"SlurmdLogFile={log}/slurmd-%n.log",
        "SlurmctldDebug=info",
        "SlurmdDebug=debug",  # the RPCs a node receives: see SlurmCluster.wait_for_terminate
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "JobAcctGatherType=jobacct_gather/none",
        "AccountingStorageType=accounting_storage/none",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_CPU",
        "SchedulerType=sched/builtin",
        "MpiDefault=none",
        "ReturnToService=2",
        "SlurmdParameters=config_overrides",
        "SlurmdTimeout=10",
        "SlurmctldTimeout=10",
        "MessageTimeout=10",
        "KillWait=5",
        "InactiveLimit=0",
        "MinJobAge=300",
        *node_lines,
        f"PartitionName=test Nodes={','.join(nodes)} Default=YES MaxTime=INFINITE State=UP",
        "",
    ])


def _in_namespace(namespace: str, hostname: str, hosts: Path, argv: list[str],
                  log: Path) -> subprocess.Popen:
    """``argv`` on ``hostname``: the namespace's network, its own hostname and /etc/hosts."""
    inner = (f"hostname {shlex.quote(hostname)} && mount --bind {shlex.quote(str(hosts))} "
             f"/etc/hosts && exec {shlex.join(argv)}")
    return subprocess.Popen(
        ["nsenter", f"--net=/run/netns/{namespace}", "unshare", "--mount", "--uts", "sh", "-c",
         inner], stdout=log.open("ab"), stderr=subprocess.STDOUT, start_new_session=True)


@contextlib.contextmanager
def slurm_cluster(folder: Path, nodes: int = 2, cpus: int = 8,
                  environment: dict[str, str] | None = None,
                  timeout: float = 60) -> Iterator[SlurmCluster]:
    """A controller and ``nodes`` compute nodes, up and idle; torn down after."""
    folder.mkdir(parents=True, exist_ok=True)
    # munged checks every folder above its socket: world-executable, not writable by others
    os.chmod(folder, 0o755)
    for sub in ("spool/ctld", "log", "run", "munge"):
        (folder / sub).mkdir(parents=True, exist_ok=True)
    os.chmod(folder / "munge", 0o711)
    names = [f"n{i + 1}" for i in range(nodes)]
    addresses = {name: f"{SUBNET}.{i + 2}" for i, name in enumerate(names)}
    for name in names:
        (folder / "spool" / name).mkdir(exist_ok=True)
    key, socket = folder / "munge" / "munge.key", folder / "munge" / "munge.socket"
    key.write_bytes(os.urandom(1024))
    os.chmod(key, 0o400)
    conf = folder / "slurm.conf"
    conf.write_text(_config(folder, names, addresses, cpus, socket))
    hosts_text = "127.0.0.1 localhost\n" + f"{SUBNET}.1 ctl\n" + "".join(
        f"{addresses[n]} {n}\n" for n in names)
    env = dict(os.environ, SLURM_CONF=str(conf), **(environment or {}))
    for hostname in ("ctl", *names):
        (folder / "run" / f"hosts-{hostname}").write_text(hosts_text)
    with contextlib.ExitStack() as stack:
        namespaces = stack.enter_context(netns.bridged(
            f"dm{os.getpid()}s", [f"{SUBNET}.1", *addresses.values()]))
        cluster = SlurmCluster(folder, conf, namespaces[0], names, addresses, namespaces, env)
        stack.callback(_stop, cluster.daemons)
        _start_daemons(cluster, key, socket, timeout)
        yield cluster


def _stop(daemons: list[subprocess.Popen]) -> None:
    for daemon in daemons:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(daemon.pid, signal.SIGKILL)
        daemon.wait(timeout=30)


def _start_daemons(cluster: SlurmCluster, key: Path, socket: Path, timeout: float) -> None:
    """munged, slurmctld and every slurmd, returning once every node is idle."""
    folder, log = cluster.folder, cluster.folder / "log"
    daemons = cluster.daemons
    daemons.append(subprocess.Popen(
        ["munged", "--foreground", "--force", f"--socket={socket}", f"--key-file={key}",
         f"--pid-file={folder}/run/munged.pid", f"--log-file={log}/munged.log",
         f"--seed-file={folder}/munge/seed"],
        stdout=(log / "munged.out").open("ab"), stderr=subprocess.STDOUT,
        start_new_session=True))
    _wait(socket.exists, timeout, "munged's socket", cluster)
    daemons.append(_in_namespace(cluster.controller, "ctl", folder / "run" / "hosts-ctl",
                                 ["slurmctld", "-D", "-i", "-f", str(cluster.conf)],
                                 log / "slurmctld.out"))
    for name in cluster.nodes:
        cluster.start_slurmd(name)

    def idle() -> bool:
        for d in daemons:
            if d.poll() is not None:
                raise RuntimeError(f"a Slurm daemon exited ({d.args[-1]}):\n" + _logs(cluster))
        out = cluster.command("sinfo", "-h", "-N", "-o", "%N %T", check=False).stdout
        states = dict(line.split() for line in out.splitlines() if line.strip())
        return all(states.get(n) == "idle" for n in cluster.nodes)

    _wait(idle, timeout, "every node idle in sinfo", cluster)


def _logs(cluster: SlurmCluster) -> str:
    parts = []
    for path in sorted((cluster.folder / "log").glob("*")):
        parts.append(f"--- {path.name}\n" + path.read_text(errors="replace")[-2000:])
    return "\n".join(parts)


def _wait(ready, timeout: float, what: str, cluster: SlurmCluster) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        if time.monotonic() > deadline:
            raise RuntimeError(f"Slurm did not come up: no {what} in {timeout:.0f} s\n"
                               + _logs(cluster))
        time.sleep(0.3)
