"""Does train_dit.py draw the digit it is asked for? The digits SVC of test_learning.py judges its guided samples.

In CI this is a short run: the loss must fall. `FULL_RUNS=1 pytest tests/test_dit_learning.py -s` trains the demo
(configs/dit-digits, about 10 minutes on 2 CPU cores) and prints the figures quoted in docs/dit-readme-section.md.
"""
import os
import sys
import time

import pytest
import torch
from conftest import REPO, run_script
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from test_learning import digit_probabilities

FULL = os.environ.get("FULL_RUNS") == "1"
DEMO = ["--train_data_dir", REPO / "data" / "digits", "--resolution", "16", "--model_config_name_or_path",
        REPO / "configs" / "dit-digits", "--train_batch_size", "16", "--learning_rate", "5e-4",
        "--lr_scheduler", "constant_with_warmup", "--lr_warmup_steps", "100", "--use_ema", "--ema_max_decay", "0.999",
        "--seed", "0", "--eval_batch_size", "10"]
PER_CLASS = 20  # guided samples per digit, drawn with DDIM in 50 steps (as the demo's grids)


def agreement(model, scheduler, guidance_scale, per_class, steps):
    """Share of guided samples that the SVC classifies as the digit that was asked for."""
    sys.path.insert(0, str(REPO))
    from train_dit import sample_images

    labels = torch.arange(10).repeat_interleave(per_class)
    images = sample_images(model, scheduler, labels, guidance_scale, steps, generator=torch.manual_seed(0))
    return (digit_probabilities(images.permute(0, 2, 3, 1).numpy()).argmax(1) == labels.numpy()).mean()


@pytest.mark.slow
def test_dit_draws_the_digit_it_is_asked_for(tmp_path):
    from diffusers import DDIMScheduler, DiTTransformer2DModel

    out = tmp_path / "demo"
    steps = ["--num_epochs", "50", "--save_images_epochs", "20"] if FULL else \
        ["--max_train_steps", "40", "--lr_warmup_steps", "10", "--eval_batch_size", "1", "--num_inference_steps", "5"]
    start = time.perf_counter()
    run_script(REPO / "train_dit.py", DEMO + steps + ["--output_dir", out], env={"OMP_NUM_THREADS": str(os.cpu_count())},
               timeout=3600)  # about 10 minutes alone on 2 cores; a busy machine can make it several times that
    print(f"\ntrained in {time.perf_counter() - start:.0f} s (validation grids and saves included)")
    losses = [e.value for e in EventAccumulator(str(out / "logs" / "train_dit")).Reload().Scalars("loss")]
    assert losses[-1] < 0.5 * losses[0]  # each the mean of the 10 steps before it (logged every 10)

    trained = DiTTransformer2DModel.from_pretrained(out / "transformer")
    scheduler = DDIMScheduler.from_pretrained(out / "scheduler")
    torch.manual_seed(0)
    untrained = DiTTransformer2DModel.from_config(trained.config).eval()  # diffusers' random initialisation
    per_class, sampling_steps = (PER_CLASS, 50) if FULL else (2, 10)
    figures = {}
    for name, model, scale in [("trained", trained, 1.0), ("trained", trained, 2.0), ("trained", trained, 4.0), ("untrained", untrained, 4.0)]:
        figures[name, scale] = agreement(model, scheduler, scale, per_class, sampling_steps)
        print(f"{name}, guidance {scale}: {10 * per_class} samples, the judge agrees with the class asked for on "
              f"{figures[name, scale]:.1%}")
    if FULL:  # the demo's promise: at the default guidance nearly every sample is the digit asked for
        assert figures["trained", 4.0] >= 0.9 and figures["untrained", 4.0] < 0.3
