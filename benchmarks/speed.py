"""Images per second of the training scripts next to a bare training loop on the same model, in one run.

    python benchmarks/speed.py [--steps 40] [--only unconditional|dit|text_to_image]
    python benchmarks/speed.py --startup 100000 [--script OLD_COPY_OF_train_unconditional.py]
    python benchmarks/speed.py --official ../shared/reference/diffusers_examples [--repeats 3]
    python benchmarks/speed.py --compile [--steps 100]

unconditional: the README demo's UNet (32, 64, 64) from configs/unet-digits, one grey channel, 16 px
digits, batch 16. dit: the DiT demo's transformer from configs/dit-digits (6 blocks of width 128, patches of 2), one
grey channel, 16 px digits with their labels, batch 16. text_to_image: the tiny Stable Diffusion pipeline of the
tests, 64 px captioned digits, batch 4 (issue #4). fp32, one process, all cores.

The bare loop is the step and nothing around it (one fixed batch of real images; VAE and text encoder
forward passes included for text-to-image): the ceiling for any script on that model. A script's figure is the median
of the img/s it logs per step, skipping the first 5. Run it on an otherwise idle machine.

--official DIR times our scripts and the Diffusers examples in DIR on the same config, alternating which goes first:
each is run for a short and a long length, and its rate is the extra images of the long run over its extra wall-clock
seconds, so start-up, loading, the final save (and with --cache_latents --cache_text_embeddings, the encoding before
the first step) cancel out. The same tiny models as above, in RGB for the unconditional pair (the example always trains
3 channels); the text-to-image and LoRA pairs center-crop, which caching needs.
"""

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))
from conftest import build_tiny_sd, write_imagefolder  # noqa: E402  the tests' offline tiny pipeline


def median_img_s(step, batch_size, steps):
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        times.append(batch_size / (time.perf_counter() - start))
    return statistics.median(times[5:])


def real_images(folder, batch_size, size, mode):
    """A batch of the folder's first images in [-1, 1]. Random inputs would be unfair to the bare loop: on a CPU
    they make the tiny text-to-image model compute with denormal floats, which run ~1.6x slower."""
    from PIL import Image

    files = sorted(Path(folder).glob("*.png"))[:batch_size]
    pixels = [
        torch.tensor(
            np.asarray(Image.open(f).convert(mode).resize((size, size))), dtype=torch.float32
        )
        for f in files
    ]
    return torch.stack(pixels).reshape(batch_size, size, size, -1).permute(0, 3, 1, 2) / 127.5 - 1


