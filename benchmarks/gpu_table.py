#!/usr/bin/env python
"""Speed, memory and FLOP utilisation of our training scripts and the Diffusers examples on a GPU.

One Markdown table, on one GPU (or at a tiny size on a CPU):

    python benchmarks/gpu_table.py                                  # the whole table (a GPU)
    python benchmarks/gpu_table.py --only lora --batch 4 --flags default cache+compile
    python benchmarks/gpu_table.py --rows 'dit-b2:*' 'sd:*:b4:*'    # row ids, shell-style patterns
    python benchmarks/gpu_table.py --dry_run                        # the row ids and commands only
    python benchmarks/gpu_table.py --tiny --only lora --batch 1 --steps 4   # a CPU, seconds a row

Models, all with random weights (the real compute; nothing is downloaded): Stable Diffusion 1.5's
UNet, VAE and CLIP ViT-L/14 text encoder built from their published configs and saved once as a
StableDiffusionPipeline folder under --work_dir; 512 px photos from scikit-image with captions.
DiT-B/2 and DiT-XL/2 (configs written here, as configs/dit-b-2 in the repo) train at 256 px in that
VAE's latent space (32 x 32 x 4) on cached latents. --tiny: the tests' tiny pipeline
(tests/conftest.py build_tiny_sd), 64 px, fp32, and DiT-S/2 for the DiT rows.

Each script runs as its own process through benchmarks/_timed.py, which records the time of every
optimizer step (a global step post-hook) and the peak GPU memory, the same way for our scripts and
the reference ones, independent of what they log:
    it/s      1 / the median step duration, skipping the first --warmup steps (compilation,
              cuDNN autotuning, allocator growth). A step's duration is the time between the ends
              of two consecutive optimizer steps: data loading, encoders, forward, backward, step.
    img/s     it/s x batch (one process).
    peak GiB  torch.cuda.max_memory_allocated() over the whole run, in GiB (2**30 bytes).
    TFLOP/s   the FLOPs of one training step / the median step duration. The FLOPs are counted
              here, once per model, batch and flags, by torch.utils.flop_counter.FlopCounterMode on
              copies of the models built on the meta device (no memory, no compute): forward and
              backward of the trained model (the UNet; for LoRA the UNet with a rank-4 peft adapter
              on to_q, to_k, to_v, to_out.0, whose frozen weights still cost the backward's
              activation gradients; the DiT), the recomputed forwards under gradient
              checkpointing, and the forwards of the frozen VAE encoder and text encoder when
              they run in the step (the VAE not with cached latents). Optimizer FLOPs are left out.
    MFU       TFLOP/s / the GPU's dense bf16 peak (PEAK_TFLOPS below, or --peak_tflops).
    ours/ref  our img/s over the reference's at the same model, batch and flags; for flags the
              reference lacks, over the reference's default row (marked "vs default").

The largest DiT batch is searched by trying: powers of two in a bare training step of the same
model (bf16 autocast, AdamW) in a separate process until one runs out of memory; if the script
itself then runs out of memory at that batch, it is halved. The table says which batch was used.
"""

# The flags passed to each script (--tiny: --resolution 64, --mixed_precision no):
#   Every Stable Diffusion row, ours and reference alike (train_text_to_image.py against the
#   reference train_text_to_image.py, train_lora.py against train_text_to_image_lora.py):
#     --pretrained_model_name_or_path <work_dir>/sd15 --train_data_dir <work_dir>/photos-512-64
#     --resolution 512 --center_crop --train_batch_size B --max_train_steps STEPS
#     --mixed_precision bf16 --output_dir <a temporary folder> --checkpointing_steps 1000000
#     --seed 0 --dataloader_num_workers 0
#   (no --report_to: both log to TensorBoard, their default, since the reference refuses "none";
#   no validation prompt: neither samples images then)
#   LoRA rows also:                    --rank 4
#   + grad checkpointing:              --gradient_checkpointing
#   + 8-bit Adam (a GPU only):         --use_8bit_adam
#   + cached latents (ours only):      --cache_latents
#   + compile (ours only):             ACCELERATE_DYNAMO_BACKEND=INDUCTOR in the environment, as
#                                      `accelerate launch --dynamo_backend inductor` sets it
#                                      (every other row: ACCELERATE_DYNAMO_BACKEND=NO)
#   DiT rows (ours only, train_dit.py):
#     --model_config_name_or_path <work_dir>/dit-configs/DiT-B-2 (DiT-XL-2; --tiny: DiT-S-2, the
#     paper's sizes written here) --train_data_dir <work_dir>/photos-256-N
#     --pretrained_vae_model_name_or_path <work_dir>/sd15/vae --cache_latents
#     --center_crop --resolution 256 --train_batch_size B --max_train_steps STEPS
#     --mixed_precision bf16 --output_dir <a temporary folder> --logger none
#     --checkpointing_steps 1000000 --seed 0 --save_images_epochs 1000000
#     --eval_batch_size 1 --num_inference_steps 1 --dataloader_num_workers 4 (--tiny: 0)
#   (train_dit.py samples after epoch 0 and at the end, whatever --save_images_epochs says: the
#   last two flags make that one image per class in one step, and the data is --warmup - 1
#   batches, so that epoch 0 ends before the timed steps)

