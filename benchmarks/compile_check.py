#!/usr/bin/env python
"""train_lora.py compiled by accelerate's `--dynamo_backend inductor`, on a CPU at the tiny size:
does it train, resume exactly and save the same files as the eager run, with and without
--cache_latents? And how long do the compile and a steady step take?

    python benchmarks/compile_check.py          # about 10 minutes on 2 CPU cores (compiling)

For each of (no cache, --cache_latents): an eager run of 6 steps (checkpoints at 3 and 6), the
same run compiled (ACCELERATE_DYNAMO_BACKEND=INDUCTOR, what `accelerate launch --dynamo_backend
inductor` sets), and the compiled run resumed from its checkpoint-3. Printed: the time from launch
to the end of the first step (imports, loading, caching and compiling), the median of the later
steps, whether the resumed run's LoRA equals the whole run's bit for bit, the largest difference
between the compiled and the eager LoRA, and whether both wrote the same files. A benchmark, not
a test: inductor's first compile of the tiny UNet's forward and backward takes minutes here
(inductor caches compiled graphs on disk, so a second run is faster).
"""

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))
import gpu_table  # noqa: E402  its tiny pipeline, photos and environment

LORA = "pytorch_lora_weights.safetensors"


def run(args, out, backend, extra=()):
    flags = ["--pretrained_model_name_or_path", args.pipeline, "--train_data_dir", args.data]
    flags += ["--resolution", 64, "--center_crop", "--train_batch_size", 4, "--rank", 4]
    flags += [
        "--max_train_steps",
        6,
        "--checkpointing_steps",
        3,
        "--seed",
        0,
        "--report_to",
        "none",
    ]
    flags += ["--output_dir", out, *extra]
    env = {**gpu_table.run_env(args, backend == "INDUCTOR"), "TIMED_JSON": f"{out}.json"}
    cmd = [sys.executable, str(gpu_table.TIMED), str(REPO / "train_lora.py"), *map(str, flags)]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    timed = json.loads(Path(f"{out}.json").read_text())
    times = timed["step_times"]
    steps = [b - a for a, b in zip(times, times[1:])]
    return times[0] - timed["start"], statistics.median(steps)


def files(folder):
    """The files a run wrote, the kohya file under one name, the trackers' logs left out."""
    names = []
    for root, _, found in os.walk(folder):
        for name in found:
            path = os.path.relpath(os.path.join(root, name), folder)
            names.append("KOHYA" if path == f"{Path(folder).name}.safetensors" else path)
    return sorted(n for n in names if not n.startswith("logs"))


def main():
    import torch
    from safetensors.torch import load_file

    work = Path(tempfile.mkdtemp(prefix="compile-check-"))
    args = gpu_table.parse_args(["--tiny"])
    args.pipeline = str(gpu_table.pipeline_folder(args))
    args.data = str(gpu_table.photo_folder(args.work_dir, 64, 64))
    print(
        f"torch {torch.__version__}, {os.cpu_count()} CPUs, OMP_NUM_THREADS=1; tiny SD, 64 px, "
        "batch 4, fp32\n"
    )
    print(
        "| flags | eager: to 1st step | step | compiled: to 1st step | step | resumed: to 1st "
        "step | resume exact | compiled - eager | same files |"
    )
    print("|---|--:|--:|--:|--:|--:|---|--:|---|")
    for extra in ([], ["--cache_latents"]):
        name = "--cache_latents" if extra else "default"
        eager, compiled = work / f"eager{len(extra)}", work / f"compiled{len(extra)}"
        eager_first, eager_step = run(args, eager, "NO", extra)
        first, step = run(args, compiled, "INDUCTOR", extra)
        resumed = work / f"resumed{len(extra)}"
        shutil.copytree(compiled / "checkpoint-3", resumed / "checkpoint-3")
        resumed_first, _ = run(
            args, resumed, "INDUCTOR", [*extra, "--resume_from_checkpoint", "latest"]
        )
        a, b, e = (load_file(d / LORA) for d in (compiled, resumed, eager))
        exact = all(torch.equal(a[k], b[k]) for k in a)
        diff = max((a[k] - e[k]).abs().max().item() for k in a)
        same = files(compiled) == files(eager)
        print(
            f"| {name} | {eager_first:.0f} s | {eager_step * 1000:.0f} ms | {first:.0f} s | "
            f"{step * 1000:.0f} ms | {resumed_first:.0f} s | {exact} | {diff:.1e} | {same} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
