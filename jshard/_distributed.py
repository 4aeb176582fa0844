"""`jshard.init()`: JAX's distributed runtime from a launcher's or a cluster's environment.

`jshard launch` (and the manifest `jshard k8s` prints) start every worker with these variables,
which `init` reads:

| variable | meaning |
|---|---|
| `JSHARD_COORDINATOR` | `host:port` of process 0's coordination service |
| `JSHARD_NUM_PROCESSES` | how many processes make up the job |
| `JSHARD_PROCESS_ID` | this process's id, `0 .. JSHARD_NUM_PROCESSES - 1` |
| `JSHARD_LOCAL_DEVICES` | optional: simulated CPU devices for this process (a laptop rehearsal) |
| `JSHARD_INIT_TIMEOUT` | optional: seconds to wait for every process to arrive (default 300) |
| `JSHARD_LAUNCHER_PID` | set by `jshard launch`: the worker ends itself if the launcher dies |
| `JSHARD_FAILURE_DIR` | set by `jshard launch`: where a failing worker writes its failure record |
| `JSHARD_HANG_TIMEOUT` | optional: seconds without progress that end the job (`jshard launch --hang-timeout`) |
| `JSHARD_COMPILE_TIMEOUT` | optional: seconds one XLA compile may take before it counts as a hang (default 1800) |

Once joined to a job of several processes, an uncaught exception ends the process at once
(`jshard._worker.excepthook`: traceback, failure record, `os._exit(1)`) instead of leaving it in JAX's
shutdown barrier, where it would hold the whole job for minutes.

Without them, a job that SLURM or Open MPI started with several tasks (or a Kubernetes pod, where
the `kubernetes` package is installed) is left to JAX's own detection; anything else is a single
process, where `init` does nothing. On CPU the processes talk through gloo; where the coordinator
is a loopback address, gloo and the coordination service bind to loopback only; the coordination
service (which has no authentication) listens on the coordinator's address only, never on every
interface.

The hang watchdog (`hang_timeout`): this process's main thread is watched (`jshard._worker.watch_progress`).
Under `jshard launch` the launcher reads its progress and ends a hung job, naming the rank that did
not arrive; without a launcher, a process whose main thread makes no progress for `hang_timeout`
seconds (an XLA compile gets `JSHARD_COMPILE_TIMEOUT`) dumps its threads' stacks and exits with
status 124, as NCCL's watchdog ends a rank whose collective never finishes; process 0, which hosts
the coordination service, first waits (bounded) for its peers to report, as its exit aborts them.
"""

from __future__ import annotations

import ipaddress
import os
import signal
import socket
import threading
import time
from typing import NamedTuple

import jax

from jshard._compat import distributed as _jax_distributed
from jshard._compat import xla_bridge
from jshard._compat import xla_client as _jax
from jshard._devices import simulate_devices
from jshard._errors import ShardingError, api_boundary
from jshard._hang import explain as explain_hang
from jshard._worker import install_excepthook, share_progress, watch_progress

COORDINATOR, NUM_PROCESSES, PROCESS_ID = "JSHARD_COORDINATOR", "JSHARD_NUM_PROCESSES", "JSHARD_PROCESS_ID"
LOCAL_DEVICES, INIT_TIMEOUT = "JSHARD_LOCAL_DEVICES", "JSHARD_INIT_TIMEOUT"
LAUNCHER_PID = "JSHARD_LAUNCHER_PID"
DEFAULT_TIMEOUT = 300


class ProcessInfo(NamedTuple):
    """Where this process stands in the job.

    Attributes:
      process_id: this process's id (`jax.process_index()`).
      num_processes: processes in the job (`jax.process_count()`).
      coordinator: `host:port` of the coordination service, or None in a single process.
      local_devices: devices this process drives.
      devices: devices in the whole job.
    """

    process_id: int
    num_processes: int
    coordinator: str | None
    local_devices: int
    devices: int


