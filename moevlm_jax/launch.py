"""Development launcher, as ``torchrun --standalone`` is for torch: N JAX processes on this host.

``python -m moevlm_jax.launch --processes N [--devices-per-process K] [--port P] [--timeout S]
[--grace G] [--verbose] -- [-m module | script.py] ARGS...``

The command after ``--`` is ``python -m moevlm_jax.train ARGS...`` unless its first token is ``-m``
(``-m pkg.mod ARGS`` runs that module) or a ``.py`` file (``path.py ARGS`` runs that script); the
children run under ``sys.executable``.

Each child ``i`` gets, explicitly in its environment:

- ``MOEVLM_COORDINATOR_ADDRESS=127.0.0.1:PORT``, ``MOEVLM_NUM_PROCESSES=N``, ``MOEVLM_PROCESS_ID=i``:
  what the trainer passes to ``jax.distributed.initialize(coordinator_address, num_processes,
  process_id)``. ``PORT`` is ``--port`` or a free port (bind to port 0 on 127.0.0.1).
- ``JAX_COORDINATOR_ADDRESS`` (same value): the only one of the three that jax itself reads from the
  environment (``jax._src.distributed.State.initialize`` falls back to it). jax 0.10 has no
  environment variables for the process count or id outside its cluster detectors (SLURM, Open MPI,
  Kubernetes, Cloud TPU, mpi4py), so those come from the ``MOEVLM_*`` variables only.
- ``JAX_COORDINATOR_BIND_ADDRESS=127.0.0.1:PORT``: process 0's coordinator service otherwise binds
  ``[::]:PORT`` (every interface); a development run stays on loopback, where the port was found free.
- ``PYTHONUNBUFFERED=1``, so output arrives line by line.
- Devices. CPU: ``XLA_FLAGS`` with ``--xla_force_host_platform_device_count=K`` (replacing any
  inherited device-count flag, other flags kept), ``JAX_NUM_CPU_DEVICES=K`` too if the parent set that
  (it takes precedence over the flag in jax), ``JAX_PLATFORMS`` inherited as the parent set it.
  GPU: ``CUDA_VISIBLE_DEVICES`` = the i-th slice of K of this host's GPUs and
  ``JAX_LOCAL_DEVICE_IDS=0,..,K-1`` (with all four arguments of ``initialize`` known, jax skips its
  cluster auto-detection, which inside e.g. a SLURM allocation would otherwise pin every child to
  the GPU of the launcher's SLURM_LOCALID), and ``MOEVLM_HOST_ID=0``: the processes share one host, so
  the mesh may put tensor / expert axes across them (``parallelism.multihost.host_ids``). CPU
  processes get no host id: each stands in for a host, as on a cluster.

GPUs are found without importing jax: ``CUDA_VISIBLE_DEVICES`` when set (its entries, indices or
UUIDs), else ``nvidia-smi -L``; none when ``JAX_PLATFORMS`` is set and names neither ``cuda`` nor
``gpu``. ``--devices-per-process`` defaults to GPUs // N on GPU, and on CPU to the inherited device
count (``XLA_FLAGS`` / ``JAX_NUM_CPU_DEVICES``) or 1.

Output: every line of each child's stdout / stderr goes to the launcher's stdout / stderr with the
prefix ``[i] ``. ``\\r`` ends a line as ``\\n`` does, so a progress bar (tqdm) becomes a sequence of
whole prefixed lines instead of garbling its neighbours. Launcher messages go to stderr prefixed
``[launch] ``.

Failure: the first child that exits non-zero or dies by a signal is named, with its code or signal
and its last lines of output; the others get SIGTERM, then SIGKILL after ``--grace`` seconds
(default 10). Children run in their own process groups (a terminal's Ctrl-C reaches the launcher
alone). The first signal goes to the child process only: the train job stops and ends its own
subprocesses (data workers), while a compiler's (ptxas) finish their work instead of failing the
compile; SIGKILL goes to the whole group, and whatever is left in a group at the end is killed. The
launcher exits with the failing child's code, or 1 when it died by a signal. SIGINT / SIGTERM to the
launcher is forwarded to every child (then the same grace and SIGKILL; a second one kills at once)
and the launcher exits 128 + signal. ``--timeout S``
stops everything after S seconds and exits 124. All children exiting 0 exits 0.

The module uses only the standard library, so ``python moevlm_jax/launch.py`` works too; ``python -m
moevlm_jax.launch`` also imports the package (flax, jax), which does not start any jax backend.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import IO

from moevlm_jax.parallelism.cpu_threads import ensure_collective_threads

log = logging.getLogger("moevlm_jax.launch")

DEFAULT_MODULE = "moevlm_jax.train"
ENV_COORDINATOR = "MOEVLM_COORDINATOR_ADDRESS"
ENV_NUM_PROCESSES = "MOEVLM_NUM_PROCESSES"
ENV_PROCESS_ID = "MOEVLM_PROCESS_ID"
DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"
EXIT_TIMEOUT = 124
TAIL_LINES = 10
MAX_LINE_BYTES = 1 << 16
POLL_S = 0.05

_DEVICE_COUNT_RE = re.compile(r"(?:^|\s)" + re.escape(DEVICE_COUNT_FLAG) + r"(?:=(\S*))?(?=\s|$)")


class LaunchError(Exception):
    """A launch that cannot start (bad arguments, too few GPUs)."""


# ----------------------------------------------------------------------------- the child command


def child_command(rest: Sequence[str], python: str | None = None) -> list[str]:
    """The child's argv for the tokens after ``--``: ``-m mod ARGS``, ``script.py ARGS`` or trainer ARGS."""
    python = python or sys.executable
    rest = list(rest)
    if rest and rest[0] == "-m":
        if len(rest) < 2:
            raise LaunchError("'-m' after '--' needs a module name")
        return [python, "-m", *rest[1:]]
    if rest and rest[0].endswith(".py"):
        return [python, *rest]
    return [python, "-m", DEFAULT_MODULE, *rest]


