#!/usr/bin/env python
"""Operations per training step: our LoRA (and text-to-image) script against the Diffusers example.

On a GPU where the host's launching of kernels bounds the step (the SD 1.5 LoRA at batch 4: 7.6 %
MFU, and no faster without the VAE's FLOPs, in benchmarks/gpu_table_h100_2026-11-26.md), every
aten operation dispatched costs about the same, so their count per step is the step time; it can
be counted on a CPU. Each script runs as its own process through benchmarks/_timed.py with
TIMED_COUNT_OPS=1, on the tests' tiny Stable Diffusion (64 px), with the same flags (below), and
the operations of the steps after --warmup are averaged:

    python benchmarks/op_count.py                      # LoRA, bf16
    python benchmarks/op_count.py --models lora sd --mixed_precision no bf16
    python benchmarks/op_count.py --flags=--cache_latents   # ours cached, the reference not

Printed: operations per step, host syncs per step (`_local_scalar_dense`: a tensor read on the
host, e.g. `.item()`), casts per step (`_to_copy`), ours / reference, and the operations whose
counts differ most. Operation counts move between torch releases: a benchmark, not a test.

Flags, ours and reference alike: --pretrained_model_name_or_path <tiny SD> --train_data_dir
<64 px photos> --resolution 64 --center_crop --train_batch_size 4 --max_train_steps N
--mixed_precision M --checkpointing_steps 1000000 --seed 0 --dataloader_num_workers 0
--output_dir <temporary>; LoRA rows also --rank 4; --flags adds more (ours only if the reference
lacks them).
"""

import argparse
import json
import shlex
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))
import gpu_table  # noqa: E402  its tiny pipeline, photos, scripts and environment

TIMED = REPO / "benchmarks" / "_timed.py"


def count(args, model, script, precision, extra):
    """{"ops": mean operations per step, "per_op": {name: mean per step}} for one run."""
    ours = script == "ours"
    path = REPO / gpu_table.OURS[model] if ours else args.reference_dir / gpu_table.REFERENCE[model]
    with tempfile.TemporaryDirectory(dir=args.work_dir) as tmp:
        flags = ["--pretrained_model_name_or_path", args.pipeline, "--train_data_dir", args.data]
        flags += ["--resolution", 64, "--center_crop", "--train_batch_size", args.batch]
        flags += ["--max_train_steps", args.steps, "--mixed_precision", precision]
        flags += ["--checkpointing_steps", gpu_table.NEVER, "--seed", 0]
        flags += ["--dataloader_num_workers", 0, "--output_dir", f"{tmp}/out"]
        flags += ["--rank", 4] if model == "lora" else []
        flags += extra
        env = {**gpu_table.run_env(args, False), "TIMED_JSON": f"{tmp}/steps.json"}
        env["TIMED_COUNT_OPS"] = "1"
        cmd = [sys.executable, str(TIMED), str(path), *map(str, flags)]
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(
                f"{script} {model} failed:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}"
            )
        steps = json.loads(Path(f"{tmp}/steps.json").read_text())["step_ops"][args.warmup :]
    per_op = {}
    for step in steps:
        for name, n in step.items():
            per_op[name] = per_op.get(name, 0) + n / len(steps)
    return {"ops": sum(per_op.values()), "per_op": per_op}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", choices=["lora", "sd"], default=["lora"])
    p.add_argument("--mixed_precision", nargs="+", default=["bf16"], choices=["no", "bf16"])
    p.add_argument("--flags", default="", help='More flags for ours, e.g. "--cache_latents".')
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=12, help="Optimizer steps a run.")
    p.add_argument("--warmup", type=int, default=4, help="First steps left out.")
    p.add_argument("--work_dir", type=Path, default=Path(tempfile.gettempdir()) / "gpu-table")
    p.add_argument("--reference_dir", type=Path)
    p.add_argument("--top", type=int, default=8, help="Operations listed whose counts differ.")
    args = p.parse_args()
    args.flags = shlex.split(args.flags)
    args.tiny, args.pipeline_arg = True, None
    args.work_dir = args.work_dir.resolve()
    args.work_dir.mkdir(parents=True, exist_ok=True)
    args.reference_dir = args.reference_dir or next(
        d for d in gpu_table.REFERENCE_DIRS if (d / gpu_table.REFERENCE["sd"]).is_file()
    )
    args.pipeline = str(gpu_table.pipeline_folder(argparse.Namespace(pipeline=None, **vars(args))))
    args.data = str(gpu_table.photo_folder(args.work_dir, 64, 64))
    import torch

    print(
        f"torch {torch.__version__}; tiny SD, 64 px, batch {args.batch}, steps {args.warmup}"
        f"-{args.steps} of each run; flags: {' '.join(args.flags) or '(none)'}"
    )
    print(
        "\n| model | precision | ops/step ours | reference | ours/ref | host syncs ours | ref "
        "| casts ours | ref |"
    )
    print("|---|---|--:|--:|--:|--:|--:|--:|--:|")
    details = []
    for model in args.models:
        for precision in args.mixed_precision:
            ours = count(args, model, "ours", precision, args.flags)
            ref = count(args, model, "reference", precision, [])
            sync = [r["per_op"].get("_local_scalar_dense", 0) for r in (ours, ref)]
            casts = [r["per_op"].get("_to_copy", 0) for r in (ours, ref)]
            print(
                f"| {model} | {precision} | {ours['ops']:.0f} | {ref['ops']:.0f} | "
                f"{ours['ops'] / ref['ops']:.3f}x | {sync[0]:.1f} | {sync[1]:.1f} | "
                f"{casts[0]:.0f} | {casts[1]:.0f} |"
            )
            names = set(ours["per_op"]) | set(ref["per_op"])
            diff = {n: ours["per_op"].get(n, 0) - ref["per_op"].get(n, 0) for n in names}
            top = sorted(diff.items(), key=lambda kv: -abs(kv[1]))[: args.top]
            details.append(
                f"{model} {precision}, ours - reference per step: "
                + ", ".join(f"{n} {d:+.1f}" for n, d in top if abs(d) >= 0.05)
            )
    print()
    print("\n".join(details))


if __name__ == "__main__":
    main()