@api_boundary
def init(
    coordinator: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    local_devices: int | None = None,
    timeout: float | None = None,
    hang_timeout: float | None = None,
) -> ProcessInfo:
    """Joins this process to its job's JAX distributed runtime; a no-op in a single process.

    Call it first thing, before any array is made. Arguments left None come from the environment
    `jshard launch` sets (module docstring), else from SLURM / Open MPI / Kubernetes as JAX detects
    them. Calling it again is harmless: it returns where the process stands. Once joined to a job of
    several processes, an uncaught exception ends this process at once rather than in JAX's shutdown
    barrier (module docstring).

    Args:
      coordinator: `host:port` of process 0's coordination service.
      num_processes: how many processes make up the job.
      process_id: this process's id.
      local_devices: simulated CPU devices for this process (`jshard.simulate_devices`).
      timeout: seconds to wait for every process to join (default 300).
      hang_timeout: seconds this process's main thread may make no progress (a collective waiting
        for a peer that never comes, a stuck read) before the job is ended with every stack dumped;
        default `JSHARD_HANG_TIMEOUT` (`jshard launch --hang-timeout`, 600 s there), else none
        alone. 0 turns the watchdog off.

    Returns:
      A `ProcessInfo`.

    Raises:
      ShardingError: part of the setting is missing or malformed, JAX has already started, or the
        job could not form within the timeout (coordinator unreachable, its port taken, fewer
        processes arriving than announced).

    Examples:
      >>> info = init()          # no launcher around: a single process
      >>> info.num_processes, info.process_id
      (1, 0)
    """
    if _jax_distributed.global_state.client is not None:
        return _info()
    setting = _setting(coordinator, num_processes, process_id, local_devices, timeout)
    if setting is None:
        if _cluster_detected():
            info = _join_detected()
            watch_progress(hang_timeout, enforce=True, rank=info.process_id, explain=explain_hang)
            return info
        if local_devices is not None or os.environ.get(LOCAL_DEVICES):
            simulate_devices(_int_env(LOCAL_DEVICES, local_devices))
        if hang_timeout:
            watch_progress(hang_timeout, enforce=True, explain=explain_hang)
        return _info()
    address, count, rank, devices, seconds = setting
    _watch_launcher()
    if count > 1 or hang_timeout:
        watch_progress(hang_timeout, enforce=not os.environ.get(LAUNCHER_PID), rank=rank, explain=explain_hang)
    if count == 1:
        if devices is not None:
            simulate_devices(devices)
        return _info()
    if xla_bridge.backends_are_initialized():
        raise ShardingError(
            f"jshard.init(): process {rank} of {count} was asked to join {address}, but JAX has already "
            "started its backend in this process, so it can no longer join a job. Call jshard.init() "
            "first thing in the script, before creating any array or calling jax.devices()."
        )
    if devices is not None:  # simulate_devices would start the backend, which must wait for the job
        jax.config.update("jax_num_cpu_devices", devices)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    _join(address, count, rank, seconds)
    return _info()


def _watch_launcher() -> None:
    """Under `jshard launch`, ends this worker (SIGKILL) within a second of the launcher's death, so
    that a launcher killed with -9 leaves no orphaned job holding ports and devices."""
    launcher = os.environ.get(LAUNCHER_PID)
    if not launcher or int(launcher) != os.getppid() or _watch_launcher.started:
        return
    _watch_launcher.started = True

    def watch():
        while os.getppid() == int(launcher):
            time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="jshard-launcher-watch", daemon=True).start()


_watch_launcher.started = False


def _setting(coordinator, num_processes, process_id, local_devices, timeout):
    """`(address, count, rank, local devices, timeout)` from the arguments and the environment;
    None where neither names a job."""
    address = coordinator or os.environ.get(COORDINATOR) or None
    count = _int_env(NUM_PROCESSES, num_processes)
    rank = _int_env(PROCESS_ID, process_id)
    if address is None and count is None and rank is None:
        return None
    missing = [name for name, v in ((COORDINATOR, address), (NUM_PROCESSES, count), (PROCESS_ID, rank)) if v is None]
    if missing and count != 1:
        raise ShardingError(
            f"jshard.init(): {', '.join(missing)} missing; a job needs all three of {COORDINATOR} "
            f"(host:port), {NUM_PROCESSES} and {PROCESS_ID} (as arguments or environment variables). "
            "Start the workers with `python -m jshard launch`, which sets them."
        )
    if count is not None and count < 1 or rank is not None and count is not None and not 0 <= rank < count:
        raise ShardingError(
            f"jshard.init(): process id {rank} with {count} processes; ids run from 0 to {count} - 1 "
            f"({PROCESS_ID}, {NUM_PROCESSES})."
        )
    if address is not None and (":" not in address or not address.rsplit(":", 1)[1].isdigit()):
        raise ShardingError(f"jshard.init(): coordinator {address!r} is not host:port (e.g. 127.0.0.1:8118).")
    seconds = float(timeout if timeout is not None else os.environ.get(INIT_TIMEOUT) or DEFAULT_TIMEOUT)
    return address, count, rank, _int_env(LOCAL_DEVICES, local_devices), seconds


def _int_env(name: str, given: int | None) -> int | None:
    if given is not None:
        return int(given)
    raw = os.environ.get(name)
    if raw in (None, ""):
        return None
    try:
        return int(raw)
    except ValueError:
        raise ShardingError(f"jshard.init(): {name}={raw!r} is not an integer.") from None


def _cluster_detected() -> bool:
    """A SLURM or Open MPI job of several tasks, or a Kubernetes pod JAX can read (it needs the
    `kubernetes` package); JAX then finds the coordinator and ids itself."""
    env = os.environ
    if "SLURM_JOB_ID" in env and "SLURM_STEP_NODELIST" in env and int(env.get("SLURM_NTASKS", "1")) > 1:
        return True
    if "OMPI_MCA_orte_hnp_uri" in env and int(env.get("OMPI_COMM_WORLD_SIZE", "1")) > 1:
        return True
    if "KUBERNETES_SERVICE_HOST" in env:
        try:
            import kubernetes  # noqa: F401
        except ImportError:
            return False
        return True
    return False


