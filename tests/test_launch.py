"""moevlm_jax.launch: child environment, prefixed output, fail-fast, signals, timeout, and a real
2-process jax.distributed run on CPU. The children are small scripts written to tmp_path."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from moevlm_jax import launch

REPO = Path(__file__).resolve().parents[1]

# One child script, its behaviour picked by argv: DIR MODE. Files under DIR pass pids and readiness
# between the children and the test.
CHILD = textwrap.dedent(
    """
    import os, re, signal, subprocess, sys, time
    from pathlib import Path

    rank = int(os.environ["MOEVLM_PROCESS_ID"])
    out_dir, mode = Path(sys.argv[1]), sys.argv[2]

    def mark(name, text=""):
        tmp = out_dir / (name + ".tmp")
        tmp.write_text(text)
        tmp.rename(out_dir / name)

    def wait_for(name, timeout=20.0):
        deadline = time.monotonic() + timeout
        while not (out_dir / name).exists():
            if time.monotonic() > deadline:
                sys.exit(f"timed out waiting for {name}")
            time.sleep(0.02)

    def sleeper_with_grandchild():
        grandchild = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        mark(f"pids{rank}", f"{os.getpid()} {grandchild.pid}")
        mark(f"ready{rank}")
        time.sleep(600)

    if mode == "env":
        m = re.search(r"--xla_force_host_platform_device_count=(\\d+)", os.environ.get("XLA_FLAGS", ""))
        other = "--xla_unrelated_flag=7" in os.environ.get("XLA_FLAGS", "")
        print(f"id={rank} n={os.environ['MOEVLM_NUM_PROCESSES']} count={m.group(1) if m else None} "
              f"other={other} addr={os.environ['MOEVLM_COORDINATOR_ADDRESS']} "
              f"jax_addr={os.environ['JAX_COORDINATOR_ADDRESS']} "
              f"unbuffered={os.environ.get('PYTHONUNBUFFERED')}")
        sys.stderr.write(f"err {rank}\\n")
        sys.stderr.write(f"bar{rank} 10%\\rbar{rank} 50%\\rbar{rank} 100%\\r\\nno newline {rank}")
    elif mode == "gpu":
        print(f"cuda={os.environ.get('CUDA_VISIBLE_DEVICES')} ids={os.environ.get('JAX_LOCAL_DEVICE_IDS')}")
    elif mode in ("fail", "selfkill"):
        if rank == 0:
            wait_for("ready1")
            print("about to fail", flush=True)
            if mode == "fail":
                sys.exit(3)
            os.kill(os.getpid(), signal.SIGKILL)
        sleeper_with_grandchild()
    elif mode == "stubborn":
        if rank == 1:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        sleeper_with_grandchild()
    elif mode == "forward":
        def on_signal(signum, frame):
            print(f"got {signal.Signals(signum).name}", flush=True)
            sys.exit(0)
        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)
        mark(f"ready{rank}")
        time.sleep(600)
    """
)

# The jax.distributed smoke: 2 processes x 2 CPU devices, one allgather and one global sum.
JAX_CHILD = textwrap.dedent(
    """
    import os
    import jax
    # gloo is already the default CPU cross-process implementation in jax 0.10; said explicitly.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        os.environ["MOEVLM_COORDINATOR_ADDRESS"],
        int(os.environ["MOEVLM_NUM_PROCESSES"]),
        int(os.environ["MOEVLM_PROCESS_ID"]),
        initialization_timeout=60,
    )
    import jax.numpy as jnp
    import numpy as np
    from jax.experimental import multihost_utils
    from jax.sharding import NamedSharding, PartitionSpec as P

    assert jax.process_count() == 2, jax.process_count()
    assert jax.device_count() == 4, jax.devices()
    assert jax.local_device_count() == 2, jax.local_devices()
    gathered = multihost_utils.process_allgather(jnp.int32(jax.process_index()))
    mesh = jax.make_mesh((4,), ("d",))
    local = np.arange(2, dtype=np.int32) + 2 * jax.process_index()
    x = jax.make_array_from_process_local_data(NamedSharding(mesh, P("d")), local)
    total = jax.jit(jnp.sum, out_shardings=NamedSharding(mesh, P()))(x)
    print(f"gathered {np.asarray(gathered).tolist()} sum {int(total)}", flush=True)
    jax.distributed.shutdown()
    """
)


def alive(pid: int) -> bool:
    """True when ``pid`` exists and is not a zombie."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def wait_gone(pids: list[int], within: float = 5.0) -> list[int]:
    """The pids still alive after up to ``within`` seconds."""
    deadline = time.monotonic() + within
    while (left := [p for p in pids if alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left


def read_pids(d: Path) -> list[int]:
    """Every pid a child wrote to a pids* file in ``d``."""
    return [int(p) for f in sorted(d.glob("pids?")) for p in f.read_text().split()]


@pytest.fixture
def work(tmp_path):
    """tmp_path with child.py; afterwards kills (by pid) any child process a failed test left."""
    (tmp_path / "child.py").write_text(CHILD)
    yield tmp_path
    for pid in read_pids(tmp_path):
        if alive(pid):
            os.kill(pid, signal.SIGKILL)


def launcher_cmd(*args: str) -> list[str]:
    """``python -m moevlm_jax.launch ARGS``."""
    return [sys.executable, "-m", "moevlm_jax.launch", *args]


def run_launcher(*args: str, env: dict[str, str] | None = None, timeout: float = 60):
    """Run the launcher to completion; (CompletedProcess, seconds)."""
    start = time.monotonic()
    res = subprocess.run(
        launcher_cmd(*args), cwd=REPO, env=dict(os.environ) if env is None else env,
        capture_output=True, text=True, timeout=timeout,
    )
    return res, time.monotonic() - start


def child_args(work: Path, mode: str) -> list[str]:
    """The tokens after ``--`` that run child.py in ``mode``."""
    return ["--", str(work / "child.py"), str(work), mode]


# ----------------------------------------------------------------------------- pure helpers


def test_child_command_and_flags():
    py = sys.executable
    assert launch.child_command(["--layout", "fsdp", "--steps", "3"]) == [
        py, "-m", "moevlm_jax.train", "--layout", "fsdp", "--steps", "3"]
    assert launch.child_command([]) == [py, "-m", "moevlm_jax.train"]
    assert launch.child_command(["-m", "pkg.mod", "a"]) == [py, "-m", "pkg.mod", "a"]
    assert launch.child_command(["x/s.py", "a"]) == [py, "x/s.py", "a"]
    with pytest.raises(launch.LaunchError):
        launch.child_command(["-m"])
    flags = "--a=1 --xla_force_host_platform_device_count=8 --b"
    assert launch.merge_xla_flags(flags, 3) == "--a=1 --b --xla_force_host_platform_device_count=3"
    assert launch.merge_xla_flags(None, 2) == "--xla_force_host_platform_device_count=2"
    assert launch.inherited_cpu_device_count({"XLA_FLAGS": flags}) == 8
    assert launch.inherited_cpu_device_count({"XLA_FLAGS": flags, "JAX_NUM_CPU_DEVICES": "4"}) == 4
    assert launch.inherited_cpu_device_count({}) == 1


def test_device_plan():
    assert launch.detect_gpus({"JAX_PLATFORMS": "cpu", "CUDA_VISIBLE_DEVICES": "0,1"}) == []
    assert launch.detect_gpus({"CUDA_VISIBLE_DEVICES": "2,3"}) == ["2", "3"]
    assert launch.detect_gpus({"CUDA_VISIBLE_DEVICES": "-1"}) == []
    plan = launch.plan_devices({}, 2, None, gpus=[str(i) for i in range(8)])
    assert plan.platform == "gpu" and plan.per_process == 4
    assert plan.gpus == (("0", "1", "2", "3"), ("4", "5", "6", "7"))
    assert launch.plan_devices({}, 4, 1, gpus=["0", "1", "2", "3", "4"]).gpus[3] == ("3",)
    with pytest.raises(launch.LaunchError):
        launch.plan_devices({}, 3, None, gpus=["0", "1"])
    cpu = launch.plan_devices({"XLA_FLAGS": "--xla_force_host_platform_device_count=8"}, 2, None, gpus=[])
    assert (cpu.platform, cpu.per_process) == ("cpu", 8)


def test_line_splitter_handles_carriage_returns():
    s = launch.LineSplitter()
    assert s.feed(b"abc\r") == ["abc"]
    assert s.feed(b"\ndef\n\n\r 10%\r 20%") == ["def", "", " 10%"]
    assert s.feed(b"\r 30%\n") == [" 20%", " 30%"]
    assert s.feed(b"tail") == []
    assert s.close() == ["tail"]


# ----------------------------------------------------------------------------- launched children


def test_env_and_prefixed_output(work):
    env = dict(os.environ, XLA_FLAGS="--xla_unrelated_flag=7 --xla_force_host_platform_device_count=8")
    env["JAX_PLATFORMS"] = "cpu"
    res, _ = run_launcher("--processes", "2", "--devices-per-process", "3", *child_args(work, "env"), env=env)
    assert res.returncode == 0, res.stderr
    out = res.stdout.splitlines()
    for i in range(2):
        [line] = [ln for ln in out if ln.startswith(f"[{i}] id=")]
        assert f"id={i} n=2 count=3 other=True" in line
        assert "addr=127.0.0.1:" in line and "unbuffered=1" in line
        addr = line.split("addr=")[1].split()[0]
        assert f"jax_addr={addr}" in line
    assert out[0].split("addr=")[1].split()[0] == out[1].split("addr=")[1].split()[0]
    err = res.stderr.splitlines()
    for i in range(2):
        assert f"[{i}] err {i}" in err
        # the \r-separated progress updates arrive as whole prefixed lines, \r\n as one line end
        bars = [ln for ln in err if ln.startswith(f"[{i}] bar")]
        assert bars == [f"[{i}] bar{i} 10%", f"[{i}] bar{i} 50%", f"[{i}] bar{i} 100%"]
        assert f"[{i}] no newline {i}" in err
    assert all(ln.startswith(("[0] ", "[1] ")) for ln in out + err)


def test_module_form_inherits_device_count(work):
    (work / "envchild.py").write_text(
        "import os\nprint(os.environ['MOEVLM_PROCESS_ID'], os.environ['XLA_FLAGS'])\n"
    )
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=5", JAX_PLATFORMS="cpu")
    env["PYTHONPATH"] = os.pathsep.join([str(work), env.get("PYTHONPATH", "")])
    res, _ = run_launcher("--processes", "2", "--", "-m", "envchild", env=env)
    assert res.returncode == 0, res.stderr
    lines = sorted(res.stdout.splitlines())
    assert lines == [f"[{i}] {i} --xla_force_host_platform_device_count=5" for i in range(2)]


def test_gpu_slices_from_cuda_visible_devices(work):
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    env["CUDA_VISIBLE_DEVICES"] = "4,5,6,7"
    res, _ = run_launcher("--processes", "2", *child_args(work, "gpu"), env=env)
    assert res.returncode == 0, res.stderr
    assert sorted(res.stdout.splitlines()) == ["[0] cuda=4,5 ids=0,1", "[1] cuda=6,7 ids=0,1"]


def test_failure_stops_the_others(work):
    res, took = run_launcher("--processes", "2", *child_args(work, "fail"))
    assert res.returncode == 3, res.stderr
    assert took < 30
    assert "[0] about to fail" in res.stdout
    [summary] = [ln for ln in res.stderr.splitlines() if "failed with" in ln]
    assert "process 0" in summary and "exit code 3" in summary
    assert "[launch]   [0] about to fail" in res.stderr  # the tail of its output
    pids = read_pids(work)
    assert len(pids) == 2  # process 1 and its grandchild
    assert wait_gone(pids) == []


def test_child_killed_by_signal(work):
    res, took = run_launcher("--processes", "2", *child_args(work, "selfkill"))
    assert res.returncode == 1, res.stderr
    assert took < 30
    [summary] = [ln for ln in res.stderr.splitlines() if "failed with" in ln]
    assert "process 0" in summary and "SIGKILL" in summary
    pids = read_pids(work)
    assert len(pids) == 2
    assert wait_gone(pids) == []


def test_timeout_then_sigkill_after_grace(work):
    res, took = run_launcher("--processes", "2", "--timeout", "2", "--grace", "1", *child_args(work, "stubborn"))
    assert res.returncode == launch.EXIT_TIMEOUT, res.stderr
    assert took < 20
    assert "timeout" in res.stderr
    assert "process 1 still running after 1 s grace; SIGKILL" in res.stderr
    pids = read_pids(work)
    assert len(pids) == 4
    assert wait_gone(pids) == []


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_is_forwarded(work, sig):
    proc = subprocess.Popen(
        launcher_cmd("--processes", "2", *child_args(work, "forward")), cwd=REPO,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        deadline = time.monotonic() + 30
        while not all((work / f"ready{i}").exists() for i in range(2)):
            assert time.monotonic() < deadline and proc.poll() is None, proc.stderr.read()
            time.sleep(0.02)
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + sig, err
    name = signal.Signals(sig).name
    assert f"received {name}" in err
    assert sorted(ln for ln in out.splitlines() if "got" in ln) == [f"[0] got {name}", f"[1] got {name}"]


def test_jax_distributed_two_processes(tmp_path):
    (tmp_path / "jax_child.py").write_text(JAX_CHILD)
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    res, _ = run_launcher(
        "--processes", "2", "--devices-per-process", "2", "--timeout", "120", "--grace", "2",
        "--", str(tmp_path / "jax_child.py"), env=env, timeout=150,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    lines = sorted(ln for ln in res.stdout.splitlines() if "gathered" in ln)
    assert lines == ["[0] gathered [0, 1] sum 6", "[1] gathered [0, 1] sum 6"], res.stdout + res.stderr
