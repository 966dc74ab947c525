"""Does Stable Diffusion in miniature learn on a CPU? data/make_tiny_sd.py builds SD 1.x's pipeline for
16 px digits (a VAE trained on them, a random CLIP text encoder and UNet); train_text_to_image.py teaches the UNet
the digits' captions; train_lora.py then teaches it a style it never saw, bold strokes, behind the word "bold";
with --aspect_ratio_buckets, text-to-image learns pictures of two digits side by side that square crops cut.

In CI: the pipeline with a briefly trained VAE and a few steps of each script: the denoising loss on held-out images
falls, the LoRA makes 50 samples bolder, and the bucket model denoises held-out pairs better than the square one.
`FULL_RUNS=1 pytest tests/test_sd_learning.py -s` runs the README demos (about 20 minutes on 2 CPU cores) and prints
the figures quoted there; `python docs/experiments.py buckets` runs guide 4's bucket demo.
"""

import json
import os
import shutil
import sys
import time

import numpy as np
import pytest
import torch
from conftest import DIGIT_NAMES, REPO, run_script
from test_learning import digit_probabilities

FULL = os.environ.get("FULL_RUNS") == "1"
DATA = REPO / "data"
PROMPTS = [f"a handwritten digit {name}" for name in DIGIT_NAMES]
BOLD_PROMPTS = [f"a bold handwritten digit {name}" for name in DIGIT_NAMES]
SAMPLE = dict(num_inference_steps=25, guidance_scale=3.0)  # DPM-Solver, as the validation grids
# The README demos' commands, less the base model and output folder
TEXT_TO_IMAGE = ["--train_data_dir", DATA / "digits", "--resolution", "16", "--center_crop", "--cache_latents",
                 "--train_batch_size", "32", "--learning_rate", "1e-3", "--lr_scheduler", "cosine",
                 "--lr_warmup_steps", "100", "--caption_dropout_rate", "0.1", "--max_train_steps", "3000",
                 "--validation_prompts", *PROMPTS, "--validation_epochs", "10", "--num_inference_steps", "25",
                 "--guidance_scale", "3", "--checkpointing_steps", "1000"]
LORA = ["--train_data_dir", DATA / "bold-digits", "--resolution", "16", "--center_crop", "--cache_latents",
        "--train_batch_size", "32", "--learning_rate", "1e-3", "--lr_warmup_steps", "0", "--rank", "4",
        "--max_train_steps", "500", "--validation_prompts", BOLD_PROMPTS[0], BOLD_PROMPTS[2], "--num_validation_images", "4",
        "--validation_epochs", "20", "--num_inference_steps", "25", "--guidance_scale", "3",
        "--checkpointing_steps", "1000"]


def tool(name):
    if str(DATA) not in sys.path:
        sys.path.append(str(DATA))
    return __import__(name)


def subset(folder, rows, out):
    """A copy of an imagefolder with some of its rows: the rest is held out."""
    out.mkdir(parents=True)
    lines = (folder / "metadata.jsonl").read_text().splitlines()
    with open(out / "metadata.jsonl", "w") as f:
        for line in [lines[i] for i in rows]:
            shutil.copy(folder / json.loads(line)["file_name"], out)
            f.write(line + "\n")
    return out


def load(folder):
    from diffusers import DPMSolverMultistepScheduler, StableDiffusionPipeline

    pipe = StableDiffusionPipeline.from_pretrained(folder)
    pipe.scheduler = DPMSolverMultistepScheduler.from_config(pipe.scheduler.config)
    pipe.set_progress_bar_config(disable=True)
    return pipe


