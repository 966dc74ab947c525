"""Does train_unconditional.py learn to draw digits? A classifier trained on the real digits judges its samples.

In CI this is a short run: the loss must fall, and the judge must be trustworthy on real digits.
`FULL_RUNS=1 pytest tests/test_learning.py -s` trains the README demo (about 10 minutes on 2 CPU cores)
and prints the figures quoted in the README.
"""
import os
import time
from functools import cache

import numpy as np
import pytest
import torch
from conftest import REPO, run_script
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

FULL = os.environ.get("FULL_RUNS") == "1"
DEMO = ["--train_data_dir", REPO / "data" / "digits", "--resolution", "16", "--model_config_name_or_path",
        REPO / "configs" / "unet-digits", "--train_batch_size", "16", "--learning_rate", "1e-3", "--lr_warmup_steps", "100",
        "--use_ema", "--ema_max_decay", "0.999", "--seed", "0", "--ddpm_num_inference_steps", "100", "--eval_batch_size", "64"]
SAMPLES = 200  # judged per model, drawn with DDIM in 50 steps (the validation grids are DDPM in 100 steps)


@cache
def digits_classifier():
    from sklearn.datasets import load_digits
    from sklearn.svm import SVC

    digits = load_digits()
    return SVC(gamma=0.001, probability=True, random_state=0).fit(digits.data, digits.target)


def digit_probabilities(images):
    """The class probabilities that an SVC trained on the 8x8 digits gives images (N, H, W, channels) in [0, 1]."""
    gray = torch.as_tensor(np.asarray(images), dtype=torch.float32).mean(-1, keepdim=True).permute(0, 3, 1, 2)  # any channels
    small = torch.nn.functional.interpolate(gray, size=(8, 8), mode="area")  # back to the data's 8x8 grid
    return digits_classifier().predict_proba(small.flatten(1).numpy() * 16)  # the data's 0..16 ink scale


def judge(images):
    """Share of samples that an SVC trained on the 8x8 digits classifies with confidence > 0.9, their classes,
    and the mean confidence (the SVC's top class probability)."""
    proba = digit_probabilities(images)
    confident = proba.max(1) > 0.9
    return confident.mean(), np.bincount(proba.argmax(1)[confident], minlength=10), proba.max(1).mean()


def test_the_judge_trusts_real_digits_at_training_resolution():
    from PIL import Image

    files = sorted((REPO / "data" / "digits").glob("*.png"))[:200]
    images = [np.asarray(Image.open(f).convert("L").resize((16, 16), Image.BILINEAR))[..., None] / 255 for f in files]
    share, histogram, _ = judge(images)
    assert share > 0.9 and (histogram > 0).all()


@pytest.mark.slow
def test_unconditional_learns_digits(tmp_path):
    from diffusers import DDIMPipeline, DDIMScheduler, DDPMPipeline, UNet2DModel

    out = tmp_path / "demo"
    steps = ["--num_epochs", "60", "--save_images_epochs", "20"] if FULL else \
        ["--max_train_steps", "40", "--lr_warmup_steps", "10", "--ddpm_num_inference_steps", "5", "--eval_batch_size", "4"]
    start = time.perf_counter()
    run_script(REPO / "train_unconditional.py", DEMO + steps + ["--output_dir", out], env={"OMP_NUM_THREADS": str(os.cpu_count())})
    print(f"\ntrained in {time.perf_counter() - start:.0f} s (validation grids and saves included)")
    losses = [e.value for e in EventAccumulator(str(out / "logs" / "train_unconditional")).Reload().Scalars("loss")]
    assert losses[-1] < 0.5 * losses[0]  # each the mean of the 10 steps before it (logged every 10)

    pipe = DDPMPipeline.from_pretrained(out)
    untrained = UNet2DModel.from_config(pipe.unet.config)
    figures = {}
    for name, unet in [("trained", pipe.unet), ("untrained", untrained)]:
        sampler = DDIMPipeline(unet=unet, scheduler=DDIMScheduler.from_config(pipe.scheduler.config))
        sampler.set_progress_bar_config(disable=True)
        images = sampler(batch_size=SAMPLES if FULL else 8, num_inference_steps=50 if FULL else 10,
                         generator=torch.manual_seed(0), output_type="np").images
        figures[name] = judge(images)
        share, histogram, confidence = figures[name]
        print(f"{name}: {len(images)} samples, {share:.0%} classified with confidence > 0.9 "
              f"(classes 0-9: {histogram.tolist()}), mean confidence {confidence:.2f}")
    if FULL:  # the demo's promise: most samples are digits the judge is sure of, and every digit appears
        share, histogram, _ = figures["trained"]
        assert share >= 0.5 and (histogram > 0).all()
