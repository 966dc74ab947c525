#!/usr/bin/env python
"""train_text_to_image.py: fine-tune the UNet of Stable Diffusion 1.x on captioned images.

Latent diffusion (Rombach et al. 2022) runs the DDPM recipe of train_unconditional.py in the
latent space of a frozen VAE, with the UNet conditioned on a frozen CLIP text encoder through
cross-attention. Per step: encode the image to latents z_0, add noise to get z_t, and regress
the UNet's output ε_θ(z_t, t, text) on ε (or on the velocity v). Only the UNet learns.

    accelerate launch train_text_to_image.py --pretrained_model_name_or_path PATH_OR_HUB_ID \
        --train_data_dir data/digits --resolution 512 --output_dir sd-model-finetuned

Sections, the same in every script of this repo: 1 arguments, 2 accelerator/logging/seed,
3 models, 4 data, 5 optimizer and LR schedule, 6 checkpoint hooks and resume, 7 training loop,
8 validation, 9 final save.
"""
import argparse
import hashlib
import importlib.util
import json
import logging
import math
import os
import secrets
import shlex
import shutil
import sys
import time
from contextlib import nullcontext
from datetime import timedelta
from functools import partial
from pathlib import Path

import datasets
import numpy as np
import torch
import torch.nn.functional as F
import torchvision
from accelerate import Accelerator, DistributedType
from accelerate.logging import get_logger
from accelerate.tracking import LOGGER_TYPE_TO_CLASS
from accelerate.utils import (DataLoaderConfiguration, InitProcessGroupKwargs, ProjectConfiguration,
                              broadcast_object_list, has_compiled_regions, is_compiled_module, set_seed)
from datasets import load_dataset
from diffusers import (AutoencoderKL, DDPMScheduler, DPMSolverMultistepScheduler, StableDiffusionPipeline,
                       UNet2DConditionModel)
from diffusers.models.autoencoders.vae import DiagonalGaussianDistribution
from diffusers.optimization import SchedulerType, get_scheduler
from diffusers.training_utils import EMAModel, compute_dream_and_update_latents, compute_snr, free_memory, offload_models
from huggingface_hub import create_repo, upload_folder
from PIL import Image
from torch.utils.flop_counter import FlopCounterMode
from torchvision import transforms
from tqdm.auto import tqdm
from transformers import CLIPTextModel, CLIPTokenizer
from transformers.integrations import unset_hf_deepspeed_config

logger = get_logger(__name__)
TRAINER = "train_text_to_image"  # recorded in checkpoints: another script's checkpoint is refused
ROW = "__row__"  # a private column: each image's row in the full dataset, for its per-sample seed
PER_STEP = ("num_processes", "train_batch_size", "gradient_accumulation_steps")  # their product: images per step
SHARDING = (DistributedType.DEEPSPEED, DistributedType.FSDP)  # backends that store a checkpoint in their own way
SPLIT_NAMES = {"train", "training", "test", "testing", "eval", "evaluation", "valid", "validation", "val", "dev"}
FULL_IMAGE_CHECK = 10_000  # datasets up to this size are decoded in full before training; larger ones as they load
INTERPOLATIONS = [mode.name.lower() for mode in transforms.InterpolationMode]  # the example's spelling: nearest_exact
# Dense bf16/fp16 tensor-core peaks (datasheets, sparsity excluded) in TFLOP/s, for MFU. The first key found in
# torch.cuda.get_device_name() wins: H100 SXM calls itself "H100 80GB HBM3"; GeForce figures are with fp32 accumulation.
PEAK_TFLOPS = {"H100 NVL": 835, "H100 PCIe": 756, "H100": 989, "H200 NVL": 835, "H200": 989, "B200": 2250, "A100": 312,
               "A10G": 70, "A10": 125, "L40S": 362, "L40": 181, "L4": 121, "RTX 4090": 165, "RTX 3090": 71, "V100": 125}