import argparse
import fnmatch
import itertools
import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from functools import cache
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))
from conftest import build_tiny_sd, clip_tokenizer  # noqa: E402  the tests' offline helpers

TIMED = REPO / "benchmarks" / "_timed.py"
OURS = {"sd": "train_text_to_image.py", "lora": "train_lora.py", "dit": "train_dit.py"}
REFERENCE = {"sd": "train_text_to_image.py", "lora": "train_text_to_image_lora.py"}
# Where the unmodified Diffusers examples are looked for, unless --reference_dir says.
REFERENCE_DIRS = [
    REPO / "shared/reference/diffusers_examples",
    REPO.parent / "shared/reference/diffusers_examples",
]

# Dense bf16 tensor-core peaks from the datasheets (no sparsity), TFLOP/s. The first key found in
# torch.cuda.get_device_name() wins, so the longer names come first: an H100 SXM calls itself
# "NVIDIA H100 80GB HBM3", a PCIe card "NVIDIA H100 PCIe".
PEAK_TFLOPS = {
    "H100 NVL": 835,
    "H100 PCIe": 756,
    "H100": 989,
    "H200 NVL": 835,
    "H200": 989,
    "GH200": 989,
    "B200": 2250,
    "A100": 312,
    "A10G": 70,
    "L40S": 362,
    "L4": 121,
}

# Stable Diffusion 1.5's published configs (runwayml/stable-diffusion-v1-5): what diffusers'
# defaults do not already say.
SD15_UNET = dict(
    block_out_channels=(320, 640, 1280, 1280),
    layers_per_block=2,
    cross_attention_dim=768,
    attention_head_dim=8,
    sample_size=64,
)
SD15_VAE = dict(
    block_out_channels=(128, 256, 512, 512),
    layers_per_block=2,
    latent_channels=4,
    down_block_types=("DownEncoderBlock2D",) * 4,
    up_block_types=("UpDecoderBlock2D",) * 4,
    sample_size=512,
    scaling_factor=0.18215,
)
CLIP_VIT_L14 = dict(
    hidden_size=768,
    num_hidden_layers=12,
    num_attention_heads=12,
    intermediate_size=3072,
    max_position_embeddings=77,
    vocab_size=49408,
    hidden_act="quick_gelu",
    projection_dim=768,
)
NEVER = 1_000_000  # a step or epoch interval that never comes: no checkpoint, no sample
TEXT_TOKENS = 77  # captions are padded to the tokenizer's model_max_length
LORA_TARGETS = ["to_q", "to_k", "to_v", "to_out.0"]
# DiT sizes (depth, heads, head width), as in configs/dit-b-2 and configs/dit-xl-2; patch size 2.
DIT_SIZES = {"S": (12, 6, 64), "B": (12, 12, 64), "L": (24, 16, 64), "XL": (28, 16, 72)}

# The flag sets: the table's name for each, the script flags, whether it compiles.
FLAG_SETS = {
    "default": ("default", [], False),
    "gc": ("+grad ckpt", ["--gradient_checkpointing"], False),
    "8bit": ("+8-bit Adam", ["--use_8bit_adam"], False),
    "cache": ("+cached latents", ["--cache_latents"], False),
    "compile": ("+compile", [], True),
    "cache+compile": ("+cached latents +compile", ["--cache_latents"], True),
}
OURS_ONLY = {
    "cache": "the reference has no --cache_latents",
    "compile": "compile: ours only",
    "cache+compile": "the reference has no --cache_latents",
}
# scikit-image's bundled photos (no download), with a caption each.
PHOTOS = {
    "astronaut": "a photo of an astronaut",
    "coffee": "a cup of coffee on a table",
    "chelsea": "a photo of a cat",
    "rocket": "a rocket on its launch pad",
    "hubble_deep_field": "galaxies in the deep sky",
    "retina": "a photo of a retina",
    "immunohistochemistry": "a stained tissue sample",
    "camera": "a man with a camera",
    "coins": "old coins on a table",
    "moon": "the surface of the moon",
    "grass": "a patch of grass",
    "gravel": "a close up of gravel",
    "brick": "a brick wall",
    "clock": "a clock on a wall",
    "colorwheel": "a colour wheel",
}


COLUMNS = [
    "script",
    "model",
    "batch",
    "flags",
    "it/s",
    "img/s",
    "peak GiB",
    "TFLOP/s",
    "MFU",
    "ours/ref",
]


