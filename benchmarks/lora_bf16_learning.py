#!/usr/bin/env python
"""Does the LoRA learn the same under bf16 (bf16 copies of A and B, fp32 masters) as in fp32?

tests/test_sd_learning.py's LoRA demo at its CI size, run twice from the same base: the digits
model (data/make_tiny_sd.py's pipeline with a VAE of 300 steps, then 300 steps of
train_text_to_image.py on 1,500 digits), then train_lora.py's bold style (800 steps on 250 bold
digits) with --mixed_precision no and bf16. Printed for each: the held-out bold digits' denoising
loss without and with the LoRA, and the mean ink of 50 samples (5 a "bold" prompt, guidance 3)
without and with it. One seed each: the two runs differ by rounding, so compare the effects (the
loss's fall, the ink's rise), not the digits.

    python benchmarks/lora_bf16_learning.py            # about 15 minutes on 2 CPU cores
    python benchmarks/lora_bf16_learning.py --digits_model FOLDER   # that digits model instead
    python benchmarks/lora_bf16_learning.py --max_train_steps 300   # a shorter LoRA run
"""

import argparse

import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "data"))
os.environ.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1")

import test_sd_learning as demo  # noqa: E402  the demo's commands and measures
from conftest import run_script  # noqa: E402


def build_digits_model(work, env):
    """data/make_tiny_sd.py's pipeline, then 300 steps of the text-to-image demo on 1,500 digits."""
    start = time.perf_counter()
    base, digits = work / "base", work / "digits"
    __import__("make_tiny_sd").main(["--output_dir", str(base), "--vae_steps", "300"])
    data = demo.subset(demo.DATA / "digits", range(1500), work / "digits-train")
    ci = ["--max_train_steps", "300", "--validation_epochs", "100", "--num_inference_steps", "5"]
    run_script(
        "train_text_to_image.py",
        ["--pretrained_model_name_or_path", base, *demo.TEXT_TO_IMAGE, "--train_data_dir", data]
        + [*ci, "--output_dir", digits],
        env=env,
        timeout=3600,
    )
    print(f"base and digits model built in {time.perf_counter() - start:.0f} s", flush=True)
    return digits


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--digits_model", type=Path, help="A digits model built as above already.")
    p.add_argument("--precisions", nargs="+", default=["no", "bf16"], choices=["no", "bf16"])
    p.add_argument("--max_train_steps", type=int, default=800, help="The LoRA's steps (CI: 800).")
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="lora-bf16-"))
    env = {"OMP_NUM_THREADS": str(os.cpu_count())}
    digits = args.digits_model or build_digits_model(work, env)
    bold_data = demo.subset(demo.DATA / "bold-digits", range(250), work / "bold-train")
    ink, read_images = demo.tool("make_bold_digits").ink, demo.tool("make_bold_digits").read_images
    bold, rows = read_images(demo.DATA / "bold-digits")
    held_out, captions = bold[250:], [row["text"] for row in rows][250:]
    ci = [
        "--max_train_steps",
        str(args.max_train_steps),
        "--validation_epochs",
        "100",
        "--num_inference_steps",
        "5",
    ]
    results = []
    for precision in args.precisions:
        out = work / f"lora-{precision}"
        start = time.perf_counter()
        run_script(
            "train_lora.py",
            ["--pretrained_model_name_or_path", digits, *demo.LORA, "--train_data_dir", bold_data]
            + [*ci, "--mixed_precision", precision, "--output_dir", out],
            env=env,
            timeout=3600,
        )
        seconds = time.perf_counter() - start
        pipe = demo.load(digits)
        without = demo.denoising_loss(pipe, held_out, captions)
        off = demo.draw(pipe, demo.BOLD_PROMPTS, 5, cross_attention_kwargs={"scale": 0.0})
        pipe.load_lora_weights(out)
        with_lora = demo.denoising_loss(pipe, held_out, captions)
        on = demo.draw(pipe, demo.BOLD_PROMPTS, 5)
        results.append((precision, seconds, without, with_lora, ink(off).mean(), ink(on).mean()))
        print(results[-1], flush=True)
    print("\n| precision | trained in | loss without | with the LoRA | ink without | with |")
    print("|---|--:|--:|--:|--:|--:|")
    for precision, seconds, without, with_lora, ink_off, ink_on in results:
        print(
            f"| {precision} | {seconds:.0f} s | {without:.4f} | {with_lora:.4f} | {ink_off:.3f} | "
            f"{ink_on:.3f} |"
        )
    print(f"\nthe bold training digits' ink: {ink(bold).mean():.3f}")


if __name__ == "__main__":
    main()