# 1. Arguments: the Diffusers example's flags and defaults, so existing commands work unchanged
def parse_args(argv=None):
    p = argparse.ArgumentParser(description="Fine-tune the UNet of a Stable Diffusion 1.x pipeline.")
    p.add_argument("--pretrained_model_name_or_path", default=None, help="A hub id or a local pipeline folder.")
    p.add_argument("--revision", default=None)
    p.add_argument("--variant", default=None, help='Weights variant to load, e.g. "fp16".')
    p.add_argument("--non_ema_revision", default=None, help="Train the UNet of this revision; the EMA starts from --revision.")
    p.add_argument("--dataset_name", default=None, help="A hub dataset id, or a local dataset folder.")
    p.add_argument("--dataset_config_name", default=None)
    p.add_argument("--train_data_dir", default=None, help="A `datasets` imagefolder (used if no --dataset_name).")
    p.add_argument("--image_column", default="image", help="The dataset column that holds the images.")
    p.add_argument("--caption_column", default="text", help="The column with a caption or a list of captions.")
    p.add_argument("--caption_extension", default=".txt", help="Without a caption column: the caption file beside each image.")
    p.add_argument("--instance_prompt", default=None, help='The caption of every image, e.g. "a photo of sks dog".')
    p.add_argument("--max_train_samples", type=int, default=None, help="Train on a seeded random subset.")
    p.add_argument("--validation_prompts", nargs="+", default=None)
    p.add_argument("--validation_epochs", type=int, default=5, help="Sample the validation prompts every N epochs.")
    p.add_argument("--validation_steps", type=int, default=None, help="Also sample them every N steps.")
    p.add_argument("--output_dir", default="sd-model-finetuned")
    p.add_argument("--cache_dir", default=None, help="Where models and datasets are cached.")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--resolution", type=int, default=512)
    p.add_argument("--center_crop", action="store_true", help="Center crop instead of a random crop.")
    p.add_argument("--random_flip", action="store_true", help="Flip images horizontally at random.")
    p.add_argument("--image_interpolation_mode", default="lanczos", choices=INTERPOLATIONS)
    p.add_argument("--cache_latents", action="store_true", help="Encode each image once with the VAE before training.")
    p.add_argument("--cache_text_embeddings", action="store_true", help="Encode each caption once before training.")
    p.add_argument("--train_batch_size", type=int, default=16, help="Batch size per device.")
    p.add_argument("--dataloader_num_workers", type=int, default=0)
    p.add_argument("--num_train_epochs", "--num_epochs", dest="num_train_epochs", type=int, default=100)
    p.add_argument("--max_train_steps", type=int, default=None, help="Overrides --num_train_epochs if set.")
    p.add_argument("--gradient_accumulation_steps", type=int, default=1)
    p.add_argument("--gradient_checkpointing", action="store_true", help="Save memory at ~30% more compute.")
    p.add_argument("--learning_rate", type=float, default=1e-4)
    p.add_argument("--scale_lr", action="store_true", help="Multiply the LR by the total batch size.")
    p.add_argument("--lr_scheduler", default="constant", choices=[s.value for s in SchedulerType])
    p.add_argument("--lr_warmup_steps", type=int, default=500)
    p.add_argument("--adam_beta1", type=float, default=0.9)
    p.add_argument("--adam_beta2", type=float, default=0.999)
    p.add_argument("--adam_weight_decay", type=float, default=1e-2)
    p.add_argument("--adam_epsilon", type=float, default=1e-08)
    p.add_argument("--use_8bit_adam", action="store_true", help="bitsandbytes' 8-bit AdamW (GPU).")
    p.add_argument("--max_grad_norm", type=float, default=1.0)
    p.add_argument("--use_ema", action="store_true", help="Keep an exponential moving average of the weights.")
    p.add_argument("--offload_ema", action="store_true", help="Keep the EMA weights in CPU memory.")
    p.add_argument("--foreach_ema", action="store_true", help="Faster EMA updates with torch._foreach ops.")
    p.add_argument("--report_to", "--logger", dest="report_to", default="tensorboard",
                   choices=[*LOGGER_TYPE_TO_CLASS, "all", "none"])
    p.add_argument("--logging_dir", default="logs", help="TensorBoard folder, under output_dir.")
    p.add_argument("--tracker_project_name", default="text2image-fine-tune")
    p.add_argument("--mixed_precision", default=None, choices=["no", "fp16", "bf16"],
                   help="Defaults to the `accelerate config` setting.")
    p.add_argument("--allow_tf32", action="store_true", help="Faster fp32 matmuls on Ampere and newer GPUs.")
    p.add_argument("--peak_tflops", type=float, default=None, help="The accelerator's dense peak, for the MFU log.")
    p.add_argument("--prediction_type", default=None, choices=["epsilon", "v_prediction"],
                   help="Overrides the base model's scheduler config.")
    p.add_argument("--snr_gamma", type=float, default=None, help="Min-SNR-γ loss weighting; 5.0 is common.")
    p.add_argument("--noise_offset", type=float, default=0, help="Per-channel noise shift, e.g. 0.1.")
    p.add_argument("--dream_training", action="store_true", help="DREAM (Zhou et al. 2023): one extra forward pass a step.")
    p.add_argument("--dream_detail_preservation", type=float, default=1.0)
    p.add_argument("--input_perturbation", type=float, default=0, help="Extra noise on the UNet input, e.g. 0.1.")
    p.add_argument("--checkpointing_steps", type=int, default=500, help="Save the full state every N steps.")
    p.add_argument("--checkpoints_total_limit", type=int, default=None, help="Keep at most this many.")
    p.add_argument("--resume_from_checkpoint", default=None, help='A checkpoint-N folder name, or "latest".')
    p.add_argument("--push_to_hub", action="store_true", help="Upload output_dir to the hub at the end.")
    p.add_argument("--hub_token", default=None)
    p.add_argument("--hub_model_id", default=None, help="The hub repo to push to; default: output_dir's name.")
    p.add_argument("--hub_private_repo", action="store_true")
    p.add_argument("--enable_xformers_memory_efficient_attention", action="store_true", help="If xformers is installed.")
    p.add_argument("--local_rank", "--local-rank", type=int, default=-1, help="Set by torch's launchers; unused.")
    args = p.parse_args(argv)
    if args.pretrained_model_name_or_path is None:
        p.error("give the base model: --pretrained_model_name_or_path")
    if args.dataset_name is None and args.train_data_dir is None:
        p.error("give a dataset: --dataset_name or --train_data_dir")
    if args.report_to in ("wandb", "all") and args.hub_token is not None:  # as the Diffusers examples refuse it
        p.error("--hub_token with --report_to wandb would store the token in the wandb run: log in with `hf auth login` instead")
    if args.cache_latents and not args.center_crop:
        p.error("--cache_latents needs --center_crop: a random crop is new every epoch, so its latents cannot be stored")
    return args