@dataclass
class Row:
    model: str  # "sd", "lora" or "dit-b2" ...
    script: str  # "ours" or "reference"
    batch: int
    flags: str  # a FLAG_SETS key
    skip: str = ""  # why the row is not run
    result: dict = field(default_factory=dict)
    step_s: list = field(default_factory=list)  # the median step of each --repeat

    @property
    def id(self):
        return f"{self.model}:{self.script}:b{self.batch}:{self.flags}"


# ----------------------------------------------------------------------------- models and data


def build_sd15(path):
    """A Stable Diffusion 1.5-shaped pipeline folder with random weights. The tokenizer is the
    tests' small byte-level one: the text encoder's compute does not depend on its vocabulary."""
    import torch
    from diffusers import (
        AutoencoderKL,
        DDPMScheduler,
        StableDiffusionPipeline,
        UNet2DConditionModel,
    )
    from transformers import CLIPTextConfig, CLIPTextModel

    with tempfile.TemporaryDirectory() as vocab:  # the pipeline saves its own copy
        tokenizer = clip_tokenizer(vocab, TEXT_TOKENS)
    torch.manual_seed(0)
    text_config = CLIPTextConfig(
        **CLIP_VIT_L14,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    pipe = StableDiffusionPipeline(
        vae=AutoencoderKL(**SD15_VAE),
        text_encoder=CLIPTextModel(text_config),
        tokenizer=tokenizer,
        unet=UNet2DConditionModel(**SD15_UNET),
        # SD 1.x's training noise schedule
        scheduler=DDPMScheduler(
            beta_schedule="scaled_linear",
            beta_start=0.00085,
            beta_end=0.012,
            clip_sample=False,
            steps_offset=1,
        ),
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )
    pipe.save_pretrained(path)


def pipeline_folder(args):
    """The pipeline every row trains (built once; a `done` file marks a complete folder)."""
    if args.pipeline:
        return Path(args.pipeline)
    path = args.work_dir / ("tiny-sd" if args.tiny else "sd15")
    if not (path / "done").is_file():
        log(f"building the {'tiny' if args.tiny else 'SD 1.5'} pipeline in {path}")
        if args.tiny:
            (path / "vocab").mkdir(parents=True, exist_ok=True)
            build_tiny_sd(path / "vocab", path)
        else:
            build_sd15(path)
        (path / "done").touch()
    return path


def photo_folder(work_dir, size, rows):
    """An imagefolder of `rows` captioned, labelled photos, center-cropped to size x size (the
    photos repeat), made once. JPEGs: real photos, quick to decode, small on disk."""
    import skimage.data
    from PIL import Image

    path = work_dir / f"photos-{size}-{rows}"
    if (path / "metadata.jsonl").is_file():
        return path
    path.mkdir(parents=True, exist_ok=True)
    photos = []
    for name, text in PHOTOS.items():
        try:  # a newer scikit-image may fetch some of them from the internet: skip those
            photos.append((Image.fromarray(getattr(skimage.data, name)()).convert("RGB"), text))
        except Exception:
            continue
    lines = []
    for i in range(rows):
        image, text = photos[i % len(photos)]
        scale = size / min(image.size)
        image = image.resize(
            (max(size, round(image.width * scale)), max(size, round(image.height * scale))),
            Image.Resampling.LANCZOS,
        )
        left, top = (image.width - size) // 2, (image.height - size) // 2
        name = f"{i:05d}.jpg"
        image.crop((left, top, left + size, top + size)).save(path / name, quality=95)
        lines.append(json.dumps({"file_name": name, "text": text, "label": i % len(photos)}))
    (path / "metadata.jsonl").write_text("\n".join(lines) + "\n")
    return path


# ----------------------------------------------------------------------------- FLOPs


def count_flops(run):
    """The FLOPs torch counts while `run()` executes (meta tensors: no memory, no compute)."""
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        run()
    return counter.get_total_flops()


def forward_backward(model, *inputs):
    """Forward and backward, as a training step runs them (a scalar loss from the output)."""
    return lambda: model(*inputs, return_dict=False)[0].float().mean().backward()


def meta_unet(pipeline, lora=False, gradient_checkpointing=False):
    import torch
    from diffusers import UNet2DConditionModel

    with torch.device("meta"):
        unet = UNet2DConditionModel.from_config(
            UNet2DConditionModel.load_config(pipeline, subfolder="unet")
        )
        if lora:  # as the scripts set it up: frozen base, a trainable adapter added to it
            from peft import LoraConfig

            unet.requires_grad_(False)
            unet.add_adapter(
                LoraConfig(
                    r=4, lora_alpha=4, init_lora_weights="gaussian", target_modules=LORA_TARGETS
                )
            )
    if gradient_checkpointing:  # each block's forward runs again in the backward
        unet.enable_gradient_checkpointing()
    return unet


def unet_inputs(unet, batch, resolution):
    """Noisy latents, timesteps and the text encoder's output, as the UNet gets them."""
    import torch

    size = resolution // 8  # the VAE's downsampling
    with torch.device("meta"):
        return (
            torch.randn(batch, unet.config.in_channels, size, size),
            torch.randint(0, 1000, (batch,)),
            torch.randn(batch, TEXT_TOKENS, unet.config.cross_attention_dim),
        )


@cache
def unet_step_flops(pipeline, lora, batch, resolution, gradient_checkpointing):
    unet = meta_unet(pipeline, lora, gradient_checkpointing)
    return count_flops(forward_backward(unet, *unet_inputs(unet, batch, resolution)))


@cache
def encoder_flops(pipeline, batch, resolution):
    """The frozen encoders' forwards: the text encoder on padded captions; the VAE's encoder and
    quant_conv, which give the posterior that the latents are drawn from."""
    import torch
    from diffusers import AutoencoderKL
    from transformers import CLIPTextConfig, CLIPTextModel

    with torch.device("meta"), torch.no_grad():
        text_encoder = CLIPTextModel(
            CLIPTextConfig.from_pretrained(pipeline, subfolder="text_encoder")
        )
        ids = torch.zeros(batch, TEXT_TOKENS, dtype=torch.long)
        vae = AutoencoderKL.from_config(AutoencoderKL.load_config(pipeline, subfolder="vae"))
        pixels = torch.randn(batch, 3, resolution, resolution)
        return {
            "text_encoder": count_flops(lambda: text_encoder(ids)),
            "vae_encoder": count_flops(lambda: vae.encode(pixels)),
        }


def sd_step_flops(pipeline, lora, batch, resolution, gradient_checkpointing, cached_latents):
    """FLOPs of one Stable Diffusion training step: the UNet's forward and backward, and the
    frozen encoders' forwards that run in the step. Returns (total, {part: FLOPs})."""
    parts = {
        "unet": unet_step_flops(pipeline, lora, batch, resolution, gradient_checkpointing),
        **encoder_flops(pipeline, batch, resolution),
    }
    if cached_latents:  # the VAE ran once per image before training
        del parts["vae_encoder"]
    return sum(parts.values()), parts


def meta_dit(model_type, resolution):
    """DiT-<size>/<patch> as train_dit.py builds it in a 4-channel latent space (1000 classes)."""
    import torch
    from diffusers import DiTTransformer2DModel

    depth, heads, width = DIT_SIZES[model_type[4:-2]]
    with torch.device("meta"):
        return DiTTransformer2DModel(
            num_layers=depth,
            num_attention_heads=heads,
            attention_head_dim=width,
            patch_size=int(model_type[-1]),
            in_channels=4,
            out_channels=4,
            sample_size=resolution // 8,
            num_embeds_ada_norm=1000,
        )


def dit_inputs(model, batch):
    import torch

    size = model.config.sample_size
    with torch.device("meta"):
        return (
            torch.randn(batch, 4, size, size),
            torch.randint(0, 1000, (batch,)),
            torch.randint(0, 1000, (batch,)),
        )


@cache
def dit_step_flops(model_type, batch, resolution):
    """FLOPs of one DiT step on cached latents: the transformer's forward and backward."""
    model = meta_dit(model_type, resolution)
    return count_flops(forward_backward(model, *dit_inputs(model, batch)))


# ----------------------------------------------------------------------------- running scripts


def log(message):
    print(message, file=sys.stderr, flush=True)


def run_env(args, compile_model):
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "PYTHONUNBUFFERED": "1",
        # every cache (datasets' encodings of the images, ...) under the work folder
        "HF_HOME": str(args.work_dir / "hf_home"),
        "ACCELERATE_DYNAMO_BACKEND": "INDUCTOR" if compile_model else "NO",
    }
    env.pop("HF_DATASETS_CACHE", None)  # under HF_HOME
    if args.tiny:  # on a CPU shared with other jobs, OpenMP threads that spin-wait for each other
        env["OMP_NUM_THREADS"] = "1"  # make a tiny step up to 100x slower; one thread is steady
    return env