@torch.no_grad()
def denoising_loss(pipe, grey, captions, seed=0):
    """Algorithm 1's loss on these images and captions, for fixed draws of ε and t: how well the
    UNet predicts the noise."""
    from diffusers import DDPMScheduler

    g = torch.Generator().manual_seed(seed)
    pixels = torch.as_tensor(grey)[:, None].repeat(1, 3, 1, 1) * 2 - 1
    latents = pipe.vae.encode(pixels).latent_dist.mean * pipe.vae.config.scaling_factor
    noise = torch.randn(latents.shape, generator=g)
    t = torch.randint(0, 1000, (len(latents),), generator=g)
    ids = pipe.tokenizer(captions, padding="max_length", return_tensors="pt").input_ids
    states = pipe.text_encoder(ids)[0]
    noisy = DDPMScheduler.from_config(pipe.scheduler.config).add_noise(latents, noise, t)
    prediction = pipe.unet(noisy, t, states).sample
    return torch.nn.functional.mse_loss(prediction, noise).item()


def draw(pipe, prompts, per_prompt, seed=0, **kwargs):
    """Images (N, 16, 16, 3) in [0, 1], `per_prompt` of each prompt, from fixed noise."""
    generator = torch.Generator().manual_seed(seed)
    return pipe(prompts, num_images_per_prompt=per_prompt, generator=generator, output_type="np",
                **SAMPLE, **kwargs).images


def asked_for(images, per_prompt):
    """Per digit, the share of its samples that the digits classifier reads as that digit."""
    read = digit_probabilities(images).argmax(1).reshape(10, per_prompt)
    return (read == np.arange(10)[:, None]).mean(1)


@pytest.fixture(scope="module")
def base(demo_sd):
    """data/make_tiny_sd.py's pipeline (conftest: the full build, or a VAE of 300 steps in CI)."""
    return demo_sd[0]


@pytest.fixture(scope="module")
def digits_model(base, tmp_path_factory):
    """The text-to-image demo: on all the digits (FULL), or 300 steps on 1,500 of them."""
    out = tmp_path_factory.mktemp("sd-digits") / "out"
    data = DATA / "digits" if FULL else subset(DATA / "digits", range(1500), out.parent / "train")
    steps = [] if FULL else ["--max_train_steps", "300", "--validation_epochs", "100", "--num_inference_steps", "5"]
    start = time.perf_counter()
    run_script("train_text_to_image.py", ["--pretrained_model_name_or_path", base, *TEXT_TO_IMAGE,
                                          "--train_data_dir", data, *steps, "--output_dir", out],
               env={"OMP_NUM_THREADS": str(os.cpu_count())}, timeout=3600)
    print(f"text-to-image trained in {time.perf_counter() - start:.0f} s")
    return out


@pytest.mark.slow
def test_text_to_image_draws_the_digit_asked_for(base, digits_model):
    images, rows = tool("make_bold_digits").read_images(DATA / "digits")
    held_out = slice(1500, None)  # never trained on in CI
    captions = [row["text"] for row in rows][held_out]
    before, after = (denoising_loss(load(m), images[held_out], captions) for m in (base, digits_model))
    wrong = denoising_loss(load(digits_model), images[held_out], np.roll(captions, 1).tolist())
    print(f"held-out denoising loss: {before:.3f} before, {after:.3f} after; {wrong:.3f} with wrong captions")
    assert after < before
    if FULL:  # the demo's promise: the digit asked for, for nearly every sample and every digit
        per_digit = asked_for(draw(load(digits_model), PROMPTS, 20), 20)
        print(f"200 samples at guidance 3: {per_digit.mean():.1%} the digit asked for; per digit 0-9: "
              f"{[f'{share:.0%}' for share in per_digit]}")
        assert after < wrong and per_digit.mean() >= 0.9 and per_digit.min() >= 0.7