# ----------------------------------------------------------------------------- devices


def merge_xla_flags(existing: str | None, device_count: int) -> str:
    """``existing`` XLA_FLAGS with its host device-count flag (if any) replaced by ``device_count``."""
    kept = _DEVICE_COUNT_RE.sub(" ", existing or "").split()
    return " ".join([*kept, f"{DEVICE_COUNT_FLAG}={device_count}"])


def inherited_cpu_device_count(env: Mapping[str, str]) -> int:
    """The host device count ``env`` gives jax: JAX_NUM_CPU_DEVICES, else the XLA_FLAGS flag, else 1."""
    num = env.get("JAX_NUM_CPU_DEVICES", "").strip()
    if num.lstrip("-").isdigit() and int(num) > 0:
        return int(num)
    values = [m.group(1) for m in _DEVICE_COUNT_RE.finditer(env.get("XLA_FLAGS", ""))]
    if values and values[-1] and values[-1].isdigit() and int(values[-1]) > 0:
        return int(values[-1])
    return 1


def _platforms_exclude_gpu(env: Mapping[str, str]) -> bool:
    """True when JAX_PLATFORMS is set and names no GPU platform."""
    platforms = env.get("JAX_PLATFORMS", "").strip()
    if not platforms:
        return False
    names = {p.strip().lower() for p in platforms.split(",")}
    return not names & {"cuda", "gpu", "rocm"}


