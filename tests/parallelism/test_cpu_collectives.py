"""XLA:CPU collectives on host devices get enough threads (parallelism.cpu_threads).

On a machine with fewer cores than host devices XLA:CPU sizes its thread pool at one thread per
device, while one device's program can hold several threads in collectives at once (collectives in
independent while loops / after a while loop that still runs): every thread then waits for peers
queued behind it, a deadlock XLA aborts after its termination timeout. That aborted the tp / tp_ep
train CLI and the tests on 8 host devices on 2 cores. The fix sets PJRT_NPROC before the CPU client
starts; these tests check the setting and run a program that deadlocks without it: two independent
layer scans whose bodies all-gather their weights over an FSDP axis and all-reduce over a tensor axis,
in a fresh process pinned to 2 CPUs (so that XLA's own pool would be the 8 threads that deadlock there,
whatever this machine's core count), started the way the train CLI starts (``ensure_collective_threads()``
before the first device use; importing the library sets nothing).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import jax

from moevlm_jax.parallelism import cpu_threads

REPO = Path(__file__).resolve().parents[2]
DEVICES = 8
# a deadlock aborts in seconds, not after XLA's default 40 s
TIMEOUTS = ("--xla_cpu_collective_call_warn_stuck_timeout_seconds=5 "
            "--xla_cpu_collective_call_terminate_timeout_seconds=15")

PROGRAM = textwrap.dedent("""
    import os, sys
    os.sched_setaffinity(0, [int(c) for c in os.environ["PIN_CPUS"].split(",")])  # before XLA counts the CPUs
    import moevlm_jax.parallelism  # noqa: F401  - importing the library leaves XLA's pool as it is
    if os.environ.get("ENSURE_THREADS", "1") == "1":  # what the train CLI calls before its first device use
        from moevlm_jax.parallelism.cpu_threads import ensure_collective_threads
        ensure_collective_threads()
    import jax, jax.numpy as jnp, numpy as np
    from jax import lax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    calls, layers, width, rows, side = int(sys.argv[1]), 16, 128, 32, 16
    mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("fsdp", "tensor"))
    S = lambda *spec: NamedSharding(mesh, P(*spec))
    c = lax.with_sharding_constraint

    def layer(h, w):  # a while-loop body with collectives, as the scanned layers
        w = c(w, S(None, "tensor"))  # FSDP: the layer's weight all-gathered over fsdp
        a = c(jnp.tanh(h @ w), S("fsdp", "tensor"))  # column-parallel
        return c(jnp.sin(a) @ w.T, S("fsdp", None)), None  # row-parallel: all-reduce over tensor

    def step(w, x, z):
        h, _ = lax.scan(layer, x, w)
        for i in range(side):  # collectives of the entry computation, independent of the loop
            z = jnp.tanh(c(z, S(None, "tensor") if i % 2 else S("tensor", "fsdp")) * 1.01)
        return jnp.sum(h) + jnp.sum(z)

    f = jax.jit(step, out_shardings=S())
    rng = np.random.default_rng(0)
    w = jax.device_put(rng.standard_normal((layers, width, width), np.float32) / width ** 0.5, S(None, "fsdp", None))
    x = jax.device_put(rng.standard_normal((4 * rows, width), np.float32), S("fsdp", None))
    z = jax.device_put(rng.standard_normal((4 * rows, width), np.float32), S("fsdp", "tensor"))
    for _ in range(calls):
        out = f(w, x, z)
    print("threads", os.environ.get("PJRT_NPROC"), "ok", float(out), flush=True)