def script_command(args, row, pipeline, data, output_dir):
    """The script and its flags for a row (the list at the top of this file)."""
    if row.model.startswith("dit"):
        script = REPO / OURS["dit"]
        config = dit_config(args, dit_model_type(args, row.model))
        common = ["--model_config_name_or_path", config, "--train_data_dir", data]
        common += ["--pretrained_vae_model_name_or_path", f"{pipeline}/vae"]
        common += ["--cache_latents", "--center_crop", "--resolution", args.dit_resolution]
        common += ["--logger", "none", "--save_images_epochs", NEVER]
        common += ["--eval_batch_size", 1, "--num_inference_steps", 1]
        common += ["--dataloader_num_workers", args.dit_workers]
    else:
        ours = row.script == "ours"
        script = REPO / OURS[row.model] if ours else args.reference_dir / REFERENCE[row.model]
        common = ["--pretrained_model_name_or_path", pipeline, "--train_data_dir", data]
        common += ["--resolution", args.resolution, "--center_crop", "--dataloader_num_workers", 0]
        common += ["--rank", 4] if row.model == "lora" else []
    common += ["--train_batch_size", row.batch, "--max_train_steps", args.steps]
    common += ["--mixed_precision", "no" if args.tiny else "bf16", "--output_dir", output_dir]
    common += ["--checkpointing_steps", NEVER, "--seed", 0, *FLAG_SETS[row.flags][1]]
    return [str(script), *map(str, common)]


