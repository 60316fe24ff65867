"""Runs that survive faults, through the train CLI in subprocesses (one CPU device, the tiny model, a
shared persistent compilation cache so each process loads the compiled step):

- SIGTERM: the run finishes the step, writes a checkpoint, exits 0 with one line naming it; resumed,
  it logs the uninterrupted run's losses step for step (bitwise);
- SIGTERM during the first compile, which then fails (as when the signal ends the compiler's ptxas): exit 0
  with one line, no traceback, no step, nothing saved;
- kill -9 during an asynchronous checkpoint write, and again in the middle of training: ``--resume``
  takes the latest complete checkpoint (never the partial one) and continues with the uninterrupted
  run's losses;
- updates with non-finite gradients several times in a row stop the run (exit 1) with a message and a
  checkpoint of the last good (finite) parameters;
- an unwritable run directory or a full disk is reported before compiling (exit 2); a checkpoint write
  that fails is reported and training goes on with the previous checkpoints kept.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import yaml

from tests.training.train_setup import COMPUTE, SEQ_LEN, data_config, logged_losses
from tests.xla_options import FAST_XLA_FLAGS, LEGACY_EMITTERS_FLAG

# quick compiles (tests/xla_options.py): the straight run compiled alike
pytestmark = pytest.mark.usefixtures("legacy_emitters")

STEPS = 8


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("faults")
    recipe = tmp / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({
        "name": "faults", "model": "tiny", "layout": "fsdp", "data": data_config(),
        "compute": COMPUTE, "optimizer": {"lr": 3e-3, "warmup_steps": 2, "weight_decay": 0.01},
        # 2 rows a step: what is tested is the run's state across signals and restarts, not the batch; the
        # 151936-token LM head makes a step's cost follow its rows
        "train": {"steps": STEPS, "global_batch_size": 2, "seq_len": SEQ_LEN, "log_every": 1,
                  "checkpoint_every": 1, "keep_checkpoints": 3, "compilation_cache_dir": str(tmp / "jax_cache"),
                  "tensorboard": False},  # metrics.jsonl is what is read (tensorboardX imports torch: 2 s a run)
    }))
    # quick compiles as the rest of the suite (tests/xla_options.py): unoptimised LLVM code, legacy emitters; the
    # steps of 2 rows stay cheap
    flags = f"--xla_force_host_platform_device_count=1 {FAST_XLA_FLAGS} {LEGACY_EMITTERS_FLAG}"
    env = {**os.environ, "XLA_FLAGS": flags,
           "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0", "PYTHONUNBUFFERED": "1"}
    straight = tmp / "straight"  # the reference losses: no checkpoints needed (8 writes of ~120 MB)
    done = _run(["--recipe", str(recipe), "--run-dir", str(straight), "train.checkpointing=false"], env)
    assert done.returncode == 0, done.stderr[-3000:]
    return recipe, env, logged_losses(straight)


def _cmd(args):
    return [sys.executable, "-m", "moevlm_jax.train", "--quiet", *args]


def _run(args, env, timeout=600):
    return subprocess.run(_cmd(args), env=env, capture_output=True, text=True, timeout=timeout, check=False)


def _start(args, env) -> subprocess.Popen:
    return subprocess.Popen(_cmd(args), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_for(predicate, proc, timeout=300.0, poll=0.002):
    t0 = time.perf_counter()
    while not predicate():
        if proc.poll() is not None:
            raise AssertionError(f"the run ended first (rc {proc.returncode}): {proc.stderr.read()[-2000:]}")
        if time.perf_counter() - t0 > timeout:
            proc.kill()
            raise AssertionError("timed out waiting for the run")
        time.sleep(poll)


def _steps_logged(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def test_sigterm_checkpoints_exits_0_and_resumes_exactly(setup, tmp_path):
    recipe, env, want = setup
    run = tmp_path / "run"
    proc = _start(["--recipe", str(recipe), "--run-dir", str(run)], env)
    _wait_for(lambda: _steps_logged(run) >= 3, proc)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    lines = [ln for ln in out.splitlines() if ln.startswith("stopped by SIGTERM")]
    assert len(lines) == 1 and "checkpoint" in lines[0] and "--resume" in lines[0], out
    stopped_at = max(logged_losses(run))
    assert stopped_at < STEPS
    done = _run(["--run-dir", str(run), "--resume"], env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert logged_losses(run) == want  # every step's loss, bitwise


# the module's recipe with the first step's compile interrupted: the compile sends the process SIGTERM and then fails
# as XLA's does when the signal ended ptxas (the moment is fixed: no step can have run)
_SIGNAL_IN_COMPILE = """
import os, signal, sys
from moevlm_jax.training.trainer import Trainer
class Interrupted:
    def compile(self, *args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)
        raise RuntimeError("INTERNAL: ptxas exited with non-zero error code 15, output: ")