def bare_unconditional(batch_size, steps):
    from diffusers import DDPMScheduler, UNet2DModel

    model = UNet2DModel.from_config(UNet2DModel.load_config(REPO / "configs" / "unet-digits"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    scheduler = DDPMScheduler()
    images = real_images(REPO / "data" / "digits", batch_size, 16, "L")
    noise, t = torch.randn(images.shape), torch.randint(0, 1000, (batch_size,))

    def step():
        torch.nn.functional.mse_loss(
            model(scheduler.add_noise(images, noise, t), t).sample, noise
        ).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()

    return median_img_s(step, batch_size, steps)


def bare_dit(batch_size, steps):
    from diffusers import DDPMScheduler, DiTTransformer2DModel

    model = DiTTransformer2DModel.from_config(
        DiTTransformer2DModel.load_config(REPO / "configs" / "dit-digits")
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    scheduler = DDPMScheduler()
    images = real_images(REPO / "data" / "digits", batch_size, 16, "L")
    noise, t, y = (
        torch.randn(images.shape),
        torch.randint(0, 1000, (batch_size,)),
        torch.randint(0, 10, (batch_size,)),
    )

    def step():
        torch.nn.functional.mse_loss(
            model(scheduler.add_noise(images, noise, t), t, y).sample, noise
        ).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()

    return median_img_s(step, batch_size, steps)


def bare_text_to_image(pipeline, data, batch_size, steps):
    from diffusers import StableDiffusionPipeline

    pipe = StableDiffusionPipeline.from_pretrained(pipeline)
    unet, vae, text_encoder = (
        pipe.unet,
        pipe.vae.requires_grad_(False),
        pipe.text_encoder.requires_grad_(False),
    )
    optimizer = torch.optim.AdamW(unet.parameters(), lr=1e-4)
    x, t = real_images(data, batch_size, 64, "RGB"), torch.randint(0, 1000, (batch_size,))
    ids = pipe.tokenizer(
        ["a handwritten digit"] * batch_size, padding="max_length", return_tensors="pt"
    ).input_ids

    def step():
        with torch.no_grad():
            latents = vae.encode(x).latent_dist.sample() * vae.config.scaling_factor
            states = text_encoder(ids)[0]
        noise = torch.randn_like(latents)
        pred = unet(pipe.scheduler.add_noise(latents, noise, t), t, states).sample
        torch.nn.functional.mse_loss(pred, noise).backward()
        torch.nn.utils.clip_grad_norm_(unet.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()

    return median_img_s(step, batch_size, steps)


def script_img_s(script, args, steps):
    with tempfile.TemporaryDirectory() as out:
        subprocess.run(
            [
                sys.executable,
                str(REPO / script),
                *map(str, args),
                "--max_train_steps",
                str(steps),
                "--output_dir",
                out,
                "--checkpointing_steps",
                "100000",
            ],
            check=True,
            capture_output=True,
            env={**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"},
        )
        logs = next(Path(out, "logs").iterdir())
        return statistics.median(
            e.value for e in EventAccumulator(str(logs)).Reload().Scalars("img/s")[5:]
        )


def compile_figures(steps):
    """The unconditional demo eager and under torch.compile (inductor, as `accelerate launch --dynamo_backend inductor`
    sets it): img/s after warm-up, and the seconds to the end of the first step, where compilation happens."""
    common = [
        "--train_data_dir",
        REPO / "data" / "digits",
        "--model_config_name_or_path",
        REPO / "configs" / "unet-digits",
        "--resolution",
        "16",
        "--train_batch_size",
        "16",
        "--save_images_epochs",
        "100000",
        "--ddpm_num_inference_steps",
        "1",
        "--eval_batch_size",
        "1",
        "--max_train_steps",
        steps,
        "--checkpointing_steps",
        "100000",
        "--seed",
        "0",
    ]
    for name, backend in [("eager", "NO"), ("inductor", "INDUCTOR")]:
        with tempfile.TemporaryDirectory() as out:
            start = time.time()
            subprocess.run(
                [
                    sys.executable,
                    str(REPO / "train_unconditional.py"),
                    *map(str, common),
                    "--output_dir",
                    out,
                ],
                check=True,
                capture_output=True,
                env={**os.environ, "HF_HUB_OFFLINE": "1", "ACCELERATE_DYNAMO_BACKEND": backend},
            )
            rates = (
                EventAccumulator(str(next(Path(out, "logs").iterdir()))).Reload().Scalars("img/s")
            )
            print(
                f"  {name:9s} {statistics.median(r.value for r in rates[10:]):6.1f} img/s after 10 steps; "
                f"first step done {rates[0].wall_time - start:5.1f} s after launch"
            )


def startup_seconds(script, rows, repeats=3):
    """Seconds from launch to the end of the first training step of `script` on a `rows`-image imagefolder of
    tiny 8x8 PNGs (generated once; the `datasets` cache is warmed by a first, untimed run). The median of repeats."""
    from PIL import Image

    data = Path(tempfile.gettempdir(), f"startup-imagefolder-{rows}")
    if not (data / "metadata.jsonl").is_file():
        data.mkdir(exist_ok=True)
        image = Image.new("RGB", (8, 8), (128, 64, 32))
        for i in range(rows):
            image.save(data / f"{i:06d}.png")
        (data / "metadata.jsonl").write_text(
            "".join(f'{{"file_name": "{i:06d}.png", "label": 0}}\n' for i in range(rows))
        )
    times = []
    for _ in range(repeats + 1):
        with tempfile.TemporaryDirectory() as out:
            start = time.time()
            subprocess.run(
                [
                    sys.executable,
                    str(script),
                    "--train_data_dir",
                    data,
                    "--model_config_name_or_path",
                    REPO / "configs" / "unet-digits",
                    "--resolution",
                    "32",
                    "--max_train_steps",
                    "1",
                    "--output_dir",
                    out,
                    "--seed",
                    "0",
                    "--ddpm_num_inference_steps",
                    "1",
                    "--eval_batch_size",
                    "1",
                ],
                check=True,
                capture_output=True,
                env={**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"},
            )
            events = EventAccumulator(str(next(Path(out, "logs").iterdir()))).Reload()
            loss = (
                "loss" if "loss" in events.Tags()["scalars"] else "train_loss"
            )  # older versions logged train_loss
            times.append(events.Scalars(loss)[0].wall_time - start)
    return statistics.median(times[1:])


def wall_seconds(script, args):
    with tempfile.TemporaryDirectory() as out:
        start = time.perf_counter()
        subprocess.run(
            [sys.executable, str(script), *map(str, args), "--output_dir", out],
            check=True,
            capture_output=True,
            env={**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"},
        )
        return time.perf_counter() - start


def official_ratios(examples, repeats):
    """Ours against the Diffusers example each follows: img/s from the difference of a short and a long run."""
    from diffusers import UNet2DModel

    with tempfile.TemporaryDirectory() as tmp:
        Path(tmp, "vocab").mkdir()
        pipeline = build_tiny_sd(Path(tmp, "vocab"), Path(tmp, "sd"))
        data = write_imagefolder(Path(tmp, "data"), 64)
        UNet2DModel(
            sample_size=32,
            layers_per_block=1,
            block_out_channels=(16, 32),
            down_block_types=("DownBlock2D", "AttnDownBlock2D"),
            up_block_types=("AttnUpBlock2D", "UpBlock2D"),
            norm_num_groups=8,
        ).save_config(Path(tmp, "unet"))
        sd = [
            "--pretrained_model_name_or_path",
            pipeline,
            "--train_data_dir",
            data,
            "--resolution",
            "64",
            "--train_batch_size",
            "4",
            "--center_crop",
            "--checkpointing_steps",
            "100000",
            "--seed",
            "0",
        ]
        cache = [
            "--cache_latents",
            "--cache_text_embeddings",
        ]  # ours only: the encoders run once, before the timed steps
        pairs = [  # ours, its extra flags, the example, the common flags, the flag that sets the length, images per unit, lengths
            (
                "train_unconditional.py",
                [],
                "train_unconditional.py",
                [
                    "--train_data_dir",
                    data,
                    "--model_config_name_or_path",
                    Path(tmp, "unet"),
                    "--resolution",
                    "32",
                    "--train_batch_size",
                    "16",
                    "--save_images_epochs",
                    "100000",
                    "--save_model_epochs",
                    "100000",
                    "--ddpm_num_inference_steps",
                    "1",
                    "--eval_batch_size",
                    "1",
                    "--checkpointing_steps",
                    "100000",
                ],
                "--num_epochs",
                64,
                (2, 82),
            ),
            (
                "train_text_to_image.py",
                [],
                "train_text_to_image.py",
                sd,
                "--max_train_steps",
                4,
                (5, 305),
            ),
            (
                "train_text_to_image.py",
                cache,
                "train_text_to_image.py",
                sd,
                "--max_train_steps",
                4,
                (5, 305),
            ),
            (
                "train_lora.py",
                [],
                "train_text_to_image_lora.py",
                sd,
                "--max_train_steps",
                4,
                (5, 305),
            ),
            (
                "train_lora.py",
                cache,
                "train_text_to_image_lora.py",
                sd,
                "--max_train_steps",
                4,
                (5, 305),
            ),
        ]
        for ours, extra, theirs, common, flag, images, (short, long) in pairs:
            times, runs = {}, [(REPO / ours, extra), (Path(examples) / theirs, [])]
            for repeat in range(repeats):
                for script, flags in runs[:: 1 if repeat % 2 == 0 else -1]:  # alternate the order
                    for n in (short, long):
                        times.setdefault((script, n), []).append(
                            wall_seconds(script, common + flags + [flag, n])
                        )
            rate = {
                script: (long - short)
                * images
                / (statistics.median(times[script, long]) - statistics.median(times[script, short]))
                for script, _ in runs
            }
            name = ours + (" + cache" if extra else "")
            print(
                f"  {name:32s} {rate[REPO / ours]:6.1f} img/s   example {theirs:30s} {rate[Path(examples) / theirs]:6.1f} img/s"
                f"   ours/theirs {rate[REPO / ours] / rate[Path(examples) / theirs]:.2f}"
            )


def report(name, figure, bare):
    print(f"  {name:42s} {figure:6.1f} img/s  ({figure / bare:.2f} of the bare loop)")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--only", choices=["unconditional", "dit", "text_to_image"])
    p.add_argument(
        "--startup",
        type=int,
        metavar="ROWS",
        help="Time to the first step on ROWS tiny images instead.",
    )
    p.add_argument(
        "--script",
        default=REPO / "train_unconditional.py",
        help="The script whose startup is timed.",
    )
    p.add_argument(
        "--official", metavar="DIR", help="Compare with the Diffusers examples in DIR instead."
    )
    p.add_argument(
        "--repeats", type=int, default=3, help="With --official: runs of each length per script."
    )
    p.add_argument(
        "--compile", action="store_true", help="The unconditional demo eager and compiled instead."
    )
    args = p.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    if args.compile:
        print("train_unconditional.py, the demo config: eager against torch.compile (inductor)")
        compile_figures(max(args.steps, 30))
        return
    if args.official:
        official_ratios(args.official, args.repeats)
        return
    if args.startup:
        print(
            f"{args.script}: {startup_seconds(args.script, args.startup):.1f} s to the first step on {args.startup} images"
        )
        return
    if args.only in (None, "unconditional"):
        print("train_unconditional.py: the demo's UNet (32, 64, 64), 16 px grey digits, batch 16")
        bare = bare_unconditional(16, args.steps)
        report("bare loop", bare, bare)
        common = [
            "--train_data_dir",
            REPO / "data" / "digits",
            "--model_config_name_or_path",
            REPO / "configs" / "unet-digits",
            "--resolution",
            "16",
            "--train_batch_size",
            "16",
            "--save_images_epochs",
            "100000",
            "--ddpm_num_inference_steps",
            "1",
            "--eval_batch_size",
            "1",
        ]
        for name, extra in [
            ("script", []),
            ("script --use_ema", ["--use_ema"]),
            ("script --use_ema --random_flip", ["--use_ema", "--random_flip"]),
        ]:
            report(name, script_img_s("train_unconditional.py", common + extra, args.steps), bare)
    if args.only in (None, "dit"):
        print(
            "train_dit.py: the demo's DiT (6 blocks of width 128, patches of 2), 16 px grey digits with labels, batch 16"
        )
        bare = bare_dit(16, args.steps)
        report("bare loop", bare, bare)
        common = [
            "--train_data_dir",
            REPO / "data" / "digits",
            "--model_config_name_or_path",
            REPO / "configs" / "dit-digits",
            "--resolution",
            "16",
            "--train_batch_size",
            "16",
            "--save_images_epochs",
            "100000",
            "--num_inference_steps",
            "1",
            "--eval_batch_size",
            "1",
        ]
        for name, extra in [("script", []), ("script --use_ema", ["--use_ema"])]:
            report(name, script_img_s("train_dit.py", common + extra, args.steps), bare)
    if args.only in (None, "text_to_image"):
        print("train_text_to_image.py: the tests' tiny SD pipeline, 64 px, batch 4")
        with tempfile.TemporaryDirectory() as tmp:
            Path(tmp, "vocab").mkdir()
            pipeline = build_tiny_sd(Path(tmp, "vocab"), Path(tmp, "sd"))
            data = write_imagefolder(Path(tmp, "data"), 200)
            bare = bare_text_to_image(pipeline, data, 4, args.steps)
            report("bare loop", bare, bare)
            common = [
                "--pretrained_model_name_or_path",
                pipeline,
                "--train_data_dir",
                data,
                "--resolution",
                "64",
                "--train_batch_size",
                "4",
            ]
            for name, extra in [
                ("script", []),
                ("script --use_ema --random_flip", ["--use_ema", "--random_flip"]),
            ]:
                report(
                    name, script_img_s("train_text_to_image.py", common + extra, args.steps), bare
                )


if __name__ == "__main__":
    main()