def detect_gpus(env: Mapping[str, str]) -> list[str]:
    """This host's GPUs (CUDA_VISIBLE_DEVICES entries, else ``nvidia-smi -L`` indices), without jax."""
    if _platforms_exclude_gpu(env):
        return []
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        entries = [v.strip() for v in visible.split(",") if v.strip()]
        # CUDA stops at the first invalid entry; "-1" / "" is the usual "no GPU".
        out: list[str] = []
        for entry in entries:
            if entry.startswith("-"):
                break
            out.append(entry)
        return out
    try:
        res = subprocess.run(
            ["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20, check=False
        )
    except (OSError, subprocess.SubprocessError):
        return []
    if res.returncode != 0:
        return []
    count = sum(1 for line in res.stdout.splitlines() if line.startswith("GPU "))
    return [str(i) for i in range(count)]


@dataclasses.dataclass(frozen=True)
class DevicePlan:
    """How devices are split: ``platform`` is "cpu" or "gpu"; ``gpus[i]`` is child i's GPU list."""

    platform: str
    per_process: int
    gpus: tuple[tuple[str, ...], ...] = ()


def plan_devices(
    env: Mapping[str, str], processes: int, per_process: int | None, gpus: Sequence[str] | None = None
) -> DevicePlan:
    """Pick CPU or GPU and the devices of each of ``processes`` children."""
    gpus = detect_gpus(env) if gpus is None else list(gpus)
    if per_process is not None and per_process < 1:
        raise LaunchError(f"--devices-per-process must be >= 1, got {per_process}")
    if not gpus:
        return DevicePlan("cpu", per_process or inherited_cpu_device_count(env))
    k = per_process or len(gpus) // processes
    if k < 1 or k * processes > len(gpus):
        raise LaunchError(
            f"{processes} processes x {per_process or 'auto'} GPUs each do not fit this host's "
            f"{len(gpus)} GPU(s) ({','.join(gpus)}); set JAX_PLATFORMS=cpu to run on CPU"
        )
    return DevicePlan("gpu", k, tuple(tuple(gpus[i * k : (i + 1) * k]) for i in range(processes)))


# ----------------------------------------------------------------------------- environment


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` right now (bind to port 0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def child_env(
    base: Mapping[str, str], process_id: int, processes: int, address: str, plan: DevicePlan
) -> dict[str, str]:
    """The environment of child ``process_id`` (see the module docstring for each variable)."""
    env = dict(base)
    env[ENV_COORDINATOR] = address
    env[ENV_NUM_PROCESSES] = str(processes)
    env[ENV_PROCESS_ID] = str(process_id)
    env["JAX_COORDINATOR_ADDRESS"] = address
    env["JAX_COORDINATOR_BIND_ADDRESS"] = address
    env["PYTHONUNBUFFERED"] = "1"
    if plan.platform == "gpu":
        env["CUDA_VISIBLE_DEVICES"] = ",".join(plan.gpus[process_id])
        env["JAX_LOCAL_DEVICE_IDS"] = ",".join(str(d) for d in range(plan.per_process))
        env.setdefault("MOEVLM_HOST_ID", "0")  # one host: its GPUs share NVLink whatever process holds them
    else:  # CPU processes stand in for hosts (no MOEVLM_HOST_ID): the cross-host mesh logic runs as on a cluster
        env["XLA_FLAGS"] = merge_xla_flags(base.get("XLA_FLAGS"), plan.per_process)
        if "JAX_NUM_CPU_DEVICES" in base:
            env["JAX_NUM_CPU_DEVICES"] = str(plan.per_process)
        ensure_collective_threads(env)  # each process's XLA:CPU pool: threads for its host devices' collectives
    return env


# ----------------------------------------------------------------------------- output


class LineSplitter:
    """Bytes -> text lines, ending a line at ``\\n``, ``\\r`` or ``\\r\\n`` (also across chunks)."""

    def __init__(self) -> None:
        """An empty buffer."""
        self._buf = bytearray()
        self._after_cr = False

    def feed(self, data: bytes) -> list[str]:
        """The lines completed by ``data``; the empty segments a ``\\r`` makes are dropped."""
        lines: list[str] = []
        start = 0
        for i, byte in enumerate(data):
            if byte not in (10, 13):
                continue
            self._buf += data[start:i]
            start = i + 1
            if byte == 10 and self._after_cr and not self._buf:
                self._after_cr = False  # the \n of a \r\n
                continue
            if self._buf or byte == 10:
                lines.append(self._take())
            self._after_cr = byte == 13
        self._buf += data[start:]
        if start < len(data):
            self._after_cr = False
        while len(self._buf) > MAX_LINE_BYTES:
            head = bytes(self._buf[:MAX_LINE_BYTES])
            del self._buf[:MAX_LINE_BYTES]
            lines.append(head.decode("utf-8", errors="replace"))
        return lines

    def close(self) -> list[str]:
        """The unterminated last line, if any."""
        return [self._take()] if self._buf else []

    def _take(self) -> str:
        """Empty the buffer into one decoded line."""
        text = bytes(self._buf).decode("utf-8", errors="replace")
        self._buf.clear()
        return text


class Output:
    """Writes whole prefixed lines to the launcher's stdout / stderr, one writer at a time."""

    def __init__(self, stdout: IO[str] | None = None, stderr: IO[str] | None = None) -> None:
        """Write to ``stdout`` / ``stderr`` (default: the launcher's)."""
        self._streams = {"stdout": stdout or sys.stdout, "stderr": stderr or sys.stderr}
        self._lock = threading.Lock()

    def line(self, stream: str, text: str) -> None:
        """Write ``text`` and a newline to ``stream`` ("stdout" / "stderr") and flush."""
        out = self._streams[stream]
        with self._lock:
            try:
                out.write(text + "\n")
                out.flush()
            except (OSError, ValueError):
                pass  # a closed pipe downstream must not kill the reader threads

    def message(self, text: str) -> None:
        """A launcher message on stderr."""
        self.line("stderr", f"[launch] {text}")


# ----------------------------------------------------------------------------- the children


@dataclasses.dataclass
class Child:
    """One launched process, its reader threads and the tail of its output."""

    index: int
    proc: subprocess.Popen[bytes]
    tail: collections.deque[str]
    readers: list[threading.Thread]
    returncode: int | None = None

    def join_readers(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds in all for the reader threads to see end of file."""
        deadline = time.monotonic() + timeout
        for thread in self.readers:
            thread.join(max(0.0, deadline - time.monotonic()))


def describe_exit(returncode: int) -> str:
    """'exit code 3' or 'signal SIGKILL (9)'."""
    if returncode >= 0:
        return f"exit code {returncode}"
    try:
        name = signal.Signals(-returncode).name
    except ValueError:
        name = f"signal {-returncode}"
    return f"signal {name} ({-returncode})"


def _pump(pipe: IO[bytes], prefix: str, stream: str, output: Output, tail: collections.deque[str]) -> None:
    """Copy ``pipe`` to ``output`` line by line with ``prefix`` until end of file."""
    splitter = LineSplitter()
    fd = pipe.fileno()
    try:
        while True:
            try:
                data = os.read(fd, 65536)
            except OSError:
                data = b""
            lines = splitter.feed(data) if data else splitter.close()
            for text in lines:
                tail.append(text)
                output.line(stream, prefix + text)
            if not data:
                break
    finally:
        pipe.close()


def _signal_group(child: Child, sig: int) -> bool:
    """Send ``sig`` to the child's process group; False when nothing is left in it."""
    try:
        os.killpg(child.proc.pid, sig)
        return True
    except (ProcessLookupError, PermissionError):
        return False


class Launcher:
    """Runs N children, multiplexes their output, and stops them all when one fails."""

    def __init__(
        self,
        command: Sequence[str],
        processes: int,
        *,
        devices_per_process: int | None = None,
        port: int | None = None,
        timeout: float | None = None,
        grace: float = 10.0,
        env: Mapping[str, str] | None = None,
        output: Output | None = None,
    ) -> None:
        """Plan the launch of ``processes`` copies of ``command`` (an argv)."""
        if processes < 1:
            raise LaunchError(f"--processes must be >= 1, got {processes}")
        self.command = list(command)
        self.processes = processes
        self.base_env = dict(os.environ if env is None else env)
        self.plan = plan_devices(self.base_env, processes, devices_per_process)
        self.port = port or free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.timeout = timeout
        self.grace = grace
        self.output = output or Output()
        self.children: list[Child] = []
        self._signals: list[int] = []

    # -- lifecycle

    def run(self) -> int:
        """Start the children and supervise them; the launcher's exit code."""
        restore = self._install_signal_handlers()
        try:
            self._start()
            return self._supervise()
        finally:
            try:
                self._stop(reason=None)
                self._sweep()
            finally:
                for sig, handler in restore.items():
                    signal.signal(sig, handler)

    def _start(self) -> None:
        """Spawn every child in its own session / process group, with reader threads."""
        log.info(
            "%d processes, coordinator %s, %s x %d device(s): %s",
            self.processes, self.address, self.plan.platform, self.plan.per_process,
            " ".join(self.command),
        )
        for i in range(self.processes):
            env = child_env(self.base_env, i, self.processes, self.address, self.plan)
            if self.plan.platform == "gpu":
                log.info("process %d: CUDA_VISIBLE_DEVICES=%s", i, env["CUDA_VISIBLE_DEVICES"])
            proc = subprocess.Popen(
                self.command,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,
            )
            tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
            readers = []
            for pipe, stream in ((proc.stdout, "stdout"), (proc.stderr, "stderr")):
                assert pipe is not None
                thread = threading.Thread(
                    target=_pump,
                    args=(pipe, f"[{i}] ", stream, self.output, tail),
                    name=f"launch-{i}-{stream}",
                    daemon=True,
                )
                thread.start()
                readers.append(thread)
            self.children.append(Child(i, proc, tail, readers))
            log.info("process %d: pid %d", i, proc.pid)

    def _supervise(self) -> int:
        """Wait until all children exit 0, one fails, a signal arrives or the timeout passes."""
        start = time.monotonic()
        while True:
            if self._signals:
                sig = self._signals[0]
                name = signal.Signals(sig).name
                self.output.message(f"received {name}; forwarding it to {self._running_count()} process(es)")
                self._stop(reason=f"launcher got {name}", first_signal=sig)
                return 128 + sig
            for child in self.children:
                if child.returncode is None:
                    child.returncode = child.proc.poll()
                    if child.returncode not in (None, 0):
                        self._report_failure(child)
                        self._stop(reason=f"process {child.index} failed")
                        return child.returncode if child.returncode > 0 else 1
            if all(c.returncode == 0 for c in self.children):
                for child in self.children:
                    child.join_readers(5.0)
                return 0
            if self.timeout is not None and time.monotonic() - start > self.timeout:
                self.output.message(
                    f"timeout: still running after {self.timeout:g} s; stopping "
                    f"{self._running_count()} process(es)"
                )
                self._stop(reason="timeout")
                return EXIT_TIMEOUT
            time.sleep(POLL_S)

    def _report_failure(self, child: Child) -> None:
        """One line naming the failed child and how it ended, then its last lines of output."""
        child.join_readers(1.0)
        others = sum(1 for c in self.children if c is not child and c.returncode is None)
        self.output.message(
            f"process {child.index} (pid {child.proc.pid}) failed with "
            f"{describe_exit(child.returncode or 0)}; stopping {others} other process(es). "
            f"Its last {len(child.tail)} line(s):"
        )
        for text in list(child.tail):
            self.output.message(f"  [{child.index}] {text}")

    def _running_count(self) -> int:
        """How many children have not exited."""
        return sum(1 for c in self.children if c.proc.poll() is None)

    # -- stopping

    def _stop(self, reason: str | None, first_signal: int = signal.SIGTERM) -> None:
        """``first_signal`` to every running child, then SIGKILL to its group after the grace period."""
        running = [c for c in self.children if c.proc.poll() is None]
        if not running:
            return
        log.info("stopping %d process(es) (%s)", len(running), reason)
        for child in running:  # the process alone: its compiler's and data workers' subprocesses are its to end
            try:
                child.proc.send_signal(first_signal)
            except ProcessLookupError:
                pass
        n_signals = len(self._signals)
        deadline = time.monotonic() + self.grace
        while time.monotonic() < deadline and any(c.proc.poll() is None for c in running):
            if len(self._signals) > n_signals:
                self.output.message("another signal: killing now")
                break
            time.sleep(POLL_S)
        for child in running:
            if child.proc.poll() is None:
                if reason is not None:
                    self.output.message(
                        f"process {child.index} still running after {self.grace:g} s grace; SIGKILL"
                    )
                _signal_group(child, signal.SIGKILL)
        for child in running:
            try:
                child.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                log.warning("process %d (pid %d) did not die after SIGKILL", child.index, child.proc.pid)
            child.returncode = child.proc.returncode
            if reason is not None and child.returncode is not None:
                self.output.message(f"process {child.index} stopped ({describe_exit(child.returncode)})")

    def _sweep(self) -> None:
        """SIGKILL whatever is still in the children's process groups after 1 s (orphaned subprocesses)."""
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline and any(_signal_group(c, 0) for c in self.children):
            time.sleep(POLL_S)
        for child in self.children:
            if _signal_group(child, 0):
                log.info("process %d left subprocesses behind; killing its process group", child.index)
                _signal_group(child, signal.SIGKILL)
        for child in self.children:
            child.join_readers(2.0)

    # -- signals

    def _install_signal_handlers(self) -> dict[int, Callable | int | None]:
        """Record SIGINT / SIGTERM for the supervisor loop (main thread only); the old handlers."""
        if threading.current_thread() is not threading.main_thread():
            return {}
        restore: dict[int, Callable | int | None] = {}
        for sig in (signal.SIGINT, signal.SIGTERM):
            restore[sig] = signal.getsignal(sig)
            signal.signal(sig, self._on_signal)
        return restore

    def _on_signal(self, signum: int, frame: object) -> None:
        """Remember the signal; the supervisor loop forwards it."""
        self._signals.append(signum)


# ----------------------------------------------------------------------------- CLI


def parse_args(argv: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
    """The launcher's options and the child tokens after ``--``."""
    argv = list(argv)
    if "--" in argv:
        split = argv.index("--")
        own, rest = argv[:split], argv[split + 1 :]
    else:
        own, rest = argv, []
    parser = argparse.ArgumentParser(
        prog="python -m moevlm_jax.launch",
        description="Run N JAX processes on this host (like torchrun --standalone). "
        "After '--': trainer arguments, '-m module ARGS' or 'script.py ARGS'.",
        usage="%(prog)s --processes N [options] -- [-m module | script.py] ARGS...",
    )
    parser.add_argument("--processes", "-n", type=int, required=True, help="number of processes")
    parser.add_argument(
        "--devices-per-process", type=int, default=None,
        help="devices of each process (GPU: GPUs // N; CPU: the inherited host device count or 1)",
    )
    parser.add_argument("--port", type=int, default=None, help="coordinator port (default: a free one)")
    parser.add_argument("--timeout", type=float, default=None, help="stop everything after S seconds")
    parser.add_argument("--grace", type=float, default=10.0, help="seconds between SIGTERM and SIGKILL")
    parser.add_argument("--verbose", "-v", action="store_true", help="log the plan and the pids")
    args = parser.parse_args(own)
    return args, rest


def main(argv: Sequence[str] | None = None) -> int:
    """The CLI; the exit code."""
    args, rest = parse_args(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="[launch] %(message)s",
    )
    try:
        launcher = Launcher(
            child_command(rest),
            args.processes,
            devices_per_process=args.devices_per_process,
            port=args.port,
            timeout=args.timeout,
            grace=args.grace,
        )
    except LaunchError as exc:
        print(f"[launch] error: {exc}", file=sys.stderr)
        return 2
    return launcher.run()


if __name__ == "__main__":
    sys.exit(main())