def _join_detected() -> ProcessInfo:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    try:
        jax.distributed.initialize()
    except Exception as e:  # JAX raises RuntimeError / XlaRuntimeError / ValueError here
        raise ShardingError(
            f"jshard.init(): JAX detected a cluster (SLURM, Open MPI or Kubernetes) but could not join it: {e}. "
            f"Set {COORDINATOR}, {NUM_PROCESSES} and {PROCESS_ID} to say where the job is."
        ) from e
    install_excepthook()
    share_progress()
    return _info()


def _join(address: str, count: int, rank: int, seconds: float) -> None:
    host = address.rsplit(":", 1)[0].strip("[]")
    loopback = _is_loopback(host)
    if rank != 0:
        _wait_for_coordinator(address, count, rank, seconds)
    try:
        jax.distributed.initialize(
            address,
            count,
            rank,
            cluster_detection_method="deactivate",
            initialization_timeout=max(1, int(seconds)),
            coordinator_bind_address=_bind_address(address) if rank == 0 else None,
        )
    except Exception as e:  # JAX raises RuntimeError / XlaRuntimeError here, with the gRPC status
        raise ShardingError(_join_error(address, count, rank, seconds, e)) from e
    install_excepthook()
    share_progress()
    if loopback:
        _gloo_on_loopback(host)


def _wait_for_coordinator(address: str, count: int, rank: int, seconds: float) -> None:
    """Waits until process 0's coordinator accepts connections. JAX's own client aborts the process
    when it cannot register in time; this turns an unreachable coordinator into an error first."""
    host, port = address.rsplit(":", 1)
    deadline = time.monotonic() + seconds
    while True:
        try:
            with socket.create_connection((host.strip("[]"), int(port)), timeout=min(5.0, seconds)):
                return
        except OSError as e:
            if time.monotonic() >= deadline:
                raise ShardingError(
                    f"jshard.init(): process {rank} of {count} cannot reach the coordinator at {address} within "
                    f"{seconds:g} s ({e.strerror or e}). Start process 0 (node 0, --node-rank 0) and give every node "
                    "its address and port (--master-addr, --master-port); check that the port is open to this host."
                ) from None
            time.sleep(0.2)


def _join_error(address, count, rank, seconds, e) -> str:
    first = str(e).strip().splitlines()[0].rstrip(".") if str(e).strip() else type(e).__name__
    where = (f"could not start the coordination service on {address} (is the port already in use?)"
             if rank == 0 and "bind" in str(e).lower() else
             f"could not form the job at {address} within {seconds:g} s")
    return (
        f"jshard.init(): process {rank} of {count} {where}: {first}. Check that all {count} processes "
        f"were started (jshard launch --worker-num {count}, every node with its --node-rank), that they "
        "agree on the coordinator address and port, and that process 0 can reach it; a port in use: "
        "choose another --master-port."
    )


def _bind_address(address: str) -> str:
    """Where process 0's coordination service listens: the coordinator's own address (a host name
    resolved to its IP), never JAX's default of every interface. A name whose first label is this
    host's name (a Kubernetes pod's `<job>-0.<service>`, whose DNS record may appear only once the pod
    is ready) resolves as this host's name does."""
    host, port = address.rsplit(":", 1)
    host = host.strip("[]")
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        names = [host] + ([socket.gethostname()] if host.split(".")[0] == socket.gethostname().split(".")[0] else [])
        ip = next(filter(None, map(_resolve, names)), None)
        if ip is None:
            raise ShardingError(f"jshard.init(): process 0 cannot resolve the coordinator host {host!r} to listen on "
                                "it (only there: the coordination service has no authentication). Give an address "
                                "(--master-addr 10.0.0.1) or a name this host resolves.") from None
    return f"[{ip}]:{port}" if ip.version == 6 else f"{ip}:{port}"


def _resolve(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)[0][4][0])
    except (OSError, ValueError):
        return None


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _gloo_on_loopback(host: str) -> None:
    """Has the CPU backend's gloo collectives listen on `host` (loopback), not on whatever the
    machine's hostname resolves to. JAX's own CPU client factory passes no address to gloo."""
    bind = "127.0.0.1" if host == "localhost" else host

    def make_cpu_client():
        collectives = _jax.make_gloo_tcp_collectives(
            distributed_client=_jax_distributed.global_state.client, hostname=bind
        )
        return xla_bridge.make_cpu_client(collectives)

    xla_bridge.register_backend_factory("cpu", make_cpu_client, priority=0, fail_quietly=False)


def _info() -> ProcessInfo:
    state = _jax_distributed.global_state
    return ProcessInfo(
        jax.process_index(),
        jax.process_count(),
        state.coordinator_address if state.client is not None else None,
        jax.local_device_count(),
        jax.device_count(),
    )


def host_major(devices) -> list:
    """`devices` ordered by process, then id: ranks fill one host before the next, so the fastest
    (last) axes of every device matrix stay within a host.

    Examples:
      >>> [d.id for d in host_major(reversed(jax.devices()))][:3]
      [0, 1, 2]
    """
    return sorted(devices, key=lambda d: (d.process_index, d.id))