def main(args):
    # 2. Accelerator, logging, seed
    # The other processes wait while the main one validates: the Diffusers example's 2-hour timeout. Several
    # processes without a GPU talk over gloo, which DeepSpeed needs named; otherwise None lets accelerate pick.
    cpu_processes = not torch.accelerator.is_available() and int(os.environ.get("WORLD_SIZE", "1")) > 1
    accelerator = Accelerator(
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        mixed_precision=args.mixed_precision,
        log_with=None if args.report_to == "none" else args.report_to,
        project_config=ProjectConfiguration(args.output_dir, os.path.join(args.output_dir, args.logging_dir)),
        # every process draws the same seeded permutation each epoch and takes its own share of it
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True),
        step_scheduler_with_optimizer=False,  # the loop steps the LR schedule once per optimizer step
        kwargs_handlers=[InitProcessGroupKwargs(backend="gloo" if cpu_processes else None, timeout=timedelta(seconds=7200))],
    )
    if accelerator.mixed_precision == "fp16" and accelerator.device.type == "cpu":
        raise SystemExit("error: --mixed_precision fp16 needs a GPU; on a CPU use bf16 or no.")
    # INFO lines (progress notes, saved checkpoints) from the main process; library chatter from the others is muted
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", level=logging.INFO)
    if not accelerator.is_main_process:
        datasets.utils.logging.set_verbosity_error()
    sharded = check_launch(accelerator, args)
    resume_path, resume_state = find_checkpoint(accelerator, args) if args.resume_from_checkpoint else (None, None)
    repo_id = create_hub_repo(args) if accelerator.is_main_process else None
    args.seed = shared_seed(accelerator, args.seed if resume_state is None else resume_state["seed"])
    accelerator.dataloader_config.data_seed = args.seed
    set_seed(args.seed)
    if args.allow_tf32:
        torch.backends.cuda.matmul.allow_tf32 = True

    # 3. Models: the noise schedule, tokenizer and text encoder, VAE and UNet of the base pipeline
    check_pipeline_folder(args.pretrained_model_name_or_path)
    load = dict(pretrained_model_name_or_path=args.pretrained_model_name_or_path, revision=args.revision,
                cache_dir=args.cache_dir)
    noise_scheduler = DDPMScheduler.from_pretrained(subfolder="scheduler", **load)
    if args.prediction_type is not None:
        noise_scheduler.register_to_config(prediction_type=args.prediction_type)
    if noise_scheduler.config.prediction_type not in ("epsilon", "v_prediction"):  # the loss below knows these two
        raise SystemExit(f"error: the base scheduler predicts '{noise_scheduler.config.prediction_type}': "
                         "give --prediction_type epsilon or v_prediction")
    if args.dream_training and noise_scheduler.config.prediction_type != "epsilon":
        raise SystemExit("error: --dream_training needs epsilon prediction (diffusers implements DREAM for it alone)")
    tokenizer = CLIPTokenizer.from_pretrained(subfolder="tokenizer", **load)
    # Under DeepSpeed ZeRO-3 accelerate registers its config with transformers, which then splits every model it
    # loads across processes. The frozen ones here (and those of the final save) run outside DeepSpeed and must
    # stay whole: unregister it. (accelerate's zero3_init_context_manager(enable=False) leaves it registered.)
    unset_hf_deepspeed_config()
    text_encoder = CLIPTextModel.from_pretrained(subfolder="text_encoder", variant=args.variant, **load)
    vae = AutoencoderKL.from_pretrained(subfolder="vae", variant=args.variant, **load)
    model = UNet2DConditionModel.from_pretrained(subfolder="unet", variant=args.variant, **{**load, "revision": args.non_ema_revision or args.revision})
    downsampling = 2 ** (len(vae.config.block_out_channels) - 1)
    if args.resolution % downsampling:
        raise SystemExit(f"error: --resolution {args.resolution} must be a multiple of {downsampling}, the VAE's downsampling factor.")
    vae.requires_grad_(False)
    text_encoder.requires_grad_(False)
    # Frozen models run in the mixed-precision dtype. The UNet stays fp32 for the optimizer, and autocast runs
    # it in that dtype; under DeepSpeed the engine casts it instead and keeps fp32 copies in its optimizer.
    weight_dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(accelerator.mixed_precision, torch.float32)
    vae.to(accelerator.device, dtype=weight_dtype)
    text_encoder.to(accelerator.device, dtype=weight_dtype)
    if args.gradient_checkpointing:
        model.enable_gradient_checkpointing()
    if args.enable_xformers_memory_efficient_attention and importlib.util.find_spec("xformers") is None:
        logger.info("xformers is not installed: PyTorch's scaled-dot-product attention, the default, is used")
    elif args.enable_xformers_memory_efficient_attention:
        model.enable_xformers_memory_efficient_attention()
    if args.use_ema:  # from the --revision weights, also when the trained UNet comes from --non_ema_revision
        ema_source = model if args.non_ema_revision is None else UNet2DConditionModel.from_pretrained(subfolder="unet", variant=args.variant, **load)
        ema_model = EMAModel(ema_source.parameters(), model_cls=UNet2DConditionModel, model_config=model.config,
                             foreach=args.foreach_ema)

    # 4. Data: a hub dataset or a local imagefolder with captions; images resized, cropped, flipped, scaled
    #    to [-1, 1]; captions tokenized to the text encoder's fixed length
    train_dataset = load_train_dataset(args)
    if args.image_column not in train_dataset.column_names:
        raise SystemExit(f"error: --image_column '{args.image_column}' is not in the dataset; its columns are {train_dataset.column_names}")
    # decoded by preprocess_train, so that a broken file is reported by name rather than deep inside `datasets`
    train_dataset = train_dataset.cast_column(args.image_column, datasets.Image(decode=False))
    with accelerator.main_process_first():  # the main process reads caption files first; the others reuse its cache
        train_dataset = add_captions(train_dataset, args)
    train_dataset = train_dataset.add_column(ROW, np.arange(len(train_dataset)))  # before any subset: no rewrite
    if args.max_train_samples is not None:
        train_dataset = train_dataset.shuffle(seed=args.seed).select(range(min(args.max_train_samples, len(train_dataset))))
    if accelerator.is_local_main_process and args.instance_prompt is None:
        check_captions(train_dataset, args)
    if len(train_dataset) <= FULL_IMAGE_CHECK and accelerator.is_local_main_process:
        check_images(train_dataset, args.image_column)
    train_transforms = transforms.Compose([
        transforms.Resize(args.resolution, interpolation=transforms.InterpolationMode[args.image_interpolation_mode.upper()]),
        transforms.CenterCrop(args.resolution) if args.center_crop else transforms.RandomCrop(args.resolution),
        transforms.RandomHorizontalFlip(0.5 if args.random_flip else 0.0),
        transforms.ToTensor(),
        transforms.Normalize([0.5], [0.5]),
    ])
    if args.cache_latents or args.cache_text_embeddings:  # the frozen encoders run here, once, instead of every step
        no_flip = transforms.Compose([t for t in train_transforms.transforms if not isinstance(t, transforms.RandomHorizontalFlip)])
        train_dataset = cache_encodings(accelerator, args, train_dataset, vae, text_encoder, tokenizer, weight_dtype, no_flip)
    data = dict(args=args, train_transforms=train_transforms, tokenizer=tokenizer, num_train_timesteps=noise_scheduler.config.num_train_timesteps,
                latent_shape=(vae.config.latent_channels, args.resolution // downsampling, args.resolution // downsampling),
                text_shape=(tokenizer.model_max_length, text_encoder.config.hidden_size), weight_dtype=weight_dtype)
    train_dataset.set_transform(partial(preprocess_train, **data, epoch=0))
    train_dataloader = torch.utils.data.DataLoader(
        train_dataset, batch_size=args.train_batch_size, shuffle=True, num_workers=args.dataloader_num_workers,
        pin_memory=accelerator.device.type == "cuda",
    )

    # 5. Optimizer and LR schedule, prepared in one call (DeepSpeed wraps the scheduler only so). Steps are
    #    counted on each process's share of the batches. The schedule counts optimizer steps (the loop steps it,
    #    not accelerate), so a checkpoint means the same on any number of processes.
    if args.scale_lr:
        args.learning_rate *= args.gradient_accumulation_steps * args.train_batch_size * accelerator.num_processes
    if args.use_8bit_adam:
        import bitsandbytes as bnb
        optimizer_cls = bnb.optim.AdamW8bit
    else:
        optimizer_cls = torch.optim.AdamW
    optimizer = optimizer_cls(
        model.parameters(), lr=args.learning_rate, betas=(args.adam_beta1, args.adam_beta2),
        weight_decay=args.adam_weight_decay, eps=args.adam_epsilon,
    )
    num_update_steps_per_epoch = math.ceil(math.ceil(len(train_dataloader) / accelerator.num_processes) / args.gradient_accumulation_steps)
    if args.max_train_steps is None:
        args.max_train_steps = args.num_train_epochs * num_update_steps_per_epoch
    args.num_train_epochs = math.ceil(args.max_train_steps / num_update_steps_per_epoch)
    lr_scheduler = get_scheduler(
        args.lr_scheduler, optimizer=optimizer, num_warmup_steps=args.lr_warmup_steps, num_training_steps=args.max_train_steps,
    )
    model, optimizer, train_dataloader, lr_scheduler = accelerator.prepare(model, optimizer, train_dataloader, lr_scheduler)
    # Under DeepSpeed the model itself holds the mixed-precision dtype and no autocast is added: feed it that dtype
    input_dtype = accelerator.unwrap_model(model).dtype if accelerator.distributed_type == DistributedType.DEEPSPEED else torch.float32
    if is_compiled_module(model) or has_compiled_regions(model):
        logger.info(f"The model is compiled with torch.compile ({accelerator.state.dynamo_plugin.backend.value.lower()})")
    if args.use_ema and args.offload_ema and accelerator.device.type == "cuda":
        ema_model.pin_memory()  # page-locked host memory: the copies to and from the GPU need not wait
    elif args.use_ema and not args.offload_ema:
        ema_model.to(accelerator.device)

    # 6. Checkpoint hooks and resume. With plain or DDP training accelerate hands the hooks the weights to store:
    #    they write the UNet as a `save_pretrained` folder instead and pop the weights so they are not stored
    #    twice. DeepSpeed and FSDP store the model their own way and hand the hooks empty lists.
    accelerator.register_save_state_pre_hook(partial(save_model_hook, accelerator, args, ema_model if args.use_ema else None))
    accelerator.register_load_state_pre_hook(partial(load_model_hook, accelerator, args, ema_model if args.use_ema else None))
    global_step, first_epoch, resume_step = 0, 0, 0
    if resume_path:
        logger.info(f"Resuming from {resume_path}")
        accelerator.load_state(resume_path)
        global_step = resume_state["global_step"]
        first_epoch = global_step // num_update_steps_per_epoch
        # the batches of the partial epoch already trained on, skipped below
        resume_step = (global_step % num_update_steps_per_epoch) * args.gradient_accumulation_steps
    elif args.resume_from_checkpoint:
        logger.info(f"No checkpoint in {args.output_dir} yet; starting a new run.")
    if accelerator.is_main_process:
        os.makedirs(args.output_dir, exist_ok=True)
        config = {k: v for k, v in vars(args).items() if v is not None and k != "validation_prompts"}
        accelerator.init_trackers(args.tracker_project_name, config=config)

    # 7. The training loop
    total_batch_size = args.train_batch_size * accelerator.num_processes * args.gradient_accumulation_steps
    logger.info(f"{len(train_dataset)} images, {args.num_train_epochs} epochs, {args.max_train_steps} steps of {total_batch_size} images")
    progress_bar = tqdm(
        range(args.max_train_steps), initial=global_step, desc="Steps", disable=not accelerator.is_local_main_process
    )
    train_loss, step_start = torch.zeros((), device=accelerator.device), time.perf_counter()
    flops, peak = None, args.peak_tflops  # the FLOPs of one micro-batch, counted at the first; the peak MFU divides by
    if peak is None and accelerator.device.type == "cuda":
        peak = next((tflops for name, tflops in PEAK_TFLOPS.items() if name in torch.cuda.get_device_name()), None)
    for epoch in range(first_epoch, args.num_train_epochs):
        model.train()
        train_dataset.set_transform(partial(preprocess_train, **data, epoch=epoch))
        train_dataloader.set_epoch(epoch)
        batches = train_dataloader
        if epoch == first_epoch and resume_step:
            batches = accelerator.skip_first_batches(train_dataloader, resume_step)
        for batch in batches:
            stop_on_unreadable(batch, args)
            noise, timesteps = batch["noise"], batch["timesteps"]
            counter = FlopCounterMode(display=False) if flops is None else nullcontext()  # forwards alone: counted as they run
            with torch.no_grad(), counter:
                # z_0: a sample of the VAE's posterior N(μ, σ²), scaled to unit variance (its moments cached or encoded now)
                posterior = DiagonalGaussianDistribution(batch["latent_moments"]) if args.cache_latents else \
                    vae.encode(batch["pixel_values"].to(weight_dtype)).latent_dist
                latents = (posterior.mean + posterior.std * batch["latent_noise"].to(weight_dtype)).float()
                latents = latents * vae.config.scaling_factor
                encoder_hidden_states = batch["text_embeddings"] if args.cache_text_embeddings else \
                    text_encoder(batch["input_ids"], return_dict=False)[0]
            # The forward process in closed form: z_t = √ᾱ_t·z_0 + √(1−ᾱ_t)·ε (ε perturbed if asked)
            noisy_latents = noise_scheduler.add_noise(latents, noise + batch["perturbation"], timesteps)
            if flops is None:  # once, at the first micro-batch: the frozen encoders' and the UNet's
                unet = accelerator.unwrap_model(model, keep_torch_compile=False)
                flops = [counter.get_total_flops(), training_flops(unet, args, noisy_latents, timesteps, encoder_hidden_states)]
                logger.info(f"One micro-batch of {len(timesteps)} images: UNet forward and backward {flops[1]:.4g} FLOPs, "
                            f"frozen VAE and text encoder {flops[0]:.4g}")

            with accelerator.accumulate(model):
                if noise_scheduler.config.prediction_type == "epsilon":
                    target = noise
                else:  # v = √ᾱ_t·ε − √(1−ᾱ_t)·z_0
                    target = noise_scheduler.get_velocity(latents, noise, timesteps)
                if args.dream_training:  # DREAM: move input and target by the model's own error (a forward pass, no grad)
                    noisy_latents, target = compute_dream_and_update_latents(
                        model, noise_scheduler, timesteps, noise, noisy_latents.to(input_dtype), target,
                        encoder_hidden_states.to(input_dtype), args.dream_detail_preservation)
                model_output = model(noisy_latents.to(input_dtype), timesteps, encoder_hidden_states.to(input_dtype), return_dict=False)[0]
                # the same loss as Algorithm 1, now on latents; one value per image so it can be weighted
                loss = F.mse_loss(model_output.float(), target.float(), reduction="none").mean(dim=[1, 2, 3])
                loss = (loss * snr_loss_weights(noise_scheduler, timesteps, args)).mean()
                train_loss += loss.detach() / args.gradient_accumulation_steps  # stays on the device: no sync
                accelerator.backward(loss)
                if accelerator.sync_gradients:  # a no-op under DeepSpeed, which clips by its own config
                    accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)
                optimizer.step()
                optimizer.zero_grad()

            if accelerator.sync_gradients:  # an optimizer step happened
                lr_scheduler.step()
                if args.use_ema:
                    if args.offload_ema:
                        ema_model.to(accelerator.device, non_blocking=True)
                    ema_model.step(model.parameters())
                    if args.offload_ema:
                        ema_model.to("cpu", non_blocking=True)
                global_step += 1
                train_loss = accelerator.reduce(train_loss, "mean").item()  # the mean over all processes, for the log
                seconds = time.perf_counter() - step_start
                tflops = flops[1] * args.gradient_accumulation_steps / seconds / 1e12  # the UNet's, on each process
                logs = {"train_loss": train_loss, "lr": lr_scheduler.get_last_lr()[0], "img/s": total_batch_size / seconds,
                        "tflops": tflops, **({"mfu": tflops / peak} if peak else {})}
                progress_bar.update(1)
                progress_bar.set_postfix(loss=train_loss, img_s=f"{logs['img/s']:.1f}", tflops=f"{tflops:.3g}")
                accelerator.log(logs, step=global_step)
                if global_step % args.checkpointing_steps == 0:
                    save_checkpoint(accelerator, args, global_step)
                if args.validation_prompts and args.validation_steps and global_step % args.validation_steps == 0:
                    log_validation(accelerator, args, vae, text_encoder, tokenizer, model, ema_model if args.use_ema else None,
                                   noise_scheduler, global_step, sharded)
                train_loss, step_start = torch.zeros((), device=accelerator.device), time.perf_counter()
            if global_step >= args.max_train_steps:
                break

        # 8. Validation: the validation prompts with a fixed seed (EMA weights if used), logged and saved. With a
        #    sharded model every process takes part; otherwise the main process alone.
        last_epoch = epoch == args.num_train_epochs - 1 or global_step >= args.max_train_steps
        if args.validation_prompts and (epoch % args.validation_epochs == 0 or last_epoch):
            log_validation(accelerator, args, vae, text_encoder, tokenizer, model, ema_model if args.use_ema else None,
                           noise_scheduler, global_step, sharded)
        step_start = time.perf_counter()
        if global_step >= args.max_train_steps:
            break

    # 9. Final save: a complete pipeline folder, the UNet holding the EMA weights if --use_ema. The frozen
    #    parts come from the base model as they are on disk, not in the mixed-precision dtype used here.
    progress_bar.close()
    unet = full_model(accelerator, model, sharded)  # None on the other processes
    if accelerator.is_main_process:
        if args.use_ema:
            ema_model.copy_to(unet.parameters())
        pipeline = StableDiffusionPipeline.from_pretrained(unet=unet, variant=args.variant, **load)
        # the base scheduler's config, carrying the prediction type this UNet was trained for
        pipeline.scheduler.register_to_config(prediction_type=noise_scheduler.config.prediction_type)
        pipeline.save_pretrained(args.output_dir)
        write_model_card(args, global_step)
        logger.info(f"Saved the pipeline to {args.output_dir}")
    if repo_id is not None:
        upload_folder(repo_id=repo_id, folder_path=args.output_dir, commit_message="End of training", token=args.hub_token,
                      ignore_patterns=["checkpoint-*", "tmp-checkpoint-*"])
    accelerator.end_training()