def run_row(args, row, pipeline, data):
    """Run one row's script under the step timer; fill row.result with its figures or error."""
    logs = args.work_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    log_file = logs / (row.id.replace(":", "_").replace("/", "") + ".log")
    with tempfile.TemporaryDirectory(dir=args.work_dir) as tmp:  # outputs deleted: GBs each
        timed_json = Path(tmp) / "steps.json"
        cmd = [sys.executable, str(TIMED), *script_command(args, row, pipeline, data, f"{tmp}/out")]
        env = {**run_env(args, FLAG_SETS[row.flags][2]), "TIMED_JSON": str(timed_json)}
        start = time.perf_counter()
        with open(log_file, "w") as out:
            out.write(f"{shlex.join(cmd)}\n\n")
            out.flush()
            # a session of its own: on a timeout, kill the script and every process it started
            # (inductor's compile workers), or they would hold on to GPU memory
            output = {"stdout": out, "stderr": subprocess.STDOUT}
            proc = subprocess.Popen(cmd, cwd=REPO, env=env, start_new_session=True, **output)
            try:
                code = proc.wait(timeout=args.timeout)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                code = f"timed out after {args.timeout} s"
        timed = json.loads(timed_json.read_text()) if timed_json.is_file() else {}
    result = {
        "seconds": time.perf_counter() - start,
        "log": str(log_file),
        "device": timed.get("device"),
    }
    times = timed.get("step_times", [])
    if code != 0 or len(times) != args.steps:
        error = timed.get("error") or (code if isinstance(code, str) else f"exit code {code}")
        oom = "OutOfMemoryError" in error or "out of memory" in error.lower()
        # one short line, without the table's column separator
        result["error"] = "OOM" if oom else error.splitlines()[0][:80].replace("|", "/")
        result["oom"] = oom
        if code == 0:  # it ended normally but did not step as often as asked
            result["error"] = f"{len(times)} optimizer steps, not {args.steps}"
    else:
        durations = [b - a for a, b in itertools.pairwise(times)][args.warmup - 1 :]
        result["step_s"] = statistics.median(durations)
        result["first_step_s"] = times[0] - timed["start"]
        peak = timed.get("max_memory_allocated")
        result["peak_gib"] = peak / 2**30 if peak is not None else None
    row.result = result
    return row


def dit_data(args, batch):
    """The DiT rows' photos: whole batches only (a last, smaller one would time fewer images), and
    few enough that epoch 0 ends within the warm-up: train_dit.py samples and saves the pipeline
    after epoch 0 whatever --save_images_epochs says."""
    return photo_folder(args.work_dir, args.dit_resolution, batch * max(1, args.warmup - 1))


def dit_config(args, model_type):
    """A folder with the config.json of DiT-<size>/<patch>, which train_dit.py builds from."""
    folder = args.work_dir / "dit-configs" / model_type.replace("/", "-")
    if not (folder / "config.json").exists():
        meta_dit(model_type, args.dit_resolution).save_config(folder)
    return folder


def dit_model_type(args, model):
    return "DiT-S/2" if args.tiny else {"dit-b2": "DiT-B/2", "dit-xl2": "DiT-XL/2"}[model]


def probe_dit_batch(model_type, resolution, largest, device="cuda"):
    """The largest power-of-two batch (up to `largest`) for which a bare DiT training step, as the
    script runs it (fp32 weights, bf16 autocast, AdamW), fits in GPU memory, and the first that did
    not (None: none failed). Run in its own process (--probe_dit), so that what it allocated is
    gone before the scripts run."""
    import torch
    from diffusers import DiTTransformer2DModel

    config = meta_dit(model_type, resolution).config
    model = DiTTransformer2DModel.from_config(config).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    size, fits, batch = config.sample_size, None, 1
    while batch <= largest:
        try:
            for _ in range(2):  # the second step holds Adam's state too
                x = torch.randn(batch, config.in_channels, size, size, device=device)
                t, y = (torch.randint(0, 1000, (batch,), device=device) for _ in range(2))
                with torch.autocast(device, dtype=torch.bfloat16):
                    loss = model(x, t, y).sample.float().pow(2).mean()
                loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                del x, t, y, loss
        except torch.OutOfMemoryError:
            return fits, batch
        fits, batch = batch, batch * 2
        if device == "cuda":  # a fresh start for the next size: no cached blocks in the way
            torch.cuda.empty_cache()
    return fits, None


