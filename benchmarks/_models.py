"""What benchmarks/gpu_table.py trains, and the FLOPs of a training step of it.

Models with random weights (the real compute; nothing is downloaded): Stable Diffusion 1.5's UNet,
VAE and CLIP ViT-L/14 text encoder built from their published configs and saved once as a
StableDiffusionPipeline folder; captioned photos from scikit-image; DiT-<size>/2 as train_dit.py
builds it. --tiny: the tests' tiny pipeline (tests/conftest.py build_tiny_sd).

The FLOPs are counted by torch.utils.flop_counter.FlopCounterMode on copies of the models built on
the meta device (no memory, no compute), once per model, batch and flags: the forward and backward
of the trained model (the UNet; for LoRA the UNet with a rank-4 peft adapter on to_q, to_k, to_v,
to_out.0, whose frozen weights still cost the backward's activation gradients; the DiT), the
forwards that gradient checkpointing repeats, and the forwards of the frozen VAE encoder and text
encoder when they run in the step (the VAE not with cached latents). The optimizer's are left out.
"""

import json
import sys
import tempfile
from functools import cache
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))
from conftest import build_tiny_sd, clip_tokenizer  # the tests' offline helpers

# Stable Diffusion 1.5's published configs (runwayml/stable-diffusion-v1-5): what diffusers'
# defaults do not already say.
SD15_UNET = {
    "block_out_channels": (320, 640, 1280, 1280),
    "layers_per_block": 2,
    "cross_attention_dim": 768,
    "attention_head_dim": 8,
    "sample_size": 64,
}
SD15_VAE = {
    "block_out_channels": (128, 256, 512, 512),
    "layers_per_block": 2,
    "latent_channels": 4,
    "down_block_types": ("DownEncoderBlock2D",) * 4,
    "up_block_types": ("UpDecoderBlock2D",) * 4,
    "sample_size": 512,
    "scaling_factor": 0.18215,
}
CLIP_VIT_L14 = {
    "hidden_size": 768,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "intermediate_size": 3072,
    "max_position_embeddings": 77,
    "vocab_size": 49408,
    "hidden_act": "quick_gelu",
    "projection_dim": 768,
}
TEXT_TOKENS = 77  # captions are padded to the tokenizer's model_max_length
LORA_TARGETS = ["to_q", "to_k", "to_v", "to_out.0"]
# DiT sizes (depth, heads, head width), as in configs/dit-b-2 and configs/dit-xl-2; patch size 2.
DIT_SIZES = {"S": (12, 6, 64), "B": (12, 12, 64), "L": (24, 16, 64), "XL": (28, 16, 72)}
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
    """The pipeline every row trains (args.pipeline, or built once under args.work_dir; a `done`
    file marks a complete folder)."""
    if args.pipeline:
        return Path(args.pipeline)
    path = args.work_dir / ("tiny-sd" if args.tiny else "sd15")
    if not (path / "done").is_file():
        print(
            f"building the {'tiny' if args.tiny else 'SD 1.5'} pipeline in {path}", file=sys.stderr
        )
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
        except Exception as error:  # noqa: BLE001  whatever the fetch raised
            print(f"photo {name} left out: {error}", file=sys.stderr)
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
