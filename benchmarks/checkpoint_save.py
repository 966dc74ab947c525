"""How long one checkpoint takes to write for each script's real model: the SD 1.5 UNet with its AdamW
state (train_text_to_image.py) and a rank-4 LoRA on that UNet (train_lora.py).

It bounds how fast a stopped run can go: torchrun kills its workers 30 s after it forwards a SIGTERM,
and Slurm sends SIGKILL `KillWait` (30 s by default) after its SIGTERM (docs/reference.md, "Stopping
and preemption"). The pipeline is SD 1.5 with random weights from its published configs
(_models.build_sd15): nothing is downloaded. Each script trains one step at 64 px on the bundled
digits, on this machine's default device, and the checkpoint of that step is timed inside the script
(its own save_checkpoint, wrapped). Prints a row per script: seconds and size.

    .venv/bin/python benchmarks/checkpoint_save.py [--work_dir DIR]
"""

import argparse
import re
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))

from _models import build_sd15  # noqa: E402

WRAPPER = """import sys, time
sys.path.insert(0, {repo!r})
import {module} as script
save = script.save_checkpoint
def timed(accelerator, args, global_step):
    start = time.perf_counter()
    save(accelerator, args, global_step)
    print(f"CHECKPOINT_SECONDS {{time.perf_counter() - start:.2f}}", flush=True)
script.save_checkpoint = timed
script.main(script.parse_args())
"""


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--work_dir", type=Path, help="Where the pipeline and the runs go (default: a temp dir).")
    args = p.parse_args()
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="checkpoint-save-"))
    sd15 = work / "sd15"
    if not (sd15 / "model_index.json").exists():
        build_sd15(sd15)
    rows = []
    for script in ["train_text_to_image.py", "train_lora.py"]:
        wrapper = work / f"timed_{Path(script).stem}.py"
        wrapper.write_text(WRAPPER.format(repo=str(REPO), module=Path(script).stem))
        out = work / Path(script).stem
        cmd = [sys.executable, str(wrapper), "--pretrained_model_name_or_path", str(sd15),
               "--train_data_dir", str(REPO / "data" / "digits"), "--instance_prompt", "a handwritten digit",
               "--resolution", "64", "--train_batch_size", "1", "--max_train_steps", "1",
               "--checkpointing_steps", "1", "--report_to", "none", "--output_dir", str(out)]
        log = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
        found = re.search(r"CHECKPOINT_SECONDS ([\d.]+)", log.stdout)
        if not found:
            sys.exit(f"{script} failed:\n{log.stdout[-3000:]}\n{log.stderr[-3000:]}")
        size = sum(f.stat().st_size for f in (out / "checkpoint-1").rglob("*") if f.is_file())
        rows.append((script, float(found[1]), size / 2**30))
    print("| script | checkpoint write (s) | checkpoint size (GiB) |\n|---|--:|--:|")
    for script, seconds, gib in rows:
        print(f"| {script} | {seconds:.1f} | {gib:.3f} |")


if __name__ == "__main__":
    main()