""")


def run_program(calls: int, *, ensure_threads: bool = True, cpus: int = 2, timeout: float = 120
                ) -> subprocess.CompletedProcess:
    """PROGRAM in a fresh process on 8 host devices, pinned to ``cpus`` CPUs, without PJRT_NPROC /
    NPROC from this process (the fresh process sets its own, as the CLI does)."""
    env = {k: v for k, v in os.environ.items() if k not in (*cpu_threads.ENV_NAMES, cpu_threads.PER_DEVICE_ENV)}
    env.update(JAX_PLATFORMS="cpu", ENSURE_THREADS="1" if ensure_threads else "0",
               XLA_FLAGS=f"--xla_force_host_platform_device_count={DEVICES} {TIMEOUTS}",
               PYTHONPATH=os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]))
    env.pop("JAX_NUM_CPU_DEVICES", None)
    env["PIN_CPUS"] = ",".join(map(str, sorted(os.sched_getaffinity(0))[:cpus]))
    return subprocess.run([sys.executable, "-c", PROGRAM, str(calls)], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout)


def test_the_suite_runs_the_clis_threads_and_the_opt_out_is_honoured():
    """conftest.py calls ensure_collective_threads() before any test starts the CPU client, so the suite's
    processes have the CLI's pool (THREADS_PER_DEVICE a host device, set as PJRT_NPROC); the opt-out
    (MOEVLM_CPU_THREADS_PER_DEVICE=0) sets nothing."""
    n = len(jax.devices())
    assert n == DEVICES and os.environ.get(cpu_threads.PER_DEVICE_ENV) in (None, "")
    assert int(os.environ["PJRT_NPROC"]) >= cpu_threads.THREADS_PER_DEVICE * n
    assert cpu_threads.check_collective_threads(n)
    env = {"XLA_FLAGS": f"--xla_force_host_platform_device_count={n}", cpu_threads.PER_DEVICE_ENV: "0"}
    assert cpu_threads.ensure_collective_threads(env) is not None and "PJRT_NPROC" not in env
    assert cpu_threads.required_threads(n, {}) == cpu_threads.THREADS_PER_DEVICE * n
    assert cpu_threads.required_threads(n, {cpu_threads.PER_DEVICE_ENV: "2"}) == 2 * n


def test_pjrt_nproc_from_the_device_count(monkeypatch):
    """PJRT_NPROC: THREADS_PER_DEVICE per host device where XLA would give fewer, never below the CPU
    count; a large enough setting kept, a smaller one raised; nothing for one device or no CPU platform."""
    need = cpu_threads.THREADS_PER_DEVICE * 8
    flags = {"XLA_FLAGS": "--xla_foo=1 --xla_force_host_platform_device_count=8"}
    monkeypatch.setattr(cpu_threads, "cpu_count", lambda: 2)  # XLA's pool: max(2, 8) = 8 threads
    env = dict(flags)
    assert cpu_threads.ensure_collective_threads(env) == need and env["PJRT_NPROC"] == str(need)
    env = dict(flags, PJRT_NPROC=str(need + 7))
    assert cpu_threads.ensure_collective_threads(env) == need + 7 and env["PJRT_NPROC"] == str(need + 7)  # kept
    for name in cpu_threads.ENV_NAMES:  # too few: raised
        env = dict(flags, **{name: "3"})
        assert cpu_threads.ensure_collective_threads(env) == need and env["PJRT_NPROC"] == str(need)
    monkeypatch.setattr(cpu_threads, "cpu_count", lambda: 2 * need)  # enough cores: XLA's own pool suffices
    env = dict(flags)
    assert cpu_threads.ensure_collective_threads(env) == 2 * need and "PJRT_NPROC" not in env
    env = dict(flags, NPROC="3")  # not with NPROC asking for fewer: then at least the CPU count
    assert cpu_threads.ensure_collective_threads(env) == 2 * need == int(env["PJRT_NPROC"])
    assert cpu_threads.host_device_count({"XLA_FLAGS": "--xla_force_host_platform_device_count=2",
                                          "JAX_NUM_CPU_DEVICES": "8"}) == 8  # jax's precedence
    for env in ({}, {"XLA_FLAGS": "--xla_force_host_platform_device_count=1"}, dict(flags, JAX_PLATFORMS="cuda")):
        assert cpu_threads.ensure_collective_threads(env) is None and "PJRT_NPROC" not in env


def test_collectives_of_concurrent_loops_do_not_deadlock_on_two_cores():
    """The deadlock's shape (a loop body's collectives and the entry computation's in flight at once
    on every device, 8 devices on 2 CPUs) in a fresh process started as the train CLI starts: it
    completes (~3 s). Without ``ensure_collective_threads()`` (XLA's pool of 8 threads there) the same run,
    ``run_program(300, ensure_threads=False)``, aborted 10 times in 10 on a 2-core machine (SIGABRT
    after the termination timeout; 7 in 10 with 100 calls)."""
    result = run_program(300)
    assert result.returncode == 0 and " ok " in result.stdout, (result.returncode, result.stderr[-3000:])
    assert result.stdout.startswith(f"threads {max(cpu_threads.required_threads(DEVICES, {}), 2)} ")  # its default


def test_importing_the_library_sets_nothing_the_entry_points_do(monkeypatch):
    """No process-global side effect at import: a fresh process that imports the parallelism package and the
    experts on 8 host devices has no PJRT_NPROC; the launcher's CPU processes get it in their environment."""
    env = {k: v for k, v in os.environ.items() if k not in (*cpu_threads.ENV_NAMES, cpu_threads.PER_DEVICE_ENV)}
    env.update(JAX_PLATFORMS="cpu", XLA_FLAGS=f"--xla_force_host_platform_device_count={DEVICES}",
               PYTHONPATH=os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]))
    code = ("import os, moevlm_jax.parallelism, moevlm_jax.parallelism.experts, moevlm_jax.model.compute; "
            "print(os.environ.get('PJRT_NPROC'))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "None", (out.stdout, out.stderr[-2000:])
    from moevlm_jax import launch

    monkeypatch.setattr(cpu_threads, "cpu_count", lambda: 2)
    plan = launch.DevicePlan(platform="cpu", per_process=4, gpus=())
    child = launch.child_env({"XLA_FLAGS": "--xla_foo=1"}, 0, 2, "127.0.0.1:1234", plan)
    assert child["PJRT_NPROC"] == str(cpu_threads.THREADS_PER_DEVICE * 4)
