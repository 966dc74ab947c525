"""Draw the figures of docs/ from the libraries and from real runs of the README's demos.

    python docs/make_figures.py                # after the README demos, from their output folders
    python docs/make_figures.py --short        # CI: small runs of its own, in a temporary folder

The demos' folders (the README's --output_dir, in the repository's root): ddpm-digits, dit-digits,
data/tiny-sd (data/make_tiny_sd.py), sd-digits and bold-lora; --runs DIR reads them from elsewhere.
Every figure says in its caption which run or library call it came from; nothing is drawn by hand.
"""

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from diffusers import DDPMScheduler  # noqa: E402
from PIL import Image  # noqa: E402
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "docs" / "figures"
DIGITS = REPO / "data" / "digits"
PROMPTS = [f"a handwritten digit {n}" for n in "zero one two three four five six seven eight nine".split()]
SCHEDULES = {  # as diffusers' DDPMScheduler builds them: (beta_schedule, beta_start, beta_end)
    "linear (DDPM; train_unconditional, train_dit)": ("linear", 0.0001, 0.02),
    "scaled_linear (Stable Diffusion 1.x)": ("scaled_linear", 0.00085, 0.012),
    "squaredcos_cap_v2 (cosine, Nichol & Dhariwal)": ("squaredcos_cap_v2", 0.0001, 0.02),
}
FIGURES = ["forward-process.png", "schedules.png", "min-snr-weights.png", "loss-curves.png",
           "unconditional-over-training.png", "dit-over-training.png", "dit-guidance.png", "dit-objectives.png",
           "tiny-vae.png", "buckets.png", "bucket-pairs.png", "held-out.png",
           "text-to-image-over-training.png", "text-to-image-per-digit.png", "lora-before-after.png"]


def caption(fig, text):
    """Under the figure: what it came from (the folder names are the README demos' output_dir)."""
    fig.text(0.01, -0.01, text, fontsize=7, color="0.35", ha="left", va="top", wrap=True)


def digit(name="0003.png", size=16):
    """A digit of data/digits as the scripts see it: RGB in [-1, 1], (1, 3, size, size)."""
    image = Image.open(DIGITS / name).convert("RGB").resize((size, size), Image.BILINEAR)
    return torch.tensor(np.asarray(image), dtype=torch.float32).permute(2, 0, 1)[None] / 127.5 - 1


def forward_process(out):
    """q(x_t | x_0): the closed form that every training step samples (DDPM, eq. 4)."""
    scheduler, x0 = DDPMScheduler(), digit()
    steps = [0, 50, 100, 200, 300, 500, 700, 999]
    noise = torch.randn(x0.shape, generator=torch.Generator().manual_seed(0))
    fig, axes = plt.subplots(1, len(steps), figsize=(len(steps) * 1.2, 1.9))
    for ax, t in zip(axes, steps):
        xt = scheduler.add_noise(x0, noise, torch.tensor([t]))[0]
        ax.imshow(((xt.permute(1, 2, 0) + 1) / 2).clamp(0, 1), interpolation="nearest")
        ax.set_title(f"t = {t}\nᾱ_t = {scheduler.alphas_cumprod[t]:.3f}", fontsize=8)
        ax.axis("off")
    caption(fig, "x_t = √ᾱ_t·x_0 + √(1-ᾱ_t)·ε on data/digits/0003.png (16 px) with one draw of ε; "
                 "DDPMScheduler() (linear β, 1000 steps), add_noise.")
    fig.savefig(out / "forward-process.png", dpi=130, bbox_inches="tight")


def schedules(out):
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.2))
    t = torch.arange(1000)
    for name, (schedule, start, end) in SCHEDULES.items():
        alphas = DDPMScheduler(beta_schedule=schedule, beta_start=start, beta_end=end).alphas_cumprod
        left.plot(t, alphas, label=name)
        right.plot(t, torch.log(alphas / (1 - alphas)), label=name)
    left.set(xlabel="t", ylabel="ᾱ_t (signal kept)", title="ᾱ_t")
    right.set(xlabel="t", ylabel="log SNR(t) = log ᾱ_t/(1-ᾱ_t)", title="log-SNR")
    left.legend(fontsize=7)
    caption(fig, "DDPMScheduler(beta_schedule=...).alphas_cumprod, 1000 steps.")
    fig.savefig(out / "schedules.png", dpi=130, bbox_inches="tight")