def create_hub_repo(args):
    """With --push_to_hub the repo is created now: no network, offline mode or a bad token fails before training."""
    try:
        return create_repo(args.hub_model_id or os.path.basename(os.path.abspath(args.output_dir)), exist_ok=True,
                           token=args.hub_token, private=args.hub_private_repo).repo_id if args.push_to_hub else None
    except Exception as e:
        raise SystemExit(f"error: --push_to_hub: could not create the hub repo: {type(e).__name__}: {e}") from None


def check_launch(accelerator, args):
    """Refuse, before any work, what this launch cannot do; return whether the model is sharded across processes
    (DeepSpeed ZeRO-3 or FSDP), so that validation and the final save gather it on every process."""
    plugin = accelerator.state.deepspeed_plugin
    sharded = accelerator.distributed_type == DistributedType.FSDP or (plugin is not None and plugin.zero_stage == 3)
    if sharded and args.use_ema:  # the EMA is one full copy, but each process holds only its shard of the weights
        raise SystemExit("error: --use_ema needs whole weights on each process: use DDP or DeepSpeed ZeRO-1/2, not ZeRO-3 or FSDP")
    if plugin is not None and plugin.zero_stage == 3 and not plugin.zero3_save_16bit_model:
        raise SystemExit("error: DeepSpeed ZeRO-3 can only save the final model whole with `accelerate launch --zero3_save_16bit_model true`")
    if plugin is not None:  # DeepSpeed clips by its own config: "auto" takes --max_grad_norm, a number wins
        if plugin.deepspeed_config.get("gradient_clipping", "auto") == "auto":
            plugin.deepspeed_config["gradient_clipping"] = args.max_grad_norm
        logger.info(f"DeepSpeed clips gradients at norm {plugin.deepspeed_config['gradient_clipping']}")
    return sharded


