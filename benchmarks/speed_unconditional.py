"""Images per second of train_unconditional.py next to a bare training loop, measured in one run.

    python benchmarks/speed_unconditional.py [--train_batch_size 16] [--steps 40]

The config of the Diffusers example's CPU figure (issue #3): UNet (32, 64, 64) from configs/unet-digits,
32 px digits, AdamW, fp32, one process. The bare loop is forward, backward, clip and step on one fixed
batch with nothing else around it: the ceiling for any script with this model. The script's figure is
the median of the img/s it logs per step (data loading, noise, loss, logging all included), skipping
the first 5 steps. Run it on an otherwise idle machine.
"""
import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from diffusers import UNet2DModel
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

REPO = Path(__file__).resolve().parent.parent
CONFIG = REPO / "configs" / "unet-digits"


def bare_loop(batch_size, steps):
    torch.manual_seed(0)
    model = UNet2DModel.from_config(UNet2DModel.load_config(CONFIG))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x, noise = torch.randn(batch_size, 3, 32, 32), torch.randn(batch_size, 3, 32, 32)
    t = torch.randint(0, 1000, (batch_size,))
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        loss = torch.nn.functional.mse_loss(model(x, t).sample, noise)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        times.append(batch_size / (time.perf_counter() - start))
    return statistics.median(times[5:])


def script(batch_size, steps, extra):
    with tempfile.TemporaryDirectory() as out:
        subprocess.run(
            [sys.executable, str(REPO / "train_unconditional.py"), "--train_data_dir", str(REPO / "data" / "digits"),
             "--model_config_name_or_path", str(CONFIG), "--resolution", "32", "--train_batch_size", str(batch_size),
             "--max_train_steps", str(steps), "--output_dir", out, "--checkpointing_steps", "100000",
             "--save_images_epochs", "100000", "--ddpm_num_inference_steps", "1", "--eval_batch_size", "1", *extra],
            check=True, capture_output=True, env={**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"},
        )
        events = EventAccumulator(str(Path(out) / "logs" / "train_unconditional")).Reload()
        return statistics.median(e.value for e in events.Scalars("img/s")[5:])


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--train_batch_size", type=int, default=16)
    p.add_argument("--steps", type=int, default=40)
    args = p.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, batch {args.train_batch_size}, 32 px")
    bare = bare_loop(args.train_batch_size, args.steps)
    print(f"bare loop                         {bare:6.1f} img/s")
    for name, extra in [("train_unconditional.py", []), ("train_unconditional.py --use_ema", ["--use_ema"]),
                        ("  + --random_flip", ["--use_ema", "--random_flip"])]:
        figure = script(args.train_batch_size, args.steps, extra)
        print(f"{name:33s} {figure:6.1f} img/s  ({figure / bare:.2f} of the bare loop)")


if __name__ == "__main__":
    main()