@pytest.mark.slow
def test_lora_teaches_the_bold_style_and_keeps_the_digits(digits_model, tmp_path):
    ink, read_images = tool("make_bold_digits").ink, tool("make_bold_digits").read_images
    out = tmp_path / "bold-lora"
    data = DATA / "bold-digits" if FULL else subset(DATA / "bold-digits", range(250), tmp_path / "train")
    steps = [] if FULL else ["--max_train_steps", "800", "--validation_epochs", "100", "--num_inference_steps", "5"]
    start = time.perf_counter()
    run_script("train_lora.py", ["--pretrained_model_name_or_path", digits_model, *LORA, "--train_data_dir", data, *steps,
                                 "--output_dir", out], env={"OMP_NUM_THREADS": str(os.cpu_count())}, timeout=3600)
    print(f"LoRA trained in {time.perf_counter() - start:.0f} s")

    bold, rows = read_images(DATA / "bold-digits")
    held_out, captions = bold[250:], [row["text"] for row in rows][250:]
    pipe = load(digits_model)
    without = denoising_loss(pipe, held_out, captions)
    pipe.load_lora_weights(out)
    with_lora = denoising_loss(pipe, held_out, captions)
    per_prompt = 10 if FULL else 5
    off = draw(pipe, BOLD_PROMPTS, per_prompt, cross_attention_kwargs={"scale": 0.0})
    on = draw(pipe, BOLD_PROMPTS, per_prompt)
    print(f"held-out bold digits' denoising loss: {without:.3f} without the LoRA, {with_lora:.3f} with it")
    print(f"ink of {len(on)} samples: {ink(off).mean():.3f} without the LoRA, {ink(on).mean():.3f} with it "
          f"(the bold digits {ink(bold).mean():.3f})")
    assert with_lora < without and ink(on).mean() > ink(off).mean()
    if FULL:
        kept = asked_for(on, per_prompt)
        print(f"with the LoRA, {kept.mean():.0%} of the samples are the digit asked for")
        assert kept.mean() >= 0.8
        kohya = load(digits_model)
        kohya.load_lora_weights(str(out / "bold-lora.safetensors"))
        difference = abs(draw(kohya, BOLD_PROMPTS, 2) - draw(pipe, BOLD_PROMPTS, 2)).max()
        print(f"the kohya file and the diffusers file draw the same images: largest difference {difference:.1e}")
        assert difference < 1e-3


@pytest.mark.slow
def test_buckets_denoise_whole_pictures_better_than_square_crops(base, tmp_path):
    """Guide 4's bucket demo, short: two digits side by side, trained with and without
    --aspect_ratio_buckets 16,32 (random crops in both), then judged at the pictures' own shape. The
    bucket model, which saw them whole, predicts the noise on held-out pairs better than the model that
    saw squares cut from them. (`python docs/experiments.py buckets` runs the whole demo and reads
    what each model draws, half by half.)"""
    from PIL import Image

    pairs = tool("make_digit_pairs")
    pairs.main(["--output_dir", str(tmp_path / "pairs"), "--count", "1000"])
    folder = tmp_path / "pairs" / "held-out"
    rows = [json.loads(line) for line in (folder / "metadata.jsonl").read_text().splitlines()]
    # As the scripts resize them at --resolution 16 into the bucket 16,32
    held_out = np.stack([np.asarray(Image.open(folder / row["file_name"]).resize((32, 16), Image.Resampling.LANCZOS))
                         for row in rows]).astype(np.float32) / 255
    captions = [row["text"] for row in rows]
    demo = ["--pretrained_model_name_or_path", base, "--train_data_dir", tmp_path / "pairs" / "train",
            "--resolution", "16", "--train_batch_size", "32", "--learning_rate", "1e-3", "--lr_scheduler", "cosine",
            "--lr_warmup_steps", "100", "--caption_dropout_rate", "0.1", "--max_train_steps", "250"]
    loss = {}
    for name, change in {"square crops": [], "buckets": ["--aspect_ratio_buckets", "16,32"]}.items():
        out = tmp_path / name.replace(" ", "-")
        run_script("train_text_to_image.py", [*demo, *change, "--output_dir", out],
                   env={"OMP_NUM_THREADS": str(os.cpu_count())}, timeout=3600)
        loss[name] = denoising_loss(load(out), held_out, captions)
        print(f"{name}: held-out denoising loss at 16 x 32 {loss[name]:.4f}")
    assert loss["buckets"] < loss["square crops"]