def dit_batch(args, model):
    """The DiT batch to time: fixed with --tiny or --dit_batch, else searched (see the top)."""
    if args.dit_batch or args.tiny:
        batch = args.dit_batch or 4
        return batch, f"batch {batch} {'given' if args.dit_batch else 'fixed (--tiny)'}"
    model_type = dit_model_type(args, model)
    cmd = [sys.executable, __file__, "--probe_dit", model_type]
    cmd += [
        "--dit_resolution",
        str(args.dit_resolution),
        "--max_dit_batch",
        str(args.max_dit_batch),
    ]
    output = {"capture_output": True, "text": True}
    probe = subprocess.run(cmd, env=run_env(args, False), timeout=args.timeout, **output)
    if probe.returncode != 0:
        return None, f"the batch search failed: {probe.stderr.strip().splitlines()[-1:]}"
    fits, failed = json.loads(probe.stdout.strip().splitlines()[-1])
    if fits is None:
        return None, f"{model_type}: not even batch 1 fits"
    why = f"{failed} ran out of memory" if failed else f"--max_dit_batch {args.max_dit_batch}"
    return fits, f"{model_type}: batch {fits}, the largest power of two that fit ({why})"


# ----------------------------------------------------------------------------- the table


def plan_rows(args):
    rows = []
    families = [m for m in ("sd", "lora") if m in args.only]
    # --tiny leaves out by default what a CPU cannot run (8-bit Adam) or takes minutes to compile
    slow = ("8bit", "compile", "cache+compile") if args.tiny else ()
    flag_sets = args.flags or [f for f in FLAG_SETS if f not in slow]
    for model in families:
        for batch in args.batch:
            for flags in flag_sets:
                for script in args.scripts:
                    skip = ""
                    if script == "reference" and flags in OURS_ONLY:
                        skip = f"n/a: {OURS_ONLY[flags]}"
                    elif script == "reference" and args.reference_dir is None:
                        skip = "n/a: no reference scripts found (--reference_dir)"
                    elif flags == "8bit" and args.tiny:
                        skip = "skipped: 8-bit Adam is for a GPU (--tiny)"
                    rows.append(Row(model, script, batch, flags, skip))
    for model in ("dit-b2", "dit-xl2"):
        if model in args.only and "ours" in args.scripts:
            for flags in ("default", "compile"):
                if flags in flag_sets:
                    rows.append(Row(model, "ours", 0, flags))  # batch: searched later
    if args.tiny:  # one DiT stands in for both
        rows = [r for r in rows if r.model != "dit-xl2"]
    if args.rows:  # patterns on the row id (a DiT row's batch is not known yet: b0)
        rows = [r for r in rows if any(fnmatch.fnmatch(r.id, pattern) for pattern in args.rows)]
    return rows


def model_label(args, row):
    if row.model.startswith("dit"):
        return dit_model_type(args, row.model)
    name = "SD 1.5" if not args.tiny else "tiny SD"
    return f"{name} LoRA r4" if row.model == "lora" else f"{name} UNet"


def step_flops(args, row, pipeline):
    if row.model.startswith("dit"):
        return dit_step_flops(dit_model_type(args, row.model), row.batch, args.dit_resolution)
    lora, checkpointing, cached = row.model == "lora", row.flags == "gc", "cache" in row.flags
    return sd_step_flops(str(pipeline), lora, row.batch, args.resolution, checkpointing, cached)[0]


def ratio(rows, row):
    """Our img/s over the reference's at the same flags (or at its default, for flags only ours
    has), and whether it is against the default; (None, False) where there is nothing to compare."""
    if row.script != "ours" or "step_s" not in row.result or row.model.startswith("dit"):
        return None, False
    flags = "default" if row.flags in OURS_ONLY else row.flags
    same = ("reference", row.model, row.batch, flags)
    for other in rows:
        if (other.script, other.model, other.batch, other.flags) == same:
            if "step_s" in other.result:  # the batches are equal: the ratio of the step times
                return other.result["step_s"] / row.result["step_s"], flags != row.flags
    return None, False


def format_ratio(rows, row):
    if row.model.startswith("dit"):
        return "no reference"
    value, vs_default = ratio(rows, row)
    return "" if value is None else f"{value:.2f}x" + (" vs default" if vs_default else "")