def shared_seed(accelerator, seed):
    """The run's seed: the one given (or stored in the checkpoint), else one drawn on the main process and sent
    to all. Every random draw derives from it, so it is logged and stored in each checkpoint."""
    seed = broadcast_object_list([secrets.randbits(32) if seed is None else seed])[0]
    logger.info(f"Training with seed {seed}")
    return seed


def sample_seed(seed, epoch, row):
    """A 32-bit seed for one image in one epoch, the same in every process and run (Python's `hash` is salted
    per process; torch's CPU generator keeps 32 bits of a seed)."""
    return int(np.random.SeedSequence([seed, epoch, row]).generate_state(1)[0])


def preprocess_train(examples, args, train_transforms, tokenizer, num_train_timesteps, latent_shape, text_shape, weight_dtype, epoch):
    """A module-level function (and a `partial` of it) pickles, so dataloader workers can be spawned.

    Each image's crop, flip, caption choice, noise ε and timestep t come from a seed of (seed, epoch, row), not
    from the global random stream: the same draws however the run is batched, split across processes or resumed
    (the dataloader reads a batch ahead, which would shift a shared stream). With the caches, the stored encodings
    stand in for the image and the caption, picked by the same draws."""
    columns = {name: [] for name in ("pixel_values", "latent_moments", "captions", "text_embeddings", "noise", "perturbation",
                                     "timesteps", "latent_noise", "unreadable")}
    captions = examples[args.caption_column] if args.instance_prompt is None else [args.instance_prompt] * len(examples[ROW])
    for i, (caption, row) in enumerate(zip(captions, examples[ROW])):
        with torch.random.fork_rng(devices=[]):
            torch.default_generator.manual_seed(sample_seed(args.seed, epoch, row))  # CPU only: 100x cheaper than torch.manual_seed
            if args.cache_latents:  # one draw, as RandomHorizontalFlip makes (also at p = 0), picks the orientation
                flipped = int(torch.rand(1) < (0.5 if args.random_flip else 0.0))
                columns["latent_moments"].append(from_bytes(examples["latent_moments"][i], weight_dtype, (2 * latent_shape[0], *latent_shape[1:]))[flipped])
            else:
                image = open_image(examples[args.image_column][i])
                columns["unreadable"].append("" if image is not None else examples[args.image_column][i]["path"] or f"row {row}")  # the loop stops on it
                columns["pixel_values"].append(train_transforms((image if image is not None else Image.new("RGB", (1, 1))).convert("RGB")))
            choice = 0 if isinstance(caption, str) else int(torch.randint(len(caption), ()))  # one caption of a list
            if args.cache_text_embeddings:
                columns["text_embeddings"].append(from_bytes(examples["text_embeddings"][i], weight_dtype, text_shape)[choice])
            else:
                columns["captions"].append(caption if isinstance(caption, str) else caption[choice])
            noise = torch.randn(latent_shape)
            noise += args.noise_offset * torch.randn(latent_shape[0], 1, 1)  # shifts whole channels: learns brightness
            columns["noise"].append(noise)
            columns["perturbation"].append(args.input_perturbation * torch.randn(latent_shape))  # UNet input only
            columns["timesteps"].append(torch.randint(0, num_train_timesteps, ()))
            columns["latent_noise"].append(torch.randn(latent_shape))  # to sample the VAE's posterior
    if not args.cache_text_embeddings:
        columns["input_ids"] = list(tokenizer(columns["captions"], max_length=tokenizer.model_max_length,
                                              padding="max_length", truncation=True, return_tensors="pt").input_ids)
    return {name: values for name, values in columns.items() if values and name != "captions"}


