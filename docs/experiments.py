"""Rerun the guides' experiments ("Edit it yourself", guide 4's buckets) and print what they quote.

    python docs/experiments.py unconditional      # 5 runs of 20 epochs, about 15 minutes on 2 cores
    python docs/experiments.py dit                # 3 runs, about 12 minutes
    python docs/experiments.py dit_objectives     # ε, v and flow: 3 runs, about 15 minutes
    python docs/experiments.py text_to_image     # needs data/tiny-sd and the README's sd-digits
    python docs/experiments.py lora               # needs sd-digits
    python docs/experiments.py buckets            # needs data/tiny-sd; 2 runs, about 30 minutes
    python docs/experiments.py held_out           # 1 run of 6,000 steps, 6 short ones: 12 minutes

Each experiment is the README demo's command with one flag changed (and, for the first two
guides, a third of the epochs, against a baseline of the same length); `buckets` is guide 4's
bucket demo, two runs on pictures of two digits, with and without --aspect_ratio_buckets. All are
judged as tests/test_learning.py judges the demos: an SVC trained on the 8x8 digits reads the
samples.
"""

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO))
from test_learning import digit_probabilities, judge  # noqa: E402  the demos' judge

DIGITS = REPO / "data" / "digits"
NAMES = "zero one two three four five six seven eight nine".split()