def format_table(args, rows, device, peak, notes):
    import accelerate
    import diffusers
    import peft
    import torch
    import transformers

    lines = [
        "# Training speed: our scripts and the Diffusers examples",
        "",
        f"- date: {datetime.now(UTC):%Y-%m-%d %H:%M} UTC",
        f"- device: {device}" + (f", dense bf16 peak {peak:g} TFLOP/s" if peak else ""),
        (
            f"- torch {torch.__version__}, diffusers {diffusers.__version__}, accelerate "
            f"{accelerate.__version__}, transformers {transformers.__version__}, peft "
            f"{peft.__version__}"
        ),
        (
            f"- {args.steps} steps a row; it/s from the median step after {args.warmup} warm-up "
            f"steps; {'fp32' if args.tiny else 'bf16'}; SD at {args.resolution} px, DiT at "
            f"{args.dit_resolution} px on cached latents"
        ),
        "",
        "| " + " | ".join(COLUMNS) + " |",
        "|---|---|--:|---|--:|--:|--:|--:|--:|--:|",  # text left, figures right
    ]
    for row in rows:
        cells = [row.script, model_label(args, row), str(row.batch or "—"), FLAG_SETS[row.flags][0]]
        result = row.result
        if row.skip or "error" in result or not result:
            reason = row.skip or result.get("error", "not run")
            cells += [reason, "", "", "", "", ""]
        else:
            it_s = 1 / result["step_s"]
            tflops = result["flops"] / result["step_s"] / 1e12
            cells += [
                f"{it_s:.2f}",
                f"{it_s * row.batch:.2f}",
                "—" if result["peak_gib"] is None else f"{result['peak_gib']:.1f}",
                f"{tflops:.3g}",
                f"{tflops / peak:.1%}" if peak else "—",
                format_ratio(rows, row),
            ]
        lines.append("| " + " | ".join(cells) + " |")
    firsts = [
        f"{r.id} {r.result['first_step_s']:.0f} s" for r in rows if "first_step_s" in r.result
    ]
    if firsts:  # compilation shows here: the compiled rows' first step
        notes = [*notes, "from launch to the end of the first step: " + ", ".join(firsts)]
    lines += ["", *[f"- {note}" for note in notes]]
    return "\n".join(lines) + "\n"


def goals(rows, peak):
    """The targets the table will be judged on, read from it: our img/s at least the reference's
    at the same flags, 1.5x its default with cached latents (and compile); DiT-B/2 at 35% MFU."""
    found = []
    for row in rows:
        value, _ = ratio(rows, row)
        goal = 1.5 if "cache" in row.flags else 1.0 if row.flags not in OURS_ONLY else None
        if value is not None and goal:
            met = "met" if value >= goal else "NOT met"
            found.append(f"{row.id}: {value:.2f}x the reference's img/s (>= {goal}x): {met}")
        if row.model == "dit-b2" and "step_s" in row.result and peak:
            mfu = row.result["flops"] / row.result["step_s"] / 1e12 / peak
            found.append(f"{row.id}: {mfu:.1%} MFU (>= 35%): {'met' if mfu >= 0.35 else 'NOT met'}")
    return found


def device_name(args):
    if args.tiny:
        return "CPU (--tiny: the figures say nothing about a GPU)"
    code = "import torch; print(torch.cuda.get_device_name() if torch.cuda.is_available() else '')"
    name = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout
    name = name.strip().splitlines()[-1] if name.strip() else ""
    if not name:
        raise SystemExit("error: no CUDA GPU here; use --tiny for the small CPU version")
    return name


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    models, scripts = ["sd", "lora", "dit-b2", "dit-xl2"], ["ours", "reference"]
    p.add_argument("--tiny", action="store_true", help="Tiny models, 64 px, fp32: a CPU.")
    p.add_argument("--only", nargs="+", choices=models, default=models, help="Models.")
    p.add_argument("--batch", nargs="+", type=int, default=[1, 4], help="SD batch sizes.")
    p.add_argument("--flags", nargs="+", choices=list(FLAG_SETS), help="Default: all a run can.")
    p.add_argument("--scripts", nargs="+", choices=scripts, default=scripts)
    p.add_argument("--rows", nargs="+", help="Row ids (model:script:bBATCH:flags) or patterns.")
    p.add_argument("--steps", type=int, help="Optimizer steps a row (20; --tiny 5).")
    p.add_argument("--warmup", type=int, help="First steps left out (5; --tiny 1); >= 1.")
    p.add_argument("--out", type=Path, help="benchmarks/gpu_table.md (--tiny: gpu_table_tiny.md)")
    work_dir = Path(tempfile.gettempdir()) / "gpu-table"
    p.add_argument("--work_dir", type=Path, default=work_dir, help="Models, data, caches, logs.")
    p.add_argument("--pipeline", help="Train this pipeline folder instead of building one.")
    p.add_argument("--reference_dir", type=Path, help="The Diffusers examples' folder.")
    p.add_argument("--rows_of_data", type=int, default=64, help="Images in the SD data folder.")
    p.add_argument("--dit_batch", type=int, help="This DiT batch; no search.")
    p.add_argument("--max_dit_batch", type=int, default=1024, help="Where the search stops.")
    p.add_argument("--dit_workers", type=int, help="DiT rows' dataloader workers (4; --tiny 0).")
    p.add_argument("--peak_tflops", type=float, help="The GPU's dense bf16 peak, for MFU.")
    p.add_argument("--timeout", type=int, default=600, help="Seconds a row may take.")
    p.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="Run every row this many times, the rows in turn each time (ours and the reference "
        "alternate), and report the median of their medians: for a noisy, shared CPU.",
    )
    p.add_argument("--dry_run", action="store_true", help="Print the row ids and commands.")
    p.add_argument("--probe_dit", help=argparse.SUPPRESS)  # the DiT batch search's own process
    p.add_argument("--dit_resolution", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.resolution = 64 if args.tiny else 512
    args.dit_resolution = args.dit_resolution or (64 if args.tiny else 256)
    args.steps = args.steps or (5 if args.tiny else 20)
    args.dit_workers = args.dit_workers if args.dit_workers is not None else (0 if args.tiny else 4)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.tiny else 5)
    if not 1 <= args.warmup < args.steps:
        p.error("--warmup must be at least 1 (the first step has no start) and below --steps")
    args.out = args.out or REPO / "benchmarks" / f"gpu_table{'_tiny' if args.tiny else ''}.md"
    args.work_dir = args.work_dir.resolve()
    if args.reference_dir is None:
        args.reference_dir = next(
            (d for d in REFERENCE_DIRS if (d / REFERENCE["sd"]).is_file()), None
        )
    return args