def training_flops(model, args, *inputs):
    """The FLOPs of one forward and backward of the model on inputs of these shapes, counted by torch on a copy built
    on the meta device: no memory, no compute. (Counted on the real step, the backward rounds differently, and exact
    resume would be lost.) With gradient checkpointing the copy runs each block's forward twice, as training does."""
    with torch.device("meta"):
        copy = type(model).from_config(model.config)
    if args.gradient_checkpointing:
        copy.enable_gradient_checkpointing()
    inputs = [x.to("meta", torch.float32 if x.is_floating_point() else x.dtype) for x in inputs]  # fp32, as the copy is
    with FlopCounterMode(display=False) as counter:
        copy(*inputs, return_dict=False)[0].float().mean().backward()
    return counter.get_total_flops()


def cache_encodings(accelerator, args, dataset, vae, text_encoder, tokenizer, weight_dtype, encode_transforms):
    """Run the frozen encoders once per image, before training. --cache_latents keeps the VAE posterior's moments
    (mean and log-variance, both orientations with --random_flip), so each step still draws its own z_0 = μ + σ·ε;
    --cache_text_embeddings keeps the text encoder's output for each caption (each one of a list). `datasets.map`
    writes them to Arrow files in <--cache_dir or the datasets cache>/encodings, named by a fingerprint of what decides
    them, so a second run on the same data, models and flags reads them back. Each process encodes its share; then the
    encoders leave the accelerator until validation."""
    start, n = time.perf_counter(), accelerator.num_processes
    # "format 2": change it when what the files hold, or how images are decoded, changes (old files are not read then)
    key = ["format 2", dataset._fingerprint, args.image_column, args.caption_column, args.instance_prompt, args.pretrained_model_name_or_path,
           args.revision, args.variant, str(weight_dtype), args.resolution, args.image_interpolation_mode, args.random_flip,
           args.cache_latents, args.cache_text_embeddings]  # the data (its files and every change made to it), the models, the flags
    fingerprint = broadcast_object_list([hashlib.sha256(json.dumps(key).encode()).hexdigest()[:16]])[0]  # the main process's
    encode = dict(function=partial(encode_batch, args=args, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                                   encode_transforms=encode_transforms), batched=True, batch_size=args.train_batch_size,
                  remove_columns=dataset.column_names, desc="Encoding the training images once")
    folder = os.path.join(args.cache_dir or datasets.config.HF_DATASETS_CACHE, "encodings")
    os.makedirs(folder, exist_ok=True)

    def shard(i):  # process i's share: encoded, or read back from the file written when it was
        name = f"{fingerprint}-{i}-of-{n}"
        return dataset.shard(n, i, contiguous=True).map(**encode, new_fingerprint=name, load_from_cache_file=True,
                                                        cache_file_name=os.path.join(folder, f"{name}.arrow"))
    shard(accelerator.process_index)
    accelerator.wait_for_everyone()
    encodings = datasets.concatenate_datasets([shard(i) for i in range(n)])
    # The files hold the encodings alone, joined to the data's own columns without a copy; the images are no longer
    # read with the latents cached. A subset (--max_train_samples) indexes the data: written out once for the join.
    dataset = dataset.remove_columns(args.image_column) if args.cache_latents else dataset
    if dataset._indices is not None:
        with accelerator.main_process_first():  # the others read what the main process wrote
            dataset = dataset.flatten_indices()
    dataset = datasets.concatenate_datasets([dataset, encodings], axis=1)
    vae.to("cpu" if args.cache_latents else vae.device)
    text_encoder.to("cpu" if args.cache_text_embeddings else text_encoder.device)
    free_memory()
    stored = sum(len(dataset[0][c]) for c in ("latent_moments", "text_embeddings") if c in dataset.column_names)
    logger.info(f"Cached the encodings of {len(dataset)} images in {time.perf_counter() - start:.1f} s, {stored:,} bytes per image")
    return dataset


def encode_batch(examples, args, vae, text_encoder, tokenizer, encode_transforms):
    """A batch of the caches: the raw bytes of each image's VAE moments (unflipped, flipped) and of each caption's
    embeddings, in the frozen models' dtype."""
    columns, to_bytes = {}, lambda tensor: tensor.cpu().contiguous().view(torch.uint8).numpy().tobytes()
    with torch.no_grad():
        if args.cache_latents:
            images = [open_image(item) for item in examples[args.image_column]]
            for item, image, row in zip(examples[args.image_column], images, examples[ROW]):
                if image is None:
                    raise SystemExit(f"error: image {item['path'] or f'row {row}'} cannot be read")
            pixels = torch.stack([encode_transforms(image.convert("RGB")) for image in images]).to(vae.device, vae.dtype)
            moments = [vae.encode(p).latent_dist.parameters for p in ([pixels, pixels.flip(-1)] if args.random_flip else [pixels])]
            columns["latent_moments"] = [to_bytes(m) for m in torch.stack(moments, dim=1)]
        if args.cache_text_embeddings:
            captions = examples[args.caption_column] if args.instance_prompt is None else [args.instance_prompt] * len(examples[ROW])
            alternatives = [[c] if isinstance(c, str) else c for c in captions]
            input_ids = tokenizer(sum(alternatives, []), max_length=tokenizer.model_max_length, padding="max_length",
                                  truncation=True, return_tensors="pt").input_ids
            embeddings = text_encoder(input_ids.to(text_encoder.device), return_dict=False)[0]
            columns["text_embeddings"] = [to_bytes(e) for e in embeddings.split([len(a) for a in alternatives])]
    return columns


def from_bytes(data, dtype, shape):
    """Cached tensors back from their bytes: a stack of tensors of the given shape."""
    return torch.frombuffer(bytearray(data), dtype=dtype).view(-1, *shape)


def check_pipeline_folder(path):
    """A local base model must be a diffusers pipeline folder; anything else is a hub id."""
    if path.startswith(("/", ".", "~")) and not os.path.isdir(path):
        raise SystemExit(f"error: --pretrained_model_name_or_path {path} is not a folder")
    if os.path.isdir(path) and not os.path.isfile(os.path.join(path, "model_index.json")):
        raise SystemExit(f"error: --pretrained_model_name_or_path {path} is not a Stable Diffusion pipeline: no model_index.json")


def snr_loss_weights(noise_scheduler, timesteps, args):
    """Per-image loss weights from SNR(t) = ᾱ_t / (1 − ᾱ_t): min-SNR-γ caps the weight of the easy, nearly clean
    timesteps at γ. For ε that is min(SNR, γ) / SNR; a v target already carries SNR + 1, hence min(SNR, γ) / (SNR + 1)."""
    snr = compute_snr(noise_scheduler, timesteps)
    if args.snr_gamma is None:
        return torch.ones_like(snr)
    return snr.clamp(max=args.snr_gamma) / (snr if noise_scheduler.config.prediction_type == "epsilon" else snr + 1)


