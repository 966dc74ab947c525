"""Features combined as a real launch combines them (train_unconditional.py; the three other scripts share
its loop, checkpoints and signals word for word): EMA, DataLoader workers, 1 or 2 processes, gradient
accumulation, checkpoints never or every 2 steps, a checkpoint limit of 1, and a SIGTERM to the whole process
group at a random step or at the last one. Each pair of those values meets in some run (a covering array:
`RUNS`, checked below). Every run must end, after its resume, bit-equal to the same command run uninterrupted
without checkpoints; keep a whole checkpoint on disk from the first save on; write nothing non-finite; and exit
with the documented status. FULL_RUNS=1 runs every stop step of every row."""

import itertools
import os
import random
import signal
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from conftest import REPO, assert_same_weights, checkpoints, run_signalled, train_in_process, weights

SCRIPT = "train_unconditional.py"
FACTORS = ("ema", "workers", "processes", "accumulation", "checkpoints", "stop", "limit")
# Seven two-valued factors in six runs: every column is a 6-bit word with a leading 0 and three 1s, so any two
# columns differ in the pattern that covers all four pairs of values.
COLUMNS = [(0, *word) for word in itertools.product((0, 1), repeat=5) if sum(word) == 3][: len(FACTORS)]
RUNS = [dict(zip(FACTORS, row)) for row in zip(*COLUMNS)]
MAX_STEPS = 9  # 12 images in batches of 2 or 4 over 1 or 2 processes: epochs of 3 or 6 steps

# The script under a stand-in for a terminal's Ctrl-C or `kill -- -PGID`: at optimizer step STOP_AT, rank 0 sends
# SIGTERM to the launcher's process group. That is `python` and its DataLoader workers for one process; with two,
# torchrun runs each rank in a session of its own, so the group holds the launcher alone, which passes the signal
# on to each rank's group (the rank and its workers).
STOPPER = f"""
import os, signal, sys
sys.path.insert(0, {str(REPO)!r})
from accelerate.scheduler import AcceleratedScheduler
import train_unconditional as script
step, calls = AcceleratedScheduler.step, [0]
def stop_at(self, *args, **kwargs):
    calls[0] += 1
    if calls[0] == int(os.environ.get("STOP_AT", 0)) and os.environ.get("RANK", "0") == "0":
        os.killpg(os.getpgid(os.getppid()) if "LOCAL_RANK" in os.environ else os.getpgrp(), signal.SIGTERM)
    return step(self, *args, **kwargs)
AcceleratedScheduler.step = stop_at
script.main(script.parse_args())
"""


def test_the_runs_cover_every_pair_of_values():
    for a, b in itertools.combinations(FACTORS, 2):
        assert {(run[a], run[b]) for run in RUNS} == {(0, 0), (0, 1), (1, 0), (1, 1)}, (a, b)


def command(folder, run):
    """The run's flags, without its checkpoints, limit and stop: those of its uninterrupted reference."""
    args = ["--train_data_dir", folder["digits"], "--model_config_name_or_path", folder["unet"], "--resolution",
            "32", "--random_flip", "--snr_gamma", "5", "--learning_rate", "1e-3", "--lr_warmup_steps", "2",
            "--max_train_steps", MAX_STEPS, "--save_images_epochs", "2", "--save_model_epochs", "1",
            "--ddpm_num_inference_steps", "2", "--eval_batch_size", "1", "--logger", "none",
            "--train_batch_size", "2", "--gradient_accumulation_steps", 1 + run["accumulation"],
            "--checkpointing_steps", 1000]  # fmt: skip
    return args + (["--use_ema"] if run["ema"] else [])


@pytest.fixture(scope="module")
def folder(digits_folder, tiny_unet_config):
    return {"digits": digits_folder, "unet": tiny_unet_config}


@pytest.fixture(scope="module")
def references(tmp_path_factory, folder):
    """The final weights of each uninterrupted command (workers change nothing: each draw is seeded)."""
    found = {}

    def reference(run, out=None):
        """`out`: the output of a run that is its own reference (the command itself), used if none is yet."""
        key = (run["ema"], run["processes"], run["accumulation"])
        if key not in found and out is None:
            out = tmp_path_factory.mktemp("reference") / "out"
            args = command(folder, run) + ["--output_dir", out]
            if run["processes"]:
                status, log, _ = run_signalled(SCRIPT, args, None, num_processes=2)
                assert status == 0, log[-3000:]
            else:
                train_in_process(SCRIPT, args)
        if key not in found:
            found[key] = weights(out / "unet")
        return found[key]

    return reference


class Watch(threading.Thread):
    """Lists output_dir every 5 ms; records any moment, after the first checkpoint, with none on disk."""

    def __init__(self, out):
        super().__init__(daemon=True)
        self.out, self.seen, self.gaps, self.done = out, False, [], threading.Event()
        self.start()

    def run(self):
        while not self.done.wait(0.005):
            names = checkpoints(self.out) if self.out.exists() else []
            if names:
                self.seen = True
            elif self.seen:
                self.gaps.append(time.monotonic())


def launch(run, args, env):
    num_processes = 2 if run["processes"] else 1
    script = Path(args[args.index("--output_dir") + 1]).parent / "stopper.py"
    script.write_text(STOPPER)
    # One process runs under `python` itself, as docs/reference.md tells schedulers to run it.
    return run_signalled(script, args, None, num_processes=num_processes, launcher=num_processes > 1, env=env)