def main():
    args = parse_args()
    if args.probe_dit:  # the DiT batch search's own process
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"  # a CPU: to try this code alone
        fits = probe_dit_batch(args.probe_dit, args.dit_resolution, args.max_dit_batch, device)
        print(json.dumps(fits))
        return
    rows = plan_rows(args)
    if not rows:
        raise SystemExit("error: no rows selected")
    args.work_dir.mkdir(parents=True, exist_ok=True)
    if args.dry_run:
        for row in rows:  # a DiT row's batch is searched when it runs
            command = script_command(args, row, "PIPELINE", "DATA", "OUTPUT_DIR")
            command = shlex.join(command).replace("--train_batch_size 0", "--train_batch_size B")
            env = "ACCELERATE_DYNAMO_BACKEND=INDUCTOR " if FLAG_SETS[row.flags][2] else ""
            print(f"{row.id}: {row.skip or env + command}")
        return
    device = device_name(args)
    peak = args.peak_tflops or next((v for k, v in PEAK_TFLOPS.items() if k in device), None)
    notes = []
    if not (peak or args.tiny):
        notes.append(f"no bf16 peak known for {device}: MFU left out (give --peak_tflops)")
    started = time.perf_counter()
    pipeline = pipeline_folder(args)
    sd_data = photo_folder(args.work_dir, args.resolution, args.rows_of_data)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    if args.repeat > 1:
        notes.append(f"every row ran {args.repeat} times, in turn: the median of the runs' medians")
    for row in [row for _ in range(args.repeat) for row in rows]:  # ours, reference, ours, ...
        if row.model.startswith("dit") and not row.batch:  # found once per model
            known = next((r.batch for r in rows if r.model == row.model and r.batch), None)
            if known:
                row.batch = known
            else:
                row.batch, note = dit_batch(args, row.model)
                notes.append(note)
                if row.batch is None:
                    row.batch, row.skip = 0, "failed: no batch fits"
        if row.skip:
            log(f"{row.id}: {row.skip}")
            continue
        log(f"{row.id}: running")
        run_row(
            args,
            row,
            pipeline,
            dit_data(args, row.batch) if row.model.startswith("dit") else sd_data,
        )
        while row.model.startswith("dit") and row.result.get("oom") and row.batch > 1:
            notes.append(f"{row.id}: ran out of memory at batch {row.batch}; halved")
            row.batch //= 2
            for other in rows:  # the other DiT rows of this model time the same batch
                if other.model == row.model:
                    other.batch = row.batch
            run_row(args, row, pipeline, dit_data(args, row.batch))
        if "step_s" in row.result:
            row.step_s.append(row.result["step_s"])
            row.result["step_s"] = statistics.median(row.step_s)
            row.result["flops"] = step_flops(args, row, pipeline)
        outcome = row.result.get("error") or f"{1 / row.result['step_s']:.3f} it/s"
        log(f"{row.id}: {outcome} ({row.result['seconds']:.0f} s; log {row.result['log']})")
        if row.result.get("device") and not args.tiny and row.result["device"] != device:
            notes.append(f"{row.id} ran on {row.result['device']}")
        args.out.write_text(format_table(args, rows, device, peak, notes))  # a cut run keeps rows
    minutes = (time.perf_counter() - started) / 60
    notes.append(f"the whole table took {minutes:.1f} min, building included")
    notes.append(f"logs: {args.work_dir / 'logs'}")
    if args.reference_dir:
        notes.append(f"reference scripts: {args.reference_dir}")
    table = format_table(args, rows, device, peak, notes)
    if goals(rows, peak):  # the targets, read from the table
        judged = " (on a CPU they mean nothing)" if args.tiny else ""
        table += f"\nGoals{judged}:\n\n" + "".join(f"- {goal}\n" for goal in goals(rows, peak))
    print(table)
    args.out.write_text(table)
    log(f"written to {args.out}")


if __name__ == "__main__":
    main()