def min_snr_weights(out):
    """What --snr_gamma does to each timestep's loss (train_unconditional.min_snr_weights)."""
    sys.path.insert(0, str(REPO))
    from train_unconditional import min_snr_weights as weights

    fig, ax = plt.subplots(figsize=(5.5, 3.2))
    t = torch.arange(1000)
    for prediction_type in ["epsilon", "v_prediction"]:
        scheduler = DDPMScheduler(prediction_type=prediction_type)
        for gamma in [1.0, 5.0]:
            ax.plot(t, weights(scheduler, t, gamma), label=f"{prediction_type}, γ = {gamma:g}")
    ax.set(xlabel="t", ylabel="loss weight", yscale="log", title="Min-SNR-γ weights (Hang et al. 2023)")
    ax.legend(fontsize=7)
    fig.tight_layout()  # the x-label inside the figure, so that the caption goes below it
    caption(fig, "min_snr_weights() of the scripts on DDPMScheduler(): min(SNR, γ)/SNR for ε, "
                 "min(SNR, γ)/(SNR + 1) for v; 1 everywhere without --snr_gamma.")
    fig.savefig(out / "min-snr-weights.png", dpi=130, bbox_inches="tight")


def losses(run):
    """The per-step loss a script logged to TensorBoard (its first project folder)."""
    logs = next(Path(run, "logs").iterdir())
    scalars = EventAccumulator(str(logs)).Reload().Scalars("loss")
    return np.array([s.step for s in scalars]), np.array([s.value for s in scalars])