def load_train_dataset(args):
    """The training split, or one clear error naming the flag."""
    flag, source = ("--dataset_name", args.dataset_name) if args.dataset_name else ("--train_data_dir", args.train_data_dir)
    if args.dataset_name is None and not os.path.isdir(args.train_data_dir):
        raise SystemExit(f"error: --train_data_dir {args.train_data_dir} is not a folder")
    try:
        if args.dataset_name is not None:
            dataset = load_dataset(args.dataset_name, args.dataset_config_name, cache_dir=args.cache_dir,
                                   data_dir=args.train_data_dir, split="train")
        else:  # one pattern for every file below: given a data_dir, datasets globs ~60 split names over every file
            # (minutes for 100k images). A folder split into train/, test/ ... is still read the Diffusers way.
            split_dirs = SPLIT_NAMES & {name.lower() for name in os.listdir(args.train_data_dir)}
            files = {"data_dir": args.train_data_dir} if split_dirs else {"data_files": {"train": os.path.join(args.train_data_dir, "**")}}
            dataset = load_dataset("imagefolder", **files, cache_dir=args.cache_dir, split="train")
    except Exception as e:  # datasets raises many kinds: say which input failed, and why
        raise SystemExit(f"error: could not load {flag} {source}: {type(e).__name__}: {e}") from None
    if len(dataset) == 0:
        raise SystemExit(f"error: {flag} {source} has no images")
    return dataset


def add_captions(dataset, args):
    """Captions come from --instance_prompt (every image), else the caption column (metadata.jsonl or a hub
    dataset), else a text file beside each image (0001.png + 0001.txt, kohya's layout), read once into that column."""
    if args.instance_prompt is not None:
        logger.info(f'Every image is captioned "{args.instance_prompt}" (--instance_prompt)')
    elif args.caption_column not in dataset.column_names and args.dataset_name is None:
        dataset = dataset.map(read_caption_files, input_columns=args.image_column, batched=True, desc="Reading captions",
                              fn_kwargs={"column": args.caption_column, "extension": args.caption_extension})
    elif args.caption_column not in dataset.column_names:
        raise SystemExit(f"error: --caption_column '{args.caption_column}' is not in the dataset; its columns are "
                         f"{dataset.column_names} (or give --instance_prompt)")
    return dataset


def read_caption_files(items, column, extension):
    paths = [os.path.splitext(item["path"] or "")[0] + extension for item in items]
    return {column: [Path(path).read_text(encoding="utf-8-sig").strip() if os.path.isfile(path) else None for path in paths]}


def check_captions(dataset, args):
    """Every image needs a caption: a string or a non-empty list of strings. Name the first row that has none."""
    for i, caption in enumerate(dataset[args.caption_column]):
        if caption is None:  # no caption file beside it
            path = dataset[i][args.image_column]["path"]
            raise SystemExit(f"error: image {path} has no caption: add a metadata.jsonl with a '{args.caption_column}' column, "
                             f"a caption file beside each image ({os.path.splitext(path)[0] + args.caption_extension}; see "
                             "--caption_extension), or give --instance_prompt")
        if not (isinstance(caption, str) or (isinstance(caption, list) and caption and all(isinstance(c, str) for c in caption))):
            raise SystemExit(f"error: --caption_column '{args.caption_column}' row {i} is {caption!r}: give a string or a list of strings")


def open_image(item):
    """Decode one image of a column cast to `Image(decode=False)` as `datasets` would (turned upright by its EXIF
    orientation, as phone photos need); None if the file is broken. It decodes it all: a truncated JPEG passes
    Image.verify() but fails here."""
    try:
        return datasets.Image().decode_example(item)
    except Exception:
        return None


def check_images(dataset, column):
    """Decode every image once before training (small datasets), so a broken file stops the run now, by name."""
    for item in dataset.select_columns([column, ROW]):
        if open_image(item[column]) is None:
            raise SystemExit(f"error: image {item[column]['path'] or f'row {item[ROW]}'} cannot be read")


def stop_on_unreadable(batch, args):
    """A large dataset's images are decoded as they load: a broken one ends the run here, by name."""
    for name in batch.get("unreadable", ()):  # none with --cache_latents: the images were read when cached
        if name:
            found = [d for d in os.listdir(args.output_dir) if is_checkpoint_name(d)] if os.path.isdir(args.output_dir) else []
            last = f"; fix or remove it and resume from {max(found, key=lambda d: int(d[11:]))}" if found else ""
            raise SystemExit(f"error: image {name} cannot be read{last}")


def find_checkpoint(accelerator, args):
    """The checkpoint to resume from and its training_state.json, or (None, None) for `latest` when there is none.
    A named checkpoint must exist; any checkpoint must be complete and from a run this launch can continue."""
    name, output_dir = args.resume_from_checkpoint, args.output_dir
    if name == "latest":
        found = [d for d in os.listdir(output_dir) if is_checkpoint_name(d)] if os.path.isdir(output_dir) else []
        if not found:
            return None, None
        path = os.path.join(output_dir, max(found, key=lambda d: int(d[11:])))
    else:
        path = os.path.join(output_dir, os.path.basename(os.path.normpath(name)))
        if not os.path.exists(path):  # starting afresh would let rotation delete the new run's checkpoints
            raise SystemExit(f"error: --resume_from_checkpoint {path} does not exist (`latest` starts afresh when there is none)")
    try:
        with open(os.path.join(path, "training_state.json")) as f:
            state = json.load(f)
    except (OSError, ValueError):
        state = {}
    if not is_checkpoint_name(os.path.basename(path)) or state.get("trainer") != TRAINER:
        raise SystemExit(f"error: --resume_from_checkpoint {path} is not a checkpoint-N folder written by {TRAINER}.py")
    for file, size in state["files"].items():  # a partial copy or a truncated file fails here, not mid-load
        if not os.path.isfile(os.path.join(path, file)) or os.path.getsize(os.path.join(path, file)) != size:
            raise SystemExit(f"error: checkpoint {path} is incomplete: {file} is missing or not the {size} bytes written")
    if args.seed is not None and args.seed != state["seed"]:
        raise SystemExit(f"error: --seed {args.seed} differs from the seed {state['seed']} of {path}: leave it out to resume")
    saved, now = state["launch"], launch_shape(accelerator, args)
    # A step is a number of images: with the same number per step, the step count and the data order mean the same
    # however they are split. A sharded optimizer state must be loaded into as many shards as were saved.
    if math.prod(saved[k] for k in PER_STEP) != math.prod(now[k] for k in PER_STEP) or saved["sharded_by"] != now["sharded_by"] \
            or (now["sharded_by"] and saved["num_processes"] != now["num_processes"]):
        raise SystemExit(f"error: {path} was trained with {saved}; this launch has {now}: resume with the same images per step"
                         " (and, under DeepSpeed or FSDP, the same processes)")
    return path, state


def launch_shape(accelerator, args):
    sharded_by = accelerator.distributed_type.value if accelerator.distributed_type in SHARDING else None
    return {"num_processes": accelerator.num_processes, "train_batch_size": args.train_batch_size,
            "gradient_accumulation_steps": args.gradient_accumulation_steps, "sharded_by": sharded_by}