def assert_all_finite(out):
    for path in Path(out).rglob("*.safetensors"):
        assert all(torch.isfinite(v).all() for v in weights(path.parent, path.name).values()), path
    for path in Path(out).rglob("optimizer.bin"):
        state = torch.load(path, weights_only=False)["state"]
        assert all(torch.isfinite(t).all() for s in state.values() for t in s.values() if t.is_floating_point())


def stop_steps(index):
    """Where row `index` stops: a step drawn at random (seeded), or the last step on every other stopped row."""
    if os.environ.get("FULL_RUNS") == "1":
        return list(range(1, MAX_STEPS + 1))
    return [MAX_STEPS if index % 4 == 1 else random.Random(index).randint(1, MAX_STEPS - 1)]


@pytest.mark.parametrize("index", range(len(RUNS)), ids=[
    "-".join(f"{k}={v}" for k, v in run.items()) for run in RUNS])  # fmt: skip
def test_a_combined_run_ends_where_the_uninterrupted_one_does(index, folder, references, tmp_path):
    run = RUNS[index]
    flags = ["--dataloader_num_workers", 2 * run["workers"]]
    flags += ["--checkpointing_steps", 2] if run["checkpoints"] else []
    flags += ["--checkpoints_total_limit", 1] if run["limit"] else []
    for stop in stop_steps(index) if run["stop"] else [None]:
        out = tmp_path / f"stop-{stop}" / "out"
        out.parent.mkdir()
        args = command(folder, run) + flags + ["--output_dir", out, "--resume_from_checkpoint", "latest"]
        watch = Watch(out)
        status, log, _ = launch(run, args, {"STOP_AT": str(stop or 0)})
        if stop:
            # One process, under `python`, exits 75 itself; what `accelerate launch` returns for its ranks is
            # the launcher's own (1 on accelerate 1.15), and the file `stopped` is what a scheduler reads.
            assert status == 75 if not run["processes"] else status != 0, log[-3000:]
            # At the first read of the loss from the signal on: every 10 steps, at a checkpoint, an epoch's end.
            stopped = int(checkpoints(out)[-1].split("-")[1])
            assert (out / "stopped").exists() and stopped >= stop and f"Stopped at step {stopped}: go on" in log
            status, log, _ = launch(run, args, {})
        assert status == 0, log[-3000:]
        assert not (out / "stopped").exists()
        watch.done.set()
        watch.join()
        assert not watch.gaps, "a moment with no checkpoint on disk"
        assert_all_finite(out)
        # A run without workers, checkpoints, stop or limit is the command itself: its key's reference, if first.
        plain = not any(run[k] for k in ("workers", "checkpoints", "stop", "limit"))
        assert_same_weights(weights(out / "unet"), references(run, out if plain else None))
        if run["limit"] and checkpoints(out):
            assert len(checkpoints(out)) == 1



def test_the_slurm_recipe_requeues_a_stopped_two_process_run_and_not_a_finished_one(folder, references, tmp_path):
    """docs/reference.md's batch script, line for line, but for the training command's arguments: `srun` and
    `scontrol` are stand-ins (srun runs the command in a process group of its own, as Slurm's job step, and is
    what the signal reaches; scontrol records what it was asked)."""
    import re
    import shlex
    import subprocess

    from conftest import HF_ENV, _accelerate_config, _free_port

    text = (REPO / "docs" / "reference.md").read_text()
    recipe = re.search(r"### Slurm\n.*?```bash\n(.*?)```", text, re.S).group(1)
    run = {"ema": 1, "processes": 1, "accumulation": 0}
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", _accelerate_config(),
              "--multi_gpu", "--num_processes", "2", "--main_process_port", str(_free_port())]
    (tmp_path / "stopper.py").write_text(STOPPER)
    args = [*launch, tmp_path / "stopper.py", *command(folder, run), "--checkpointing_steps", 4,
            "--resume_from_checkpoint", "latest", "--output_dir", "my-lora"]
    assert re.search(r"^srun .* --resume_from_checkpoint latest --output_dir my-lora \.\.\.$", recipe, re.M)
    recipe = re.sub(r"^srun .*$", "srun " + shlex.join(map(str, args)), recipe, flags=re.M)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text('#!/bin/bash\nexec setsid --wait "$@"\n')
    (bin_dir / "scontrol").write_text(f'#!/bin/bash\necho "$@" >> {tmp_path / "scontrol.log"}\n')
    for tool in ("srun", "scontrol"):
        (bin_dir / tool).chmod(0o755)
    (tmp_path / "job.sh").write_text(recipe)
    env = {**os.environ, **HF_ENV, "ACCELERATE_USE_CPU": "1", "SLURM_JOB_ID": "4242",
           "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    stopped = subprocess.run(["bash", "job.sh"], cwd=tmp_path, env={**env, "STOP_AT": "3"}, capture_output=True,
                             text=True, timeout=600)
    assert stopped.returncode != 0, stopped.stdout[-3000:] + stopped.stderr[-3000:]
    assert (tmp_path / "scontrol.log").read_text() == "requeue 4242\n"
    again = subprocess.run(["bash", "job.sh"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert (tmp_path / "scontrol.log").read_text() == "requeue 4242\n"  # not requeued again
    assert_same_weights(weights(tmp_path / "my-lora" / "unet"), references(run))