def loss_curves(runs, out):
    names = {"unconditional": "train_unconditional.py", "dit": "train_dit.py",
             "text_to_image": "train_text_to_image.py", "lora": "train_lora.py"}
    fig, axes = plt.subplots(1, 4, figsize=(13, 2.8))
    for ax, (key, name) in zip(axes, names.items()):
        steps, values = losses(runs[key])
        window = max(1, len(values) // 50)
        smooth = np.convolve(values, np.ones(window) / window, mode="valid")
        ax.plot(steps, values, color="0.8", lw=0.5)
        ax.plot(steps[window - 1 :], smooth)
        ax.set(title=name, xlabel="step", yscale="log")
    axes[0].set_ylabel("loss (‖ε - ε_θ‖², and a moving mean)")
    caption(fig, f"The 'loss' each demo logged to TensorBoard: {', '.join(runs[k].name for k in names)}.")
    fig.savefig(out / "loss-curves.png", dpi=130, bbox_inches="tight")


def grids_over_training(run, out, name, title, crop=None):
    """The validation grids a run saved as output_dir/samples/step-N.png, side by side."""
    files = sorted(Path(run, "samples").glob("step-*.png"), key=lambda p: int(p.stem[5:]))
    files = files if len(files) <= 4 else [files[i] for i in np.linspace(0, len(files) - 1, 4).astype(int)]
    width, height = Image.open(files[0]).size
    fig, axes = plt.subplots(1, len(files), figsize=(3.2 * len(files), 0.6 + 3.2 * height / width), squeeze=False)
    for ax, file in zip(axes[0], files):
        image = Image.open(file)
        ax.imshow(image.crop(crop(image)) if crop else image, interpolation="nearest")
        ax.set_title(f"step {file.stem[5:]}", fontsize=9)
        ax.axis("off")
    fig.suptitle(title, fontsize=10)
    caption(fig, f"{Path(run).name}/samples/step-N.png, the grids the script saved (the same noise each time).")
    fig.savefig(out / name, dpi=130, bbox_inches="tight")


def dit_guidance(runs, out, steps=50):
    sys.path.insert(0, str(REPO))
    from diffusers import DDIMScheduler, DiTTransformer2DModel
    from train_dit import sample_images

    model = DiTTransformer2DModel.from_pretrained(Path(runs["dit"], "transformer")).eval()
    scheduler = DDIMScheduler.from_pretrained(Path(runs["dit"], "scheduler"))
    labels = torch.arange(10).repeat_interleave(4)
    fig, axes = plt.subplots(1, 4, figsize=(8, 5.2))
    for ax, scale in zip(axes, [1, 2, 4, 7]):
        images = sample_images(model, scheduler, labels, scale, steps, generator=torch.manual_seed(0))
        # A row per class, 4 samples each: (class, sample, channel, y, x) -> (class·y, sample·x, channel).
        grid = images.view(10, 4, 3, *images.shape[2:]).permute(0, 3, 1, 4, 2).flatten(2, 3).flatten(0, 1)
        ax.imshow(grid.numpy(), interpolation="nearest")
        ax.set_title(f"guidance s = {scale}", fontsize=9)
        ax.axis("off")
    caption(fig, f"train_dit.sample_images on {runs['dit'].name} (EMA weights), DDIM {steps} steps, the same noise in "
                 "every panel; rows: the classes 0-9 asked for.")
    fig.savefig(out / "dit-guidance.png", dpi=130, bbox_inches="tight")


def dit_objectives(out):
    """ε, v and flow matching against sampling steps: docs/experiments.py dit_objectives's judged numbers."""
    import json

    results = json.loads((REPO / "docs" / "figures" / "dit-objectives.json").read_text())
    real = results.pop("real digits")["distance"]
    names = {"epsilon": "ε", "v_prediction": "v", "flow_prediction": "flow matching"}
    markers = {"epsilon": "o", "v_prediction": "s", "flow_prediction": "^"}
    metrics = [("asked_for", "share drawn as the digit asked for"),
               ("confidence", "judge's p(digit asked for)"),
               ("distance", "distance to the nearest real digit")]  # fmt: skip
    # A row per guidance scale, so that guidance 1 and 4 never share a panel; hollow markers of
    # three shapes, so that lines on the same values (v and flow at 100 %) both show.
    fig, axes = plt.subplots(2, 3, figsize=(12, 5.6), sharex=True, sharey="col")
    for row, scale in enumerate([1.0, 4.0]):
        for ax, (key, label) in zip(axes[row], metrics):
            for color, (objective, name) in enumerate(names.items()):
                rows = [r for r in results.values()
                        if r["objective"] == objective and r["guidance"] == scale]  # fmt: skip
                ax.plot([r["steps"] for r in rows], [r[key] for r in rows], color=f"C{color}",
                        marker=markers[objective], ms=6, mfc="none", label=name)  # fmt: skip
            if key == "distance":
                ax.axhline(real, color="0.5", lw=0.8, label="real digits")
            ax.set(xscale="log", title=f"{label}\nguidance {scale:g}")
            ax.set_xticks([1, 2, 5, 10, 25], ["1", "2", "5", "10", "25"])
    for ax in axes[1]:
        ax.set_xlabel("sampling steps (DPM-Solver++ 2M, trailing)")
    axes[0, 0].set_ylabel("guidance 1 (no guidance)")
    axes[1, 0].set_ylabel("guidance 4")
    fig.tight_layout()
    fig.legend(handles=axes[0, 2].get_lines(), fontsize=8, loc="center left",
               bbox_to_anchor=(1.0, 0.5))  # fmt: skip
    caption(fig, "docs/experiments.py dit_objectives: the DiT digits demo at 20 epochs (2,260 steps) with "
                 "--prediction_type epsilon, v_prediction or flow_prediction; 200 samples (20 a class) judged by the "
                 "guides' SVC; distance: mean L2 on the 8x8 ink grid (0-16) to the nearest of the 1,797 real digits.")
    fig.savefig(out / "dit-objectives.png", dpi=130, bbox_inches="tight")


def tiny_vae(runs, out):
    from diffusers import AutoencoderKL

    vae = AutoencoderKL.from_pretrained(Path(runs["tiny_sd"], "vae")).eval()
    names = [f"{i:04d}.png" for i in range(8)]
    x = torch.cat([digit(name) for name in names])
    with torch.no_grad():
        latents = vae.encode(x).latent_dist.mode()
        again = vae.decode(latents).sample
    rows = [("image x", x), ("VAE decode(encode(x))", again)]
    fig, axes = plt.subplots(2 + 4, 8, figsize=(8, 6.4))
    for r, (label, images) in enumerate(rows):
        for c in range(8):
            axes[r, c].imshow(((images[c].permute(1, 2, 0) + 1) / 2).clamp(0, 1), interpolation="nearest")
    for channel in range(4):
        for c in range(8):
            axes[2 + channel, c].imshow(latents[c, channel], cmap="RdBu", interpolation="nearest")
    for r, label in enumerate(["16 px image", "reconstruction", *[f"latent ch. {i}" for i in range(4)]]):
        axes[r, 0].set_ylabel(label, fontsize=7)
    for ax in axes.flat:
        ax.set_xticks([])
        ax.set_yticks([])
    caption(fig, "data/tiny-sd/vae (data/make_tiny_sd.py) on data/digits/0000-0007.png: 16x16x3 pixels "
                 "-> 8x8x4 latents (the posterior's mode) -> pixels.")
    fig.savefig(out / "tiny-vae.png", dpi=130, bbox_inches="tight")


def buckets(out):
    """--aspect_ratio_buckets auto on a mixed folder: what each picture keeps when trained as a
    square and in its bucket, by train_text_to_image's own open_image, nearest_bucket and
    cover_and_crop, at --resolution 512 in steps of 64 px (SD 1.5's: the VAE's 8 times the UNet's
    8)."""
    import io

    from skimage import data

    sys.path.insert(0, str(REPO))
    import train_text_to_image as script

    args = script.parse_args(["--pretrained_model_name_or_path", "-", "--train_data_dir", "-",
                              "--resolution", "512", "--aspect_ratio_buckets", "auto",
                              "--center_crop"])
    sizes = script.parse_buckets(args, step=64)
    photos = {  # scikit-image's bundled photos, cut to the shapes people keep
        "portrait, 1:2": data.astronaut()[:, 62:318],
        "panorama, 2.5:1": data.stereo_motorcycle()[0][110:406],
        "square, 1:1": np.repeat(data.camera()[..., None], 3, axis=2),
        "landscape, 4:3": data.chelsea()[:, 25:425],
        "phone shot, 9:16": data.rocket()[:, 190:430],
    }
    columns = []
    for name, pixels in photos.items():
        file = io.BytesIO()
        Image.fromarray(pixels).save(file, format="PNG")
        item = {"path": f"{name}.png", "bytes": file.getvalue()}  # as the dataset holds a file
        image = script.open_image(item)
        bucket = sizes[script.nearest_bucket(item, sizes)["bucket"]]
        scale = 512 / np.sqrt(image.width * image.height)  # shown with 512² pixels, as the crops
        shown = image.resize((round(image.width * scale), round(image.height * scale)))
        columns.append([(shown, f"{name}\nfile ({image.height}, {image.width})"),
                        (script.cover_and_crop(image, (512, 512), args), "(512, 512)"),
                        (script.cover_and_crop(image, bucket, args), f"bucket {bucket}")])
    # One canvas in training pixels, so that every crop is drawn at the same scale.
    gap, text = 90, 210
    widths = [max(image.width for image, _ in column) for column in columns]
    heights = [max(column[r][0].height for column in columns) for r in range(3)]
    tops = np.cumsum([0] + [height + text for height in heights])
    fig, ax = plt.subplots(figsize=(11, 7.6))
    left = 0
    for width, column in zip(widths, columns):
        for top, height, (image, label) in zip(tops, heights, column):
            x, y = left + (width - image.width) / 2, top + (height - image.height) / 2
            ax.imshow(image, extent=(x, x + image.width, y + image.height, y))
            ax.text(left + width / 2, top + height + 25, label, ha="center", va="top", fontsize=8)
        left += width + gap
    rows = ["the picture\n(height, width)", "no buckets:\nsquare crop\n--resolution 512",
            "--aspect_ratio_buckets\nauto: its bucket\n(height, width)"]
    for top, height, label in zip(tops, heights, rows):
        ax.text(-gap, top + height / 2, label, ha="right", va="center", fontsize=9)
    ax.set(xlim=(-gap / 2, left - gap / 2), ylim=(tops[-1], -gap / 2), aspect="equal")
    ax.set_title("What training at --resolution 512 keeps of each picture in a mixed folder",
                 fontsize=10)
    ax.axis("off")
    fig.tight_layout()
    by_ratio = sorted(sizes, key=lambda size: size[0] / size[1])
    caption(fig, "train_text_to_image.parse_buckets(--resolution 512 --aspect_ratio_buckets auto, "
                 f"step=64): {len(sizes)} buckets of about 512² pixels, from {by_ratio[0]} to "
                 f"{by_ratio[-1]}; each picture goes to the bucket nearest its aspect ratio "
                 "(nearest_bucket) and is resized to cover it, never stretched, then cropped "
                 "(cover_and_crop, --center_crop; by default the crop is random). Crops of "
                 "skimage.data's astronaut, stereo_motorcycle, camera, chelsea and rocket; "
                 "all panels at one scale, the pictures shown with 512² pixels.")
    fig.savefig(out / "buckets.png", dpi=130, bbox_inches="tight")


def bucket_pairs(out):
    """Two digits side by side, drawn by the models trained with and without buckets:
    docs/experiments.py buckets's samples and judged numbers."""
    import json

    results = json.loads((REPO / "docs" / "figures" / "bucket-pairs.json").read_text())
    fig, axes = plt.subplots(len(results), 10, figsize=(11, 1.1 * len(results) + 0.3))
    for row, (name, result) in zip(axes, results.items()):
        for ax, sample, text in zip(row, result["samples"], result["captions"]):
            ax.imshow(np.array(sample), cmap="gray", vmin=0, vmax=255, interpolation="nearest")
            ax.set_xticks([])
            ax.set_yticks([])
            ax.set_xlabel(" ".join(text.split()[-2:]), fontsize=7)
        row[0].set_ylabel(f"{name}\n{result['halves']:.0%} halves,\n{result['both']:.0%} both", fontsize=7,
                          rotation=0, ha="right", va="center")
    fig.suptitle("'a handwritten digit zero one', 'one two', ...: drawn at 16 x 32", fontsize=9)
    caption(fig, "docs/experiments.py buckets: train_text_to_image.py from data/tiny-sd for 6,000 steps on "
                 "2,000 pairs of digits (data/make_digit_pairs.py), random crops, with and without "
                 "--aspect_ratio_buckets 16,32; DPM-Solver, 25 steps, guidance 3. Read by the guides' SVC: "
                 "of 200 pictures (every ordered pair twice), the share of halves that are the digit named "
                 "for that side, and of pictures with both right.")
    fig.savefig(out / "bucket-pairs.png", dpi=130, bbox_inches="tight")


def held_out(out):
    """Training and held-out loss of a run that overfits, the judge's score and the share of
    copies at some checkpoints, and samples beside their nearest training picture:
    docs/experiments.py held_out's numbers."""
    import json

    results = json.loads((REPO / "docs" / "figures" / "held-out.json").read_text())
    curves, judged = results["curves"], results["judged"]
    best, last = results["best"], results["last"]
    val = dict(zip(curves["step"], curves["val_loss"]))
    fig = plt.figure(figsize=(13, 7.2), layout="constrained")
    top, bottom = fig.subfigures(2, 1, height_ratios=[1, 1.05])
    axes = top.subplots(1, 3)
    ax = axes[0]
    ax.plot(curves["loss_steps"], curves["loss"], color="0.85", lw=0.5, label="loss (each read)")
    ax.plot(curves["step"], curves["train_loss"], color="C0", label="loss, mean since last point")
    ax.plot(curves["step"], curves["val_loss"], color="C1", marker=".", label="val_loss (held out)")
    ax.plot([best], [val[best]], "o", ms=10, mfc="none", color="C3", label=f"lowest: step {best}")
    ax.set(yscale="log", xlabel="step", title="training loss and held-out loss")
    ax.legend(fontsize=7)
    ax = axes[1]
    quarters = ["t < 250 (low noise)", "250 ≤ t < 500", "500 ≤ t < 750", "t ≥ 750 (high noise)"]
    for q, name in enumerate(quarters):
        ax.plot(
            curves["step"], curves[f"val_loss_t{q}"], marker=".", label=f"val_loss_t{q}: {name}"
        )
    ax.axvline(best, color="C3", lw=0.8, ls="--")
    ax.set(yscale="log", xlabel="step", title="held-out loss by quarter of the schedule")
    ax.legend(fontsize=7)
    ax = axes[2]
    rows = sorted(judged.values(), key=lambda r: r["step"])
    steps = [r["step"] for r in rows]
    ax.plot(steps, [r["share"] for r in rows], marker="o", label="judge: samples > 90 % sure")
    ax.plot(steps, [r["copies"] for r in rows], marker="s", label="nearest digit is a training one")
    ax.axhline(results["real"]["copies"], color="0.5", lw=0.8, label="the same, for real digits")
    ax.axvline(best, color="C3", lw=0.8, ls="--")
    ax.set(ylim=(0, 1), xlabel="checkpoint (step)", title="200 DDIM samples of some checkpoints")
    ax.legend(fontsize=7)
    pictures = bottom.subplots(4, 10)
    for pair, step in enumerate([best, last]):
        row = judged[str(step)]
        labels = [f"step {step}\n{'lowest held-out' if step == best else 'last'}\nsamples",
                  "nearest\ntraining\npicture"]  # fmt: skip
        for line, (images, vmax) in enumerate(
            [(row["samples"], 255), (row["nearest_trained"], 16)]
        ):
            for ax, image in zip(pictures[2 * pair + line], images):
                ax.imshow(np.array(image), cmap="gray", vmin=0, vmax=vmax, interpolation="nearest")
                ax.set_xticks([])
                ax.set_yticks([])
            pictures[2 * pair + line, 0].set_ylabel(labels[line], fontsize=7, rotation=0,
                                                     ha="right", va="center")  # fmt: skip
    caption(fig, "docs/experiments.py held_out: train_unconditional.py without EMA on 100 digits "
                 f"(the first 10 of each), --validation_split 0.2 ({results['trained']} train, "
                 f"{results['held_out']} held out), {results['steps']:,} steps, a checkpoint and "
                 f"val_loss every {results['every']}; read from its TensorBoard logs. Samples: "
                 "DDIM, 50 steps, seed 0, judged by the guides' SVC; 'nearest' at 8x8 among the "
                 "1,797 real digits.")  # fmt: skip
    fig.savefig(out / "held-out.png", dpi=130, bbox_inches="tight")


def sd_pipeline(folder):
    """A saved StableDiffusionPipeline with DPM-Solver, as the scripts' validation samples."""
    from diffusers import DPMSolverMultistepScheduler, StableDiffusionPipeline

    pipe = StableDiffusionPipeline.from_pretrained(folder)
    pipe.scheduler = DPMSolverMultistepScheduler.from_config(pipe.scheduler.config)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def text_to_image_per_digit(runs, out):
    sys.path.insert(0, str(REPO / "tests"))
    from test_learning import digit_probabilities  # the demos' judge

    pipe = sd_pipeline(runs["text_to_image"])
    images = pipe(PROMPTS, num_images_per_prompt=20, num_inference_steps=25, guidance_scale=3.0,
                  generator=torch.manual_seed(0), output_type="np").images
    read = digit_probabilities(images).argmax(1).reshape(10, 20) == np.arange(10)[:, None]
    fig, ax = plt.subplots(figsize=(9, 4.3))
    ax.imshow(images.reshape(10, 20, 16, 16, 3).transpose(0, 2, 1, 3, 4).reshape(160, 320, 3),
              interpolation="nearest")
    ax.set_yticks(np.arange(10) * 16 + 7.5, [f"{p.split()[-1]}: {r.mean():.0%}" for p, r in zip(PROMPTS, read)],
                  fontsize=8)
    ax.set_xticks([])
    ax.set_title(f"'a handwritten digit ...', 20 samples a prompt: {read.mean():.1%} read as the digit asked for",
                 fontsize=9)
    caption(fig, f"{runs['text_to_image'].name}, DPM-Solver 25 steps, guidance 3; row labels: the share the "
                 "digits classifier of tests/test_learning.py reads as that digit.")
    fig.savefig(out / "text-to-image-per-digit.png", dpi=130, bbox_inches="tight")


def lora_before_after(runs, out):
    pipe = sd_pipeline(runs["text_to_image"])
    pipe.load_lora_weights(runs["lora"])
    prompts = [p.replace("a handwritten", "a bold handwritten") for p in PROMPTS]
    fig, axes = plt.subplots(1, 2, figsize=(9, 2.3))
    for ax, scale in zip(axes, [0.0, 1.0]):
        images = pipe(prompts, num_images_per_prompt=4, num_inference_steps=25, guidance_scale=3.0,
                      cross_attention_kwargs={"scale": scale}, generator=torch.manual_seed(0),
                      output_type="np").images
        ax.imshow(images.reshape(10, 4, 16, 16, 3).transpose(1, 2, 0, 3, 4).reshape(64, 160, 3),
                  interpolation="nearest")
        ax.set_title(f"LoRA scale {scale:g}" + (" (the base model)" if scale == 0 else ""), fontsize=9)
        ax.axis("off")
    caption(fig, f"{runs['text_to_image'].name} with {runs['lora'].name}/pytorch_lora_weights.safetensors, prompts "
                 "'a bold handwritten digit zero' ... 'nine' (columns), 4 seeds (rows), DPM-Solver 25 steps, "
                 "guidance 3, the same noise in both panels.")
    fig.savefig(out / "lora-before-after.png", dpi=130, bbox_inches="tight")


def short_runs(folder):
    """The README demos at a few steps each, for CI: the same scripts and figures, less training."""
    python = [sys.executable]
    tiny = folder / "tiny-sd"
    commands = [
        [*python, REPO / "train_unconditional.py", "--train_data_dir", DIGITS, "--resolution", "16",
         "--model_config_name_or_path", REPO / "configs" / "unet-digits", "--max_train_steps", "4",
         "--ddpm_num_inference_steps", "2", "--eval_batch_size", "4", "--output_dir", folder / "ddpm-digits"],
        [*python, REPO / "train_dit.py", "--train_data_dir", DIGITS, "--resolution", "16",
         "--model_config_name_or_path", REPO / "configs" / "dit-digits", "--max_train_steps", "4",
         "--use_ema", "--num_inference_steps", "2", "--eval_batch_size", "1", "--output_dir", folder / "dit-digits"],
        [*python, REPO / "data" / "make_tiny_sd.py", "--vae_steps", "5", "--output_dir", tiny],
        [*python, REPO / "train_text_to_image.py", "--pretrained_model_name_or_path", tiny, "--resolution", "16",
         "--train_data_dir", DIGITS, "--max_train_steps", "4", "--train_batch_size", "32",
         "--validation_prompts", *PROMPTS[:2], "--num_inference_steps", "2", "--output_dir", folder / "sd-digits"],
        [*python, REPO / "train_lora.py", "--pretrained_model_name_or_path", folder / "sd-digits",
         "--train_data_dir", REPO / "data" / "bold-digits", "--resolution", "16", "--max_train_steps", "4",
         "--train_batch_size", "32", "--validation_prompts", PROMPTS[0], "--num_inference_steps", "2",
         "--num_validation_images", "1", "--output_dir", folder / "bold-lora"],
    ]
    # The first three need nothing of each other: they run side by side.
    for group in commands[:3], commands[3:4], commands[4:]:
        running = [subprocess.Popen([str(c) for c in command], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
                   for command in group]
        for process, command in zip(running, group):
            output = process.communicate()[0].decode()
            if process.returncode:
                raise SystemExit(f"error: {Path(command[1]).name} failed:\n{output[-3000:]}")
    return {"unconditional": folder / "ddpm-digits", "dit": folder / "dit-digits", "tiny_sd": tiny,
            "text_to_image": folder / "sd-digits", "lora": folder / "bold-lora"}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=Path, default=REPO, help="Where the demos' folders are.")
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--short", action="store_true", help="Small runs of its own (CI).")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as folder:
        if args.short:
            runs = short_runs(Path(folder))
        else:
            runs = {"unconditional": args.runs / "ddpm-digits", "dit": args.runs / "dit-digits",
                    "tiny_sd": args.runs / "data" / "tiny-sd", "text_to_image": args.runs / "sd-digits",
                    "lora": args.runs / "bold-lora"}
        forward_process(args.out)
        schedules(args.out)
        min_snr_weights(args.out)
        loss_curves(runs, args.out)
        grids_over_training(runs["unconditional"], args.out, "unconditional-over-training.png",
                            "train_unconditional.py: 64 samples from the same noise, DDPM (Algorithm 2)")
        grids_over_training(runs["dit"], args.out, "dit-over-training.png",
                            "train_dit.py: a row per class 0-9, guidance 4, DDIM")
        # --short: a few sampling steps of the short run's model.
        dit_guidance(runs, args.out, steps=5 if args.short else 50)
        dit_objectives(args.out)
        tiny_vae(runs, args.out)
        buckets(args.out)
        bucket_pairs(args.out)
        held_out(args.out)
        grids_over_training(runs["text_to_image"], args.out, "text-to-image-over-training.png",
                            "train_text_to_image.py: 'a handwritten digit zero' ... 'nine', guidance 3")
        text_to_image_per_digit(runs, args.out)
        lora_before_after(runs, args.out)
        plt.close("all")
    missing = [name for name in FIGURES if not (args.out / name).exists()]
    if missing:
        raise SystemExit(f"error: not drawn: {missing}")
    print(f"drew {len(FIGURES)} figures in {args.out}")


if __name__ == "__main__":
    main()