def is_checkpoint_name(name):
    return name.startswith("checkpoint-") and name[len("checkpoint-"):].isdigit()


def save_checkpoint(accelerator, args, global_step):
    """Rotate, then save to a temporary folder and rename it: a crash mid-save leaves no broken checkpoint-N.
    training_state.json records the run (seed, launch) and every file's size, to check it before a resume."""
    final = os.path.join(args.output_dir, f"checkpoint-{global_step}")
    tmp = os.path.join(args.output_dir, f"tmp-checkpoint-{global_step}")
    if accelerator.is_main_process:
        if args.checkpoints_total_limit is not None:
            old = sorted((d for d in os.listdir(args.output_dir) if is_checkpoint_name(d)), key=lambda d: int(d[11:]))
            for d in old[: max(0, len(old) - args.checkpoints_total_limit + 1)]:
                shutil.rmtree(os.path.join(args.output_dir, d))
        shutil.rmtree(tmp, ignore_errors=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(tmp)  # every process writes its own RNG state (and its shard, when sharded)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        files = {os.path.relpath(os.path.join(d, f), tmp): os.path.getsize(os.path.join(d, f))
                 for d, _, names in os.walk(tmp) for f in names}
        state = {"trainer": TRAINER, "global_step": global_step, "seed": args.seed,
                 "launch": launch_shape(accelerator, args), "files": files}
        with open(os.path.join(tmp, "training_state.json"), "w") as f:
            json.dump(state, f, indent=1)
        shutil.rmtree(final, ignore_errors=True)
        os.rename(tmp, final)
        logger.info(f"Saved state to {final}")
    accelerator.wait_for_everyone()


def save_model_hook(accelerator, args, ema_model, models, weights, output_dir):
    if accelerator.is_main_process:
        if ema_model is not None:
            ema_model.save_pretrained(os.path.join(output_dir, "unet_ema"))
        if weights:  # plain or DDP: the UNet as a `save_pretrained` folder, instead of accelerate's copy
            accelerator.unwrap_model(models[0], keep_torch_compile=False).save_pretrained(os.path.join(output_dir, "unet"))
    if weights:
        weights.pop()


def load_model_hook(accelerator, args, ema_model, models, input_dir):
    if ema_model is not None:
        if not os.path.isdir(os.path.join(input_dir, "unet_ema")):
            raise SystemExit(f"error: {input_dir} holds no EMA weights (its run had no --use_ema): resume without --use_ema")
        loaded = EMAModel.from_pretrained(os.path.join(input_dir, "unet_ema"), UNet2DConditionModel, foreach=args.foreach_ema)
        ema_model.load_state_dict(loaded.state_dict())
        ema_model.to("cpu" if args.offload_ema else accelerator.device)
    if models:  # plain or DDP; DeepSpeed and FSDP have loaded the model already
        loaded = UNet2DConditionModel.from_pretrained(input_dir, subfolder="unet")
        accelerator.unwrap_model(models.pop(), keep_torch_compile=False).load_state_dict(loaded.state_dict())


def full_model(accelerator, model, sharded):
    """The trained model, whole, on the main process (None on the others). A sharded model is gathered from all
    processes, which must all call this; the compiled wrapper is dropped, so weights keep their plain names."""
    accelerator.wait_for_everyone()
    unet = accelerator.unwrap_model(model, keep_torch_compile=False)
    if sharded:
        state_dict = accelerator.get_state_dict(model)  # whole on the main process
        if accelerator.is_main_process:
            unet = type(unet).from_config(unet.config)
            unet.load_state_dict(state_dict)
    return unet if accelerator.is_main_process else None


def log_validation(accelerator, args, vae, text_encoder, tokenizer, model, ema_model, noise_scheduler, global_step, sharded):
    if not (accelerator.is_main_process or sharded):
        return
    unet = accelerator.unwrap_model(model, keep_torch_compile=False)
    unet.eval()  # no dropout while sampling (a config may set some); train() again below
    if ema_model is not None:  # sample with the EMA weights, then put the training weights back
        ema_model.store(unet.parameters())
        ema_model.copy_to(unet.parameters())
    # Built from the modules already in memory (no second VAE or text encoder), the training UNet never
    # cast; a multistep solver gives a fair picture in 20 steps.
    pipeline = StableDiffusionPipeline(
        vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, unet=unet,
        scheduler=DPMSolverMultistepScheduler.from_config(noise_scheduler.config),
        safety_checker=None, feature_extractor=None, requires_safety_checker=False,
    )
    pipeline.set_progress_bar_config(disable=True)
    generator = torch.Generator("cpu").manual_seed(args.seed)  # the same starting noise every time
    with accelerator.autocast(), offload_models(vae, text_encoder, device=accelerator.device):  # back after caching
        images = pipeline(args.validation_prompts, num_inference_steps=20, generator=generator,
                          height=args.resolution, width=args.resolution, output_type="np").images
    if ema_model is not None:
        ema_model.restore(unet.parameters())
    unet.train()
    if not accelerator.is_main_process:
        return
    os.makedirs(os.path.join(args.output_dir, "samples"), exist_ok=True)
    grid = torch.from_numpy(images).permute(0, 3, 1, 2)
    torchvision.utils.save_image(grid, os.path.join(args.output_dir, "samples", f"step-{global_step}.png"),
                                 nrow=math.ceil(math.sqrt(len(grid))))
    for tracker in accelerator.trackers:
        if tracker.name == "tensorboard":
            tracker.writer.add_images("validation", images, global_step, dataformats="NHWC")
        elif tracker.name == "wandb":
            import wandb
            tracker.log({"validation": [wandb.Image(image, caption=prompt)
                                        for image, prompt in zip(images, args.validation_prompts)]}, step=global_step)


def write_model_card(args, global_step):
    data = args.dataset_name or args.train_data_dir
    command = shlex.join(["accelerate", "launch", os.path.basename(__file__), *sys.argv[1:]])  # reruns this training
    grid = f"samples/step-{global_step}.png"
    lines = [
        "---", f"base_model: {args.pretrained_model_name_or_path}", "library_name: diffusers",
        "tags: [stable-diffusion, text-to-image, diffusers]", "---", "",
        f"# Fine-tune of {args.pretrained_model_name_or_path}", "",
        f"The UNet of `{args.pretrained_model_name_or_path}` trained on `{data}` for {global_step} steps "
        f"with `train_text_to_image.py`; the VAE, text encoder and tokenizer are the base model's.", "",
        "```python", "from diffusers import DiffusionPipeline",
        f'pipe = DiffusionPipeline.from_pretrained("{args.output_dir}")', "```", "",
        "Trained with:", "", "```bash", command, "```",
    ]
    if os.path.isfile(os.path.join(args.output_dir, grid)):
        lines += ["", f"Validation prompts: {args.validation_prompts}", "", f"![samples]({grid})"]
    with open(os.path.join(args.output_dir, "README.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main(parse_args())