def train(script, args, out):
    # All the cores, unless OMP_NUM_THREADS says otherwise (1 on a machine shared with others).
    threads = os.environ.get("OMP_NUM_THREADS") or str(os.cpu_count())
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": threads}
    subprocess.run([sys.executable, REPO / script, *map(str, args), "--output_dir", out], check=True, env=env,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return out


def unconditional(folder):
    from diffusers import DDIMPipeline, DDIMScheduler, DDPMPipeline

    demo = ["--train_data_dir", DIGITS, "--resolution", "16", "--model_config_name_or_path",
            REPO / "configs" / "unet-digits", "--train_batch_size", "16", "--learning_rate", "1e-3",
            "--lr_warmup_steps", "100", "--use_ema", "--ema_max_decay", "0.999", "--seed", "0",
            "--num_epochs", "20", "--save_images_epochs", "100", "--logger", "none"]
    runs = {"baseline (20 epochs)": demo, "--prediction_type v_prediction": [*demo, "--prediction_type", "v_prediction"],
            "--snr_gamma 5": [*demo, "--snr_gamma", "5"],
            "--ddpm_beta_schedule squaredcos_cap_v2": [*demo, "--ddpm_beta_schedule", "squaredcos_cap_v2"],
            "without --use_ema": [a for a in demo if a != "--use_ema"]}
    for name, args in runs.items():
        pipe = DDPMPipeline.from_pretrained(train("train_unconditional.py", args, folder / name.replace(" ", "_")))
        sampler = DDIMPipeline(unet=pipe.unet, scheduler=DDIMScheduler.from_config(pipe.scheduler.config))
        sampler.set_progress_bar_config(disable=True)
        images = sampler(batch_size=200, num_inference_steps=50, generator=torch.manual_seed(0),
                         output_type="np").images
        share, histogram, confidence = judge(images)
        print(f"{name}: {share:.0%} of 200 samples classified with confidence > 0.9, digits seen "
              f"{int((histogram > 0).sum())}/10, mean confidence {confidence:.2f}", flush=True)


def agreement(images, labels):
    return (digit_probabilities(images).argmax(1) == np.asarray(labels)).mean()


def dit_demo():
    """The README's DiT demo at 20 epochs, without its sample grids: the runs both DiT experiments compare."""
    return ["--train_data_dir", DIGITS, "--resolution", "16", "--model_config_name_or_path",
            REPO / "configs" / "dit-digits", "--train_batch_size", "16", "--learning_rate", "5e-4",
            "--lr_scheduler", "constant_with_warmup", "--lr_warmup_steps", "100", "--use_ema",
            "--ema_max_decay", "0.999", "--seed", "0", "--num_epochs", "20", "--save_images_epochs", "100",
            "--logger", "none"]


def dit(folder):
    from diffusers import DDIMScheduler, DiTTransformer2DModel
    from train_dit import sample_images

    demo = dit_demo()
    runs = {"baseline (20 epochs)": [], "--class_dropout_prob 0": ["--class_dropout_prob", "0"],
            "--snr_gamma 5": ["--snr_gamma", "5"]}
    labels = torch.arange(10).repeat_interleave(20)
    for name, change in runs.items():
        out = train("train_dit.py", demo + change, folder / name.replace(" ", "_"))
        model = DiTTransformer2DModel.from_pretrained(out / "transformer").eval()
        scheduler = DDIMScheduler.from_pretrained(out / "scheduler")
        shares = []
        for scale in [1.0, 4.0]:
            images = sample_images(model, scheduler, labels, scale, 50, generator=torch.manual_seed(0))
            shares.append(agreement(images.permute(0, 2, 3, 1).numpy(), labels))
        print(f"{name}: the digit asked for in {shares[0]:.0%} of 200 samples at guidance 1, {shares[1]:.0%} "
              "at guidance 4", flush=True)


SAMPLING_STEPS = [1, 2, 5, 10, 25]


def real_digits():
    """The 1,797 8x8 digits of scikit-learn on the judge's 0..16 ink scale, and their labels."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    return torch.tensor(digits.data, dtype=torch.float32), torch.tensor(digits.target)


def distance_to_real(images):
    """Fidelity: the mean distance (8x8 ink, 0..16) from each sample to its nearest real digit."""
    gray = images.mean(1, keepdim=True)
    small = torch.nn.functional.interpolate(gray, size=(8, 8), mode="area").flatten(1) * 16
    return torch.cdist(small, real_digits()[0]).min(1).values.mean().item()


def judge_objectives(models, per_class=20):
    """Each model sampled by the same solver, DPM-Solver++ (2M), at each number of steps and at guidance 1
    and 4: the share of samples the judge reads as the digit asked for, its mean probability for that
    digit, and the distance to real digits. models: {name: (transformer, its training noise schedule)}."""
    from diffusers import DPMSolverMultistepScheduler
    from train_dit import sample_images

    labels = torch.arange(10).repeat_interleave(per_class)
    results = {}
    for name, (model, schedule) in models.items():
        # Every solver's first step at the noisiest t: "trailing" spacing (Lin et al. 2024) for ε and v,
        # whose saved DDIM config says "leading"; flow's σs ignore the spacing and start at 0.999.
        solver = DPMSolverMultistepScheduler.from_config(schedule.config, timestep_spacing="trailing")
        for scale in [1.0, 4.0]:
            for steps in SAMPLING_STEPS:
                images = sample_images(model, solver, labels, scale, steps, generator=torch.manual_seed(0))
                proba = digit_probabilities(images.permute(0, 2, 3, 1).numpy())
                results[f"{name}, guidance {scale:g}, {steps} steps"] = {
                    "objective": name, "guidance": scale, "steps": steps,
                    "asked_for": float((proba.argmax(1) == labels.numpy()).mean()),
                    "confidence": float(proba[np.arange(len(labels)), labels.numpy()].mean()),
                    "distance": distance_to_real(images)}
                row = results[f"{name}, guidance {scale:g}, {steps} steps"]
                print(f"{name}, guidance {scale:g}, {steps:2d} steps: the digit asked for in {row['asked_for']:.0%}, "
                      f"p(asked for) {row['confidence']:.2f}, distance to real digits {row['distance']:.1f}",
                      flush=True)
    return results


def dit_objectives(folder):
    """ε, v and flow matching at equal training steps (the DiT demo at 20 epochs, 2,260 steps)."""
    import json

    from diffusers import DiTTransformer2DModel, DPMSolverMultistepScheduler

    demo = dit_demo()
    models = {}
    for name in ["epsilon", "v_prediction", "flow_prediction"]:
        out = train("train_dit.py", demo + ["--prediction_type", name], folder / name)
        model = DiTTransformer2DModel.from_pretrained(out / "transformer").eval()
        models[name] = (model, DPMSolverMultistepScheduler.from_pretrained(out / "scheduler"))
    results = judge_objectives(models)
    reference = real_digits()[0][:200]
    results["real digits"] = {"distance": torch.cdist(reference, real_digits()[0][200:]).min(1).values.mean().item()}
    (REPO / "docs" / "figures" / "dit-objectives.json").write_text(json.dumps(results, indent=1) + "\n")


def load(folder):
    from diffusers import DPMSolverMultistepScheduler, StableDiffusionPipeline

    pipe = StableDiffusionPipeline.from_pretrained(folder)
    pipe.scheduler = DPMSolverMultistepScheduler.from_config(pipe.scheduler.config)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def asked_for(pipe, guidance_scale, prompts=None, **kwargs):
    prompts = prompts or [f"a handwritten digit {n}" for n in NAMES]
    images = pipe(prompts, num_images_per_prompt=20, num_inference_steps=25, guidance_scale=guidance_scale,
                  generator=torch.manual_seed(0), output_type="np", **kwargs).images
    return agreement(images, np.arange(10).repeat(20)), images


def text_to_image(folder):
    pipe = load(REPO / "sd-digits")
    for scale in [1.0, 2.0, 3.0, 5.0, 7.5]:
        print(f"sd-digits, guidance {scale:g}: the digit asked for in {asked_for(pipe, scale)[0]:.0%} of 200",
              flush=True)
    demo = ["--pretrained_model_name_or_path", REPO / "data" / "tiny-sd", "--train_data_dir", DIGITS,
            "--resolution", "16", "--center_crop", "--cache_latents", "--train_batch_size", "32",
            "--learning_rate", "1e-3", "--lr_scheduler", "cosine", "--lr_warmup_steps", "100",
            "--caption_dropout_rate", "0.1", "--max_train_steps", "1000", "--report_to", "none"]
    runs = {"baseline (1000 steps)": [], "--caption_dropout_rate 0": ["--caption_dropout_rate", "0"],
            "--prediction_type v_prediction": ["--prediction_type", "v_prediction"]}
    for name, change in runs.items():
        pipe = load(train("train_text_to_image.py", demo + change, folder / name.replace(" ", "_")))
        shares = [asked_for(pipe, scale)[0] for scale in (1.0, 3.0)]
        print(f"{name}: the digit asked for in {shares[0]:.0%} of 200 at guidance 1, {shares[1]:.0%} at 3",
              flush=True)


def lora(folder):
    sys.path.insert(0, str(REPO / "data"))
    from make_bold_digits import ink

    bold = [f"a bold handwritten digit {n}" for n in NAMES]
    demo = ["--pretrained_model_name_or_path", REPO / "sd-digits", "--train_data_dir", REPO / "data" / "bold-digits",
            "--resolution", "16", "--center_crop", "--cache_latents", "--train_batch_size", "32",
            "--learning_rate", "1e-3", "--lr_warmup_steps", "0", "--rank", "4", "--max_train_steps", "500",
            "--report_to", "none"]
    base = load(REPO / "sd-digits")
    share, images = asked_for(base, 3.0, bold)
    print(f"no LoRA: ink {ink(images).mean():.3f}, the digit asked for in {share:.0%}", flush=True)
    runs = {"the demo (rank 4)": [], "--rank 1": ["--rank", "1"], "--rank 16": ["--rank", "16"],
            "--lora_target_modules with kohya's set": ["--lora_target_modules",
                                                       "to_q,to_k,to_v,to_out.0,proj_in,proj_out,ff.net.0.proj,ff.net.2"]}
    for name, change in runs.items():
        out = train("train_lora.py", demo + change, folder / name.replace(" ", "_"))
        pipe = load(REPO / "sd-digits")
        pipe.load_lora_weights(out)
        size = os.path.getsize(out / "pytorch_lora_weights.safetensors")
        scales = [1.0] + ([0.5] if not change else [])
        for scale in scales:
            share, images = asked_for(pipe, 3.0, bold, cross_attention_kwargs={"scale": scale})
            print(f"{name}, LoRA scale {scale:g}: ink {ink(images).mean():.3f}, the digit asked for in "
                  f"{share:.0%} ({size / 1e3:.0f} kB file)", flush=True)


def judge_pairs(pipe, caption):
    """Draw every ordered pair of digits twice at 16 x 32 (200 pictures, 400 halves) and read each half."""
    left, right = np.arange(10).repeat(20), np.tile(np.arange(10).repeat(2), 10)
    prompts = [caption(a, b) for a, b in zip(left[::2], right[::2])]
    images = pipe(prompts, num_images_per_prompt=2, height=16, width=32, num_inference_steps=25, guidance_scale=3.0,
                  generator=torch.manual_seed(0), output_type="np").images
    read_left = digit_probabilities(images[:, :, :16]).argmax(1) == left
    read_right = digit_probabilities(images[:, :, 16:]).argmax(1) == right
    # For the figure: the first picture of "zero one", "one two", ..., "nine zero"
    shown = [np.flatnonzero((left == a) & (right == (a + 1) % 10))[0] for a in range(10)]
    grey = np.round(images[shown].mean(-1) * 255).astype(int)
    return {"halves": (read_left.mean() + read_right.mean()) / 2, "both": (read_left & read_right).mean(),
            "captions": [prompts[i // 2] for i in shown], "samples": grey.tolist()}


def buckets(folder):
    """Two digits side by side (data/make_digit_pairs.py), 16 x 32 px, trained with and without
    --aspect_ratio_buckets 16,32 and drawn at 16 x 32: the classifier reads each half. Writes the
    figures and samples to docs/figures/bucket-pairs.json, for docs/make_figures.py."""
    import json

    sys.path.insert(0, str(REPO / "data"))
    from make_digit_pairs import caption
    from make_digit_pairs import main as make_pairs

    make_pairs(["--output_dir", str(folder / "pairs")])
    demo = ["--pretrained_model_name_or_path", REPO / "data" / "tiny-sd", "--train_data_dir", folder / "pairs" / "train",
            "--resolution", "16", "--train_batch_size", "32", "--learning_rate", "1e-3", "--lr_scheduler", "cosine",
            "--lr_warmup_steps", "100", "--caption_dropout_rate", "0.1", "--max_train_steps", "6000",
            "--checkpointing_steps", "10000", "--report_to", "none"]
    runs = {"square crops (no flag)": [], "--aspect_ratio_buckets 16,32": ["--aspect_ratio_buckets", "16,32"]}
    results = {}
    for name, change in runs.items():
        out = train("train_text_to_image.py", demo + change, folder / ("buckets" if change else "square"))
        results[name] = judge_pairs(load(out), caption)
        print(f"{name}: drawn at 16 x 32, {results[name]['halves']:.0%} of 400 halves are the digit asked for on "
              f"that side, both halves in {results[name]['both']:.0%} of 200", flush=True)
    (REPO / "docs" / "figures" / "bucket-pairs.json").write_text(json.dumps(results) + "\n")


def ink(images):
    """Samples (N, H, W, channels) in [0, 1] as the judge sees them: 8x8, the 0..16 ink scale."""
    gray = torch.as_tensor(np.asarray(images), dtype=torch.float32).mean(-1)[:, None]
    return torch.nn.functional.interpolate(gray, size=(8, 8), mode="area").flatten(1) * 16


def tensorboard_scalars(run):
    """Every scalar a run logged to TensorBoard under <run>/logs: {tag: {step: value}}."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    scalars = {}
    for events in sorted(Path(run, "logs").glob("**/events.out.tfevents.*")):
        accumulator = EventAccumulator(str(events))
        accumulator.Reload()
        for tag in accumulator.Tags()["scalars"]:
            scalars.setdefault(tag, {}).update({e.step: e.value for e in accumulator.Scalars(tag)})
    return scalars


HELD_OUT_STEPS, HELD_OUT_EVERY, HELD_OUT_JUDGED = 6000, 250, [2000, 4000]


def held_out(folder):
    """Does the held-out loss pick the better checkpoint? train_unconditional.py without EMA on
    100 digits (the first 10 of each), --validation_split 0.2 (80 train, 20 held out), for 6,000
    steps (1,200 epochs) with a checkpoint and a held-out loss every 250. The checkpoint of the
    lowest held-out loss, the last one and every 2,000th draw 200 DDIM samples each: the judge's
    score, and how many copy a training picture (their nearest of the 1,797 real digits, at 8x8,
    is one of the 80). Then the cost: the README demo's training for 500 steps (no sample grids)
    with and without --validation_split 0.1, 3 times each, alternating. Writes
    docs/figures/held-out.json for docs/make_figures.py and guide 2. 12 minutes in all (7 of them
    training) with OMP_NUM_THREADS=1 on 2 cores that other work shared (an earlier run there, with
    2 threads, the default, ran 4.5 times slower than with 1)."""
    import json
    import resource
    import shutil
    import time

    from diffusers import DDIMPipeline, DDIMScheduler, DDPMScheduler, UNet2DModel

    from train_unconditional import load_datasets, parse_args

    # The first 10 pictures of each digit, an imagefolder in data/digits' format.
    subset, rows, per_digit = folder / "subset", [], {}
    subset.mkdir()
    for line in (DIGITS / "metadata.jsonl").read_text().splitlines():
        row = json.loads(line)
        if per_digit.setdefault(row["label"], 0) < 10:
            per_digit[row["label"]] += 1
            rows.append(line + "\n")
            shutil.copy(DIGITS / row["file_name"], subset)
    (subset / "metadata.jsonl").write_text("".join(rows))
    split = ["--train_data_dir", subset, "--validation_split", "0.2", "--seed", "0"]
    # Which of the 1,797 digits trained: the script's own split (file NNNN.png is digit NNNN).
    splits = load_datasets(parse_args(list(map(str, split))), "image")
    trained = [int(Path(image["path"]).stem) for image in splits["train"]["image"]]
    digits = real_digits()[0]
    is_trained = torch.zeros(len(digits), dtype=torch.bool)
    is_trained[trained] = True

    def copies(points, itself=None):
        """Share of points whose nearest real digit trained; mean distance to the nearest training
        picture and to the nearest other digit (8x8 ink); itself: each real point's own index."""
        distances = torch.cdist(points, digits)
        if itself is not None:
            distances[torch.arange(len(points)), itself] = float("inf")
        to_trained = distances[:, is_trained].min(1).values
        to_other = distances[:, ~is_trained].min(1).values
        return {
            "copies": (to_trained < to_other).float().mean().item(),
            "to_trained": to_trained.mean().item(),
            "to_other": to_other.mean().item(),
        }

    # The real digits that never trained: how often a new digit's nearest is one of the 80.
    others = torch.nonzero(~is_trained).flatten()
    results = {
        "trained": len(trained),
        "held_out": len(splits["validation"]),
        "steps": HELD_OUT_STEPS,
        "every": HELD_OUT_EVERY,
        "real": copies(digits[others], itself=others),
    }

    unet_config = REPO / "configs" / "unet-digits"
    flags = "--logger tensorboard --resolution 16 --train_batch_size 16 --learning_rate 1e-3"
    flags += " --lr_warmup_steps 100"
    flags += f" --max_train_steps {HELD_OUT_STEPS} --checkpointing_steps {HELD_OUT_EVERY}"
    # No sample grids but the one the last epoch always draws, a small one.
    flags += " --save_images_epochs 100000 --save_model_epochs 100000 --ddpm_num_inference_steps 10"
    flags += " --eval_batch_size 4"
    args = [*split, "--model_config_name_or_path", unet_config, *flags.split()]
    start = time.perf_counter()
    out = train("train_unconditional.py", args, folder / "run")
    print(f"trained {HELD_OUT_STEPS} steps in {time.perf_counter() - start:.0f} s", flush=True)
    scalars = tensorboard_scalars(out)
    steps = sorted(scalars["val_loss"])
    # The training loss of each checkpoint: the mean of the reads since the one before.
    loss = scalars["loss"]
    window = [
        np.mean([v for s, v in loss.items() if step - HELD_OUT_EVERY < s <= step]) for step in steps
    ]
    results["curves"] = {
        "step": steps,
        "train_loss": window,
        "val_loss": [scalars["val_loss"][s] for s in steps],
        **{f"val_loss_t{q}": [scalars[f"val_loss_t{q}"][s] for s in steps] for q in range(4)},
        "loss_steps": sorted(loss),
        "loss": [loss[s] for s in sorted(loss)],
    }
    best = min(steps, key=scalars["val_loss"].get)
    results["best"], results["last"] = best, steps[-1]
    print(
        f"lowest held-out loss {scalars['val_loss'][best]:.4f} at step {best}; "
        f"{scalars['val_loss'][steps[-1]]:.4f} at the last, {steps[-1]}",
        flush=True,
    )

    config = DDPMScheduler.from_pretrained(out, subfolder="scheduler").config
    results["judged"] = {}
    for step in sorted({best, steps[-1], *HELD_OUT_JUDGED}):
        unet = UNet2DModel.from_pretrained(out / f"checkpoint-{step}" / "unet").eval()
        sampler = DDIMPipeline(unet=unet, scheduler=DDIMScheduler.from_config(config))
        sampler.set_progress_bar_config(disable=True)
        images = sampler(
            batch_size=200, num_inference_steps=50, generator=torch.manual_seed(0), output_type="np"
        ).images
        share, histogram, confidence = judge(images)
        row = {
            "step": step,
            "val_loss": scalars["val_loss"][step],
            "share": float(share),
            "digits_seen": int((histogram > 0).sum()),
            "confidence": float(confidence),
            **copies(ink(images)),
        }
        # For the figure: the first 10 samples, and each one's nearest training picture.
        nearest = torch.cdist(ink(images[:10]), digits[is_trained]).argmin(1)
        row["samples"] = np.round(images[:10].mean(-1) * 255).astype(int).tolist()
        row["nearest_trained"] = digits[is_trained][nearest].reshape(-1, 8, 8).int().tolist()
        results["judged"][str(step)] = row
        print(
            f"step {step}: held-out loss {row['val_loss']:.4f}, {share:.0%} of 200 samples > 0.9 "
            f"sure, digits seen {row['digits_seen']}/10, mean confidence {confidence:.2f}; "
            f"{row['copies']:.0%} nearest to a training picture",
            flush=True,
        )

    saved = REPO / "docs" / "figures" / "held-out.json"
    saved.write_text(json.dumps(results, indent=1) + "\n")

    # The cost: the README demo's training, 500 steps, without and with --validation_split 0.1.
    flags = "--resolution 16 --train_batch_size 16 --learning_rate 1e-3 --lr_warmup_steps 100"
    flags += " --use_ema --ema_max_decay 0.999 --max_train_steps 500"
    # Its sample grids left out: none but the last epoch's, 1 picture in 1 step.
    flags += " --save_images_epochs 100000 --ddpm_num_inference_steps 1 --eval_batch_size 1"
    demo = ["--train_data_dir", DIGITS, "--model_config_name_or_path", unet_config, *flags.split()]
    # Wall-clock seconds, and CPU seconds (less moved by whatever else shares the machine).
    seconds = {"without": [], "with": []}
    cpu = {"without": [], "with": []}
    for i, name in enumerate(["without", "with"] * 3):
        start, used = time.perf_counter(), resource.getrusage(resource.RUSAGE_CHILDREN)
        held = ["--validation_split", "0.1"] if name == "with" else []
        train("train_unconditional.py", demo + held, folder / f"cost-{i}")
        now = resource.getrusage(resource.RUSAGE_CHILDREN)
        seconds[name].append(time.perf_counter() - start)
        cpu[name].append(now.ru_utime + now.ru_stime - used.ru_utime - used.ru_stime)
    results["cost"] = {
        "steps": 500,
        "ratio": sum(seconds["with"]) / sum(seconds["without"]),
        "cpu_ratio": sum(cpu["with"]) / sum(cpu["without"]),
        "pairs": [w / o for o, w in zip(seconds["without"], seconds["with"])],
        "cpu_pairs": [w / o for o, w in zip(cpu["without"], cpu["with"])],
    }
    print(
        f"500 demo steps with --validation_split 0.1 take {results['cost']['ratio']:.3f}x the "
        f"time without, {results['cost']['cpu_ratio']:.3f}x the CPU time ({results['cost']})",
        flush=True,
    )
    saved.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "guide",
        choices=[
            "unconditional",
            "dit",
            "dit_objectives",
            "text_to_image",
            "lora",
            "buckets",
            "held_out",
        ],
    )
    guide = parser.parse_args().guide
    with tempfile.TemporaryDirectory() as folder:
        globals()[guide](Path(folder))