Trainer.lower_step = lambda self, *args, **kwargs: Interrupted()
from moevlm_jax.train import main
sys.exit(main(sys.argv[1:]))
"""


def test_sigterm_during_the_first_compile_exits_0_with_nothing_saved(setup, tmp_path):
    recipe, env, _ = setup
    run = tmp_path / "run"
    done = subprocess.run([sys.executable, "-c", _SIGNAL_IN_COMPILE, "--recipe", str(recipe), "--run-dir", str(run),
                           "--quiet"], env=env, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines() == ["stopped by SIGTERM during compile: nothing to save (no step ran)"], done.stdout
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    assert _steps_logged(run) == 0
    assert not (run / "checkpoints").exists() or not any((run / "checkpoints").iterdir())


def test_kill9_mid_save_and_mid_step_resume_from_the_last_complete_checkpoint(setup, tmp_path):
    recipe, env, want = setup
    run = tmp_path / "run"
    ckpt = run / "checkpoints"

    def writing() -> bool:  # orbax writes a step into a temporary directory, then renames it
        return ckpt.exists() and any(".orbax-checkpoint-tmp" in p.name for p in ckpt.iterdir())

    proc = _start(["--recipe", str(recipe), "--run-dir", str(run)], env)
    _wait_for(lambda: _steps_logged(run) >= 2 and writing(), proc)
    proc.kill()  # SIGKILL during an asynchronous checkpoint write
    proc.wait()
    partial = [p.name for p in ckpt.iterdir() if ".orbax-checkpoint-tmp" in p.name]
    complete = sorted(int(p.name) for p in ckpt.iterdir() if p.name.isdigit())
    assert complete, "no complete checkpoint before the kill"
    proc = _start(["--run-dir", str(run), "--resume"], env)  # resumes, then is killed again mid-training
    _wait_for(lambda: max(logged_losses(run), default=0) >= complete[-1] + 2, proc)
    proc.kill()
    proc.wait()
    done = _run(["--run-dir", str(run), "--resume"], env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert logged_losses(run) == want, f"partial checkpoint dirs at the first kill: {partial}"


def test_nonfinite_updates_in_a_row_stop_the_run_with_the_last_good_state(setup, tmp_path):
    import orbax.checkpoint as ocp

    recipe, env, _ = setup
    run = tmp_path / "run"
    done = _run(["--recipe", str(recipe), "--run-dir", str(run), "optimizer.lr=1e30", "optimizer.warmup_steps=0",
                 "optimizer.max_consecutive_skips=2", "train.checkpoint_every=0"], env)
    assert done.returncode == 1, done.stderr[-3000:]
    errors = [ln for ln in done.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and "non-finite gradients" in errors[0] and "last good parameters" in errors[0]
    steps = sorted(int(p.name) for p in (run / "checkpoints").iterdir() if p.name.isdigit())
    assert len(steps) == 1 and steps[0] < STEPS
    with ocp.CheckpointManager((run / "checkpoints").absolute(), item_names=("state", "data")) as mgr:
        state = mgr.restore(steps[0], args=ocp.args.Composite(state=ocp.args.StandardRestore()))["state"]
    leaves = [np.asarray(x) for x in __import__("jax").tree.leaves(state["params"])]
    assert all(np.isfinite(x).all() for x in leaves)  # the skipped updates never reached the parameters
    assert int(state["opt_state"]["total_notfinite"]) >= 2  # and they were counted


def test_unwritable_or_full_run_dir_is_reported_before_compiling(setup, tmp_path, monkeypatch, capsys):
    from moevlm_jax.train import main

    recipe, env, _ = setup
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    t0 = time.perf_counter()
    done = _run(["--recipe", str(recipe), "--run-dir", str(blocker / "run")], env)
    assert done.returncode == 2 and "is not writable" in done.stderr and "Traceback" not in done.stderr
    assert time.perf_counter() - t0 < 120

    import moevlm_jax.training.faults as faults
    from moevlm_jax.training.trainer import Trainer

    ahead = []  # the disk is checked before the step compiled ahead starts (no compile thread left behind)
    monkeypatch.setattr(Trainer, "compile_ahead", lambda self, *a, **k: ahead.append(a))
    monkeypatch.setattr(faults.shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(10**12, 10**12 - 1024, 1024))
    # in this process's 8 devices: a global batch of 8 rows (MBS 1 under fsdp), the recipe's 2 would not divide
    argv = ["--recipe", str(recipe), "--quiet", "train.global_batch_size=8", "train.reserve_largest_bucket=true",
            "train.compile_ahead=true"]
    assert main([*argv, "--run-dir", str(tmp_path / "full")]) == 2
    err = capsys.readouterr().err
    assert "GiB free, but the kept checkpoints need" in err and "train.keep_checkpoints" in err
    assert ahead == []
    # with the space there, the same run gets to the compile ahead (stopped there: the test needs no steps)
    monkeypatch.setattr(faults.shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(10**15, 0, 10**15))
    def stop_here(*_, **__):
        raise FileExistsError("stop here")

    monkeypatch.setattr(Trainer, "init_state", stop_here)
    assert main([*argv, "--run-dir", str(tmp_path / "roomy")]) == 2
    assert len(ahead) == 1 and "stop here" in capsys.readouterr().err


# the run of the module's recipe with Checkpointer.save failing at step 3 (a full disk), in a subprocess: it loads the
# straight run's compiled step from the module's compilation cache
_FLAKY_SAVE = """
import sys
from moevlm_jax.training.checkpoint import Checkpointer
real = Checkpointer.save
def flaky(self, step, *args, **kwargs):
    if step == 3:
        raise OSError(28, "No space left on device")
    return real(self, step, *args, **kwargs)
Checkpointer.save = flaky
from moevlm_jax.train import main
sys.exit(main(sys.argv[1:]))
"""


def test_a_failed_checkpoint_write_is_reported_and_training_goes_on(setup, tmp_path):
    recipe, env, want = setup
    run = tmp_path / "run"
    # 4 steps of the straight run's schedule (decay over STEPS: the same compiled step)
    done = subprocess.run([sys.executable, "-c", _FLAKY_SAVE, "--recipe", str(recipe), "--run-dir", str(run), "--quiet",
                           "train.steps=4", f"optimizer.decay_steps={STEPS}"], env=env, capture_output=True, text=True,
                          timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "checkpoint at step 3 failed (OSError" in done.stderr and "No space left on device" in done.stderr
    steps = sorted(int(p.name) for p in (run / "checkpoints").iterdir() if p.name.isdigit())
    assert steps == [1, 2, 4]  # step 3 is missing, the earlier ones were kept, training went on
    assert logged_losses(run) == {s: want[s] for s in range(1, 5)}  # as the straight run
