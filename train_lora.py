#!/usr/bin/env python
"""train_lora.py: teach Stable Diffusion 1.x a subject or a style with LoRA, on a few captioned images.

The training of train_text_to_image.py, but the UNet stays frozen: LoRA (Hu et al. 2021) adds to
chosen linear layers W a low-rank update, W' = W + (α/r)·B·A with A: r×in and B: out×r, and trains
only A and B (B starts at zero, so training starts from the base model). Rank 4 on SD 1.5's
attention is ~0.8 M parameters, a 3 MB file, instead of the UNet's 860 M.

    accelerate launch train_lora.py --pretrained_model_name_or_path PATH_OR_HUB_ID \
        --train_data_dir my_photos --instance_prompt "a photo of sks dog" --resolution 512 --train_batch_size 1

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
from diffusers.training_utils import EMAModel, cast_training_params, compute_snr, free_memory, offload_models
from diffusers.utils import convert_all_state_dict_to_peft, convert_state_dict_to_diffusers, convert_state_dict_to_kohya
from huggingface_hub import create_repo, upload_folder
from peft import LoraConfig, get_peft_model_state_dict, set_peft_model_state_dict
from PIL import Image
from safetensors.torch import save_file
from torch.utils.flop_counter import FlopCounterMode
from torchvision import transforms
from tqdm.auto import tqdm
from transformers import CLIPTextModel, CLIPTokenizer

logger = get_logger(__name__)
TRAINER = "train_lora"  # recorded in checkpoints: another script's checkpoint is refused
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
TEXT_ENCODER_TARGETS = ["q_proj", "k_proj", "v_proj", "out_proj"]  # CLIP's attention projections


# 1. Arguments: the Diffusers example's flags and defaults, so existing commands work unchanged
def parse_args(argv=None):
    p = argparse.ArgumentParser(description="Train a LoRA adapter for a Stable Diffusion 1.x pipeline.")
    p.add_argument("--pretrained_model_name_or_path", default=None, help="A hub id or a local pipeline folder.")
    p.add_argument("--revision", default=None)
    p.add_argument("--variant", default=None, help='Weights variant to load, e.g. "fp16".')
    p.add_argument("--dataset_name", default=None, help="A hub dataset id, or a local dataset folder.")
    p.add_argument("--dataset_config_name", default=None)
    p.add_argument("--train_data_dir", default=None, help="A `datasets` imagefolder (used if no --dataset_name).")
    p.add_argument("--image_column", default="image", help="The dataset column that holds the images.")
    p.add_argument("--caption_column", default="text", help="The column with a caption or a list of captions.")
    p.add_argument("--caption_extension", default=".txt", help="Without a caption column: the caption file beside each image.")
    p.add_argument("--instance_prompt", default=None, help='The caption of every image, e.g. "a photo of sks dog".')
    p.add_argument("--max_train_samples", type=int, default=None, help="Train on a seeded random subset.")
    p.add_argument("--validation_prompt", default=None, help="A prompt sampled with and without the LoRA.")
    p.add_argument("--validation_prompts", nargs="+", default=None, help="Several prompts: a row of the grid each.")
    p.add_argument("--num_validation_images", type=int, default=4, help="Images per prompt, with fixed seeds.")
    p.add_argument("--validation_epochs", type=int, default=1, help="Sample the validation prompts every N epochs.")
    p.add_argument("--validation_steps", type=int, default=None, help="Also sample them every N steps.")
    p.add_argument("--output_dir", default="sd-model-finetuned-lora")
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
    p.add_argument("--rank", type=int, default=4, help="The rank r of each LoRA update.")
    p.add_argument("--lora_alpha", type=float, default=None, help="The update is scaled by alpha / rank; default: rank.")
    p.add_argument("--lora_dropout", type=float, default=0.0)
    p.add_argument("--lora_target_modules", default="to_q,to_k,to_v,to_out.0",
                   help="UNet layers that get LoRA; kohya adds proj_in,proj_out,ff.net.0.proj,ff.net.2.")
    p.add_argument("--train_text_encoder", action="store_true", help="Add LoRA to the text encoder's attention too.")
    p.add_argument("--learning_rate", type=float, default=1e-4)
    p.add_argument("--text_encoder_lr", type=float, default=None, help="Default: --learning_rate.")
    p.add_argument("--scale_lr", action="store_true", help="Multiply the LR by the total batch size.")
    p.add_argument("--lr_scheduler", default="constant", choices=[s.value for s in SchedulerType])
    p.add_argument("--lr_warmup_steps", type=int, default=500)
    p.add_argument("--adam_beta1", type=float, default=0.9)
    p.add_argument("--adam_beta2", type=float, default=0.999)
    p.add_argument("--adam_weight_decay", type=float, default=1e-2)
    p.add_argument("--adam_epsilon", type=float, default=1e-08)
    p.add_argument("--use_8bit_adam", action="store_true", help="bitsandbytes' 8-bit AdamW (GPU).")
    p.add_argument("--max_grad_norm", type=float, default=1.0)
    p.add_argument("--use_ema", action="store_true", help="Keep an exponential moving average of the LoRA weights.")
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
    if args.cache_text_embeddings and args.train_text_encoder:
        p.error("--cache_text_embeddings cannot be used with --train_text_encoder: its embeddings change as it learns")
    if args.rank < 1:
        p.error(f"--rank must be a positive integer, not {args.rank}")
    if args.lora_alpha is not None and args.lora_alpha <= 0:  # alpha / rank scales the update: at 0 nothing would learn
        p.error(f"--lora_alpha must be positive, not {args.lora_alpha:g}")
    if not 0 <= args.lora_dropout < 1:
        p.error(f"--lora_dropout must be in [0, 1), not {args.lora_dropout:g}")
    args.lora_alpha = args.rank if args.lora_alpha is None else args.lora_alpha
    args.text_encoder_lr = args.learning_rate if args.text_encoder_lr is None else args.text_encoder_lr
    args.validation_prompts = args.validation_prompts or ([args.validation_prompt] if args.validation_prompt else None)
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
    check_launch(accelerator, args)
    resume_path, resume_state = find_checkpoint(accelerator, args) if args.resume_from_checkpoint else (None, None)
    repo_id = create_hub_repo(args) if accelerator.is_main_process else None
    args.seed = shared_seed(accelerator, args.seed if resume_state is None else resume_state["seed"])
    accelerator.dataloader_config.data_seed = args.seed
    set_seed(args.seed)
    if args.allow_tf32:
        torch.backends.cuda.matmul.allow_tf32 = True

    # 3. Models: the noise schedule, tokenizer and text encoder, VAE and UNet of the base pipeline, all frozen;
    #    LoRA adapters on the UNet (and text encoder) are all that trains
    check_pipeline_folder(args.pretrained_model_name_or_path)
    load = dict(pretrained_model_name_or_path=args.pretrained_model_name_or_path, revision=args.revision,
                cache_dir=args.cache_dir)
    noise_scheduler = DDPMScheduler.from_pretrained(subfolder="scheduler", **load)
    if args.prediction_type is not None:
        noise_scheduler.register_to_config(prediction_type=args.prediction_type)
    if noise_scheduler.config.prediction_type not in ("epsilon", "v_prediction"):  # the loss below knows these two
        raise SystemExit(f"error: the base scheduler predicts '{noise_scheduler.config.prediction_type}': "
                         "give --prediction_type epsilon or v_prediction")
    tokenizer = CLIPTokenizer.from_pretrained(subfolder="tokenizer", **load)
    text_encoder = CLIPTextModel.from_pretrained(subfolder="text_encoder", variant=args.variant, **load)
    vae = AutoencoderKL.from_pretrained(subfolder="vae", variant=args.variant, **load)
    model = UNet2DConditionModel.from_pretrained(subfolder="unet", variant=args.variant, **load)
    downsampling = 2 ** (len(vae.config.block_out_channels) - 1)
    if args.resolution % downsampling:
        raise SystemExit(f"error: --resolution {args.resolution} must be a multiple of {downsampling}, the VAE's downsampling factor.")
    # All three are frozen and stored in the mixed-precision dtype: half the memory, and nothing of them is learned
    weight_dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(accelerator.mixed_precision, torch.float32)
    for frozen in (vae, text_encoder, model):
        frozen.requires_grad_(False).to(accelerator.device, dtype=weight_dtype)
    # A and B start as Gaussian and zero (diffusers' recipe): W' = W at step 0. α/r scales the update, so with
    # alpha = rank a learning rate means the same at any rank.
    lora = dict(r=args.rank, lora_alpha=args.lora_alpha, lora_dropout=args.lora_dropout, init_lora_weights="gaussian")
    targets = [name.strip() for name in args.lora_target_modules.split(",")]  # "to_q, to_k" works too
    check_lora_targets(model, targets)
    model.add_adapter(LoraConfig(**lora, target_modules=targets))
    if args.train_text_encoder:
        text_encoder.add_adapter(LoraConfig(**lora, target_modules=TEXT_ENCODER_TARGETS))
    trained = [model, text_encoder] if args.train_text_encoder else [model]
    if accelerator.mixed_precision in ("fp16", "bf16"):  # the trained A and B in fp32: fp16 gradients cannot be
        cast_training_params(trained, dtype=torch.float32)  # unscaled, and bf16 updates of 1e-4 would round away
    lora_params = [p for m in trained for p in m.parameters() if p.requires_grad]  # a list: optimizer and clipping
    logger.info(f"Training {sum(p.numel() for p in lora_params):,} LoRA parameters ({lora_params[0].dtype}); "
                f"the frozen weights are {weight_dtype}")
    if args.gradient_checkpointing:
        model.enable_gradient_checkpointing()
        if args.train_text_encoder:
            text_encoder.gradient_checkpointing_enable()
    if args.enable_xformers_memory_efficient_attention and importlib.util.find_spec("xformers") is None:
        logger.info("xformers is not installed: PyTorch's scaled-dot-product attention, the default, is used")
    elif args.enable_xformers_memory_efficient_attention:
        model.enable_xformers_memory_efficient_attention()
    if args.use_ema:  # an average of the LoRA weights alone
        ema_model = EMAModel(lora_params)

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
        args.text_encoder_lr *= args.gradient_accumulation_steps * args.train_batch_size * accelerator.num_processes
    if args.use_8bit_adam:
        import bitsandbytes as bnb
        optimizer_cls = bnb.optim.AdamW8bit
    else:
        optimizer_cls = torch.optim.AdamW
    optimizer = optimizer_cls(
        [{"params": [p for p in m.parameters() if p.requires_grad], "lr": lr} for m, lr in zip(trained, [args.learning_rate, args.text_encoder_lr])],
        betas=(args.adam_beta1, args.adam_beta2), weight_decay=args.adam_weight_decay, eps=args.adam_epsilon,
    )
    num_update_steps_per_epoch = math.ceil(math.ceil(len(train_dataloader) / accelerator.num_processes) / args.gradient_accumulation_steps)
    if args.max_train_steps is None:
        args.max_train_steps = args.num_train_epochs * num_update_steps_per_epoch
    args.num_train_epochs = math.ceil(args.max_train_steps / num_update_steps_per_epoch)
    lr_scheduler = get_scheduler(
        args.lr_scheduler, optimizer=optimizer, num_warmup_steps=args.lr_warmup_steps, num_training_steps=args.max_train_steps,
    )
    if args.train_text_encoder:
        model, text_encoder, optimizer, train_dataloader, lr_scheduler = accelerator.prepare(model, text_encoder, optimizer, train_dataloader, lr_scheduler)
    else:
        model, optimizer, train_dataloader, lr_scheduler = accelerator.prepare(model, optimizer, train_dataloader, lr_scheduler)
    trained = [model, text_encoder] if args.train_text_encoder else [model]
    # Under DeepSpeed the model itself holds the mixed-precision dtype and no autocast is added: feed it that dtype
    input_dtype = accelerator.unwrap_model(model).dtype if accelerator.distributed_type == DistributedType.DEEPSPEED else torch.float32
    if is_compiled_module(model) or has_compiled_regions(model):
        logger.info(f"The model is compiled with torch.compile ({accelerator.state.dynamo_plugin.backend.value.lower()})")

    # 6. Checkpoint hooks and resume. With plain or DDP training accelerate hands the hooks the weights to store:
    #    they write the LoRA weights alone, as the file load_lora_weights reads, and pop the weights so the frozen
    #    UNet is not stored. DeepSpeed stores the model its own way (trained weights only) and hands empty lists.
    accelerator.register_save_state_pre_hook(partial(save_model_hook, accelerator, args, ema_model if args.use_ema else None))
    accelerator.register_load_state_pre_hook(partial(load_model_hook, accelerator, args, ema_model if args.use_ema else None))
    global_step, first_epoch, resume_step = 0, 0, 0
    if resume_path:
        logger.info(f"Resuming from {resume_path}")
        accelerator.load_state(resume_path, **({"load_module_strict": False} if accelerator.distributed_type == DistributedType.DEEPSPEED else {}))
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
        for m in trained:
            m.train()
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
                if not args.train_text_encoder:  # frozen: cached, or encoded now without a graph
                    encoder_hidden_states = batch["text_embeddings"] if args.cache_text_embeddings else \
                        text_encoder(batch["input_ids"], return_dict=False)[0]
            # The forward process in closed form: z_t = √ᾱ_t·z_0 + √(1−ᾱ_t)·ε (ε perturbed if asked)
            noisy_latents = noise_scheduler.add_noise(latents, noise + batch["perturbation"], timesteps)
            if flops is None:  # once, at the first micro-batch: the frozen models' and the trained pass's
                text = batch["input_ids"] if args.train_text_encoder else encoder_hidden_states
                unet, encoder = (accelerator.unwrap_model(m, keep_torch_compile=False) for m in (model, text_encoder))
                flops = [counter.get_total_flops(), training_flops(unet, encoder, args, noisy_latents, timesteps, text)]
                logger.info(f"One micro-batch of {len(timesteps)} images: {'text encoder and ' * args.train_text_encoder}UNet forward "
                            f"and backward {flops[1]:.4g} FLOPs, frozen {'VAE' if args.train_text_encoder else 'VAE and text encoder'} {flops[0]:.4g}")

            with accelerator.accumulate(*trained):
                if args.train_text_encoder:  # its LoRA learns: encoded with a graph
                    encoder_hidden_states = text_encoder(batch["input_ids"], return_dict=False)[0]
                if noise_scheduler.config.prediction_type == "epsilon":
                    target = noise
                else:  # v = √ᾱ_t·ε − √(1−ᾱ_t)·z_0
                    target = noise_scheduler.get_velocity(latents, noise, timesteps)
                model_output = model(noisy_latents.to(input_dtype), timesteps, encoder_hidden_states.to(input_dtype), return_dict=False)[0]
                # the same loss as Algorithm 1, now on latents; one value per image so it can be weighted
                loss = F.mse_loss(model_output.float(), target.float(), reduction="none").mean(dim=[1, 2, 3])
                loss = (loss * snr_loss_weights(noise_scheduler, timesteps, args)).mean()
                train_loss += loss.detach() / args.gradient_accumulation_steps  # stays on the device: no sync
                accelerator.backward(loss)
                if accelerator.sync_gradients:  # a no-op under DeepSpeed, which clips by its own config
                    accelerator.clip_grad_norm_(lora_params, args.max_grad_norm)
                optimizer.step()
                optimizer.zero_grad()

            if accelerator.sync_gradients:  # an optimizer step happened
                lr_scheduler.step()
                if args.use_ema:
                    ema_model.step(lora_params)
                global_step += 1
                train_loss = accelerator.reduce(train_loss, "mean").item()  # the mean over all processes, for the log
                seconds = time.perf_counter() - step_start
                tflops = flops[1] * args.gradient_accumulation_steps / seconds / 1e12  # the trained pass's, on each process
                logs = {"train_loss": train_loss, "lr": lr_scheduler.get_last_lr()[0], "img/s": total_batch_size / seconds,
                        "tflops": tflops, **({"mfu": tflops / peak} if peak else {})}
                progress_bar.update(1)
                progress_bar.set_postfix(loss=train_loss, img_s=f"{logs['img/s']:.1f}", tflops=f"{tflops:.3g}")
                accelerator.log(logs, step=global_step)
                if global_step % args.checkpointing_steps == 0:
                    save_checkpoint(accelerator, args, global_step)
                if args.validation_prompts and args.validation_steps and global_step % args.validation_steps == 0:
                    log_validation(accelerator, args, vae, text_encoder, tokenizer, model, ema_model if args.use_ema else None,
                                   lora_params, noise_scheduler, global_step)
                train_loss, step_start = torch.zeros((), device=accelerator.device), time.perf_counter()
            if global_step >= args.max_train_steps:
                break

        # 8. Validation: the validation prompts with fixed seeds (EMA weights if used), without and with the LoRA,
        #    logged and saved, on the main process.
        last_epoch = epoch == args.num_train_epochs - 1 or global_step >= args.max_train_steps
        if args.validation_prompts and (epoch % args.validation_epochs == 0 or last_epoch):
            log_validation(accelerator, args, vae, text_encoder, tokenizer, model, ema_model if args.use_ema else None,
                           lora_params, noise_scheduler, global_step)
        step_start = time.perf_counter()
        if global_step >= args.max_train_steps:
            break

    # 9. Final save: the LoRA weights (EMA if --use_ema) as diffusers writes them, and in kohya's format for
    #    ComfyUI and A1111. Then the saved file replaces the live adapter in the same modules and the validation
    #    prompts run once more: proof that the file holds what was trained.
    progress_bar.close()
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        unet, text_encoder = (accelerator.unwrap_model(m, keep_torch_compile=False) for m in (model, text_encoder))
        if args.use_ema:
            ema_model.copy_to(lora_params)
        save_lora(unet, text_encoder if args.train_text_encoder else None, args.output_dir)
        save_kohya(args, unet, text_encoder if args.train_text_encoder else None)
        write_model_card(args, global_step)
        logger.info(f"Saved the LoRA weights to {args.output_dir}")
        if args.validation_prompts:
            pipeline = StableDiffusionPipeline(vae, text_encoder, tokenizer, unet, noise_scheduler, None, None, requires_safety_checker=False)
            pipeline.unload_lora_weights()
            pipeline.load_lora_weights(args.output_dir)
            log_validation(accelerator, args, vae, text_encoder, tokenizer, unet, None, lora_params, noise_scheduler, global_step, "final")
        if torch.cuda.is_available():
            print(f"Peak GPU memory: {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB")
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
    """Refuse, before any work, what this launch cannot do. LoRA needs no sharding: the frozen model is stored in
    16 bits and fits wherever it can be sampled; each process holds it whole."""
    plugin = accelerator.state.deepspeed_plugin
    if accelerator.distributed_type == DistributedType.FSDP or (plugin is not None and plugin.zero_stage == 3):
        raise SystemExit("error: train_lora.py keeps the frozen model whole on each process: use DDP or DeepSpeed ZeRO-1/2, not ZeRO-3 or FSDP")
    if plugin is not None and args.train_text_encoder:  # accelerate hands DeepSpeed a single model
        raise SystemExit("error: --train_text_encoder does not work under DeepSpeed (it trains one model): use DDP")
    if plugin is not None:  # DeepSpeed clips by its own config: "auto" takes --max_grad_norm, a number wins
        if plugin.deepspeed_config.get("gradient_clipping", "auto") == "auto":
            plugin.deepspeed_config["gradient_clipping"] = args.max_grad_norm
        logger.info(f"DeepSpeed clips gradients at norm {plugin.deepspeed_config['gradient_clipping']}")


def check_lora_targets(unet, targets):
    """peft complains only when no name matches; a typo among several names would silently train less. Check each."""
    names = [name for name, module in unet.named_modules() if isinstance(module, (torch.nn.Linear, torch.nn.Conv2d))]
    for target in targets:
        if not any(name == target or name.endswith("." + target) for name in names):
            examples = sorted({".".join(n.split(".")[-2 if n.split(".")[-1].isdigit() else -1:]) for n in names})
            raise SystemExit(f"error: --lora_target_modules '{target}' matches no layer of the UNet; some that exist: {', '.join(examples[:16])}")


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


def training_flops(model, text_encoder, args, noisy_latents, timesteps, text):
    """The FLOPs of one forward and backward of the UNet with its LoRA (and, with --train_text_encoder, of the text
    encoder with its LoRA, then `text` is the token ids; else the frozen encoder's output) on inputs of these shapes,
    counted by torch on copies built on the meta device: no memory, no compute. (Counted on the real step, the backward
    rounds differently, and exact resume would be lost.) With gradient checkpointing the copies run it as training does."""
    with torch.device("meta"):
        unet = type(model).from_config(model.config)
        unet.add_adapter(model.peft_config["default"])
        encoder = type(text_encoder)(text_encoder.config) if args.train_text_encoder else None
        if encoder is not None:
            encoder.add_adapter(text_encoder.peft_config["default"])
    if args.gradient_checkpointing:
        unet.enable_gradient_checkpointing()
        if encoder is not None:
            encoder.gradient_checkpointing_enable()
    with FlopCounterMode(display=False) as counter:  # inputs in fp32, as the copies are
        states = encoder(text.to("meta"), return_dict=False)[0] if encoder is not None else text.to("meta", torch.float32)
        unet(noisy_latents.to("meta", torch.float32), timesteps.to("meta"), states, return_dict=False)[0].float().mean().backward()
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
    trained_only = {"exclude_frozen_parameters": True} if accelerator.distributed_type == DistributedType.DEEPSPEED else {}
    accelerator.save_state(tmp, **trained_only)  # every process writes its own RNG state (and its shard, when sharded)
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
            torch.save(ema_model.state_dict(), os.path.join(output_dir, "lora_ema.pt"))
        if weights:  # plain or DDP: the LoRA weights alone, instead of accelerate's copy of every weight
            unet, *text_encoder = (accelerator.unwrap_model(m, keep_torch_compile=False) for m in models)
            save_lora(unet, text_encoder[0] if text_encoder else None, output_dir)
    while weights:
        weights.pop()


def load_model_hook(accelerator, args, ema_model, models, input_dir):
    if ema_model is not None and not os.path.isfile(os.path.join(input_dir, "lora_ema.pt")):
        raise SystemExit(f"error: {input_dir} holds no EMA weights (its run had no --use_ema): resume without --use_ema")
    if models:  # plain or DDP; DeepSpeed has loaded the model already
        state_dict = StableDiffusionPipeline.lora_state_dict(input_dir)[0]
        if any(k.startswith("text_encoder.") for k in state_dict) != args.train_text_encoder:  # else the optimizer's groups differ
            raise SystemExit(f"error: the LoRA in {input_dir} does not fit this run's adapters: resume with its --train_text_encoder")
        for model, prefix in zip(models, ["unet.", "text_encoder."]):  # in the order they were prepared
            layers = convert_all_state_dict_to_peft({k[len(prefix):]: v for k, v in state_dict.items() if k.startswith(prefix)})
            try:  # another --rank gives other shapes; other --lora_target_modules, other names
                loaded = set_peft_model_state_dict(accelerator.unwrap_model(model, keep_torch_compile=False), layers)
                fits = not loaded.unexpected_keys and not any("lora_" in k for k in loaded.missing_keys)
            except RuntimeError:
                fits = False
            if not fits:
                raise SystemExit(f"error: the LoRA in {input_dir} does not fit this run's adapters: resume with its --rank and --lora_target_modules")
        models.clear()
    if ema_model is not None:
        ema_model.load_state_dict(torch.load(os.path.join(input_dir, "lora_ema.pt"), weights_only=True))
        ema_model.to(accelerator.device)


def save_lora(unet, text_encoder, output_dir):
    """The A and B matrices as diffusers writes them (`unet.`, `text_encoder.` keys), with each adapter's config
    in the file's metadata: load_lora_weights then scales by the trained alpha / rank, not by 1. The config says
    dropout 0: dropout is for training, and diffusers would load the UNet's in training mode, active when sampling."""
    StableDiffusionPipeline.save_lora_weights(
        output_dir, unet_lora_layers=convert_state_dict_to_diffusers(get_peft_model_state_dict(unet)),
        unet_lora_adapter_metadata={**unet.peft_config["default"].to_dict(), "lora_dropout": 0.0},
        text_encoder_lora_layers=convert_state_dict_to_diffusers(get_peft_model_state_dict(text_encoder)) if text_encoder else None,
        text_encoder_lora_adapter_metadata={**text_encoder.peft_config["default"].to_dict(), "lora_dropout": 0.0} if text_encoder else None,
    )


def save_kohya(args, unet, text_encoder):
    """The same weights for ComfyUI and A1111: kohya's keys (lora_unet_…, lora_te_…, lora_down/lora_up, an alpha per
    module), in output_dir/<its name>.safetensors. diffusers' converter writes SDXL's lora_te1_ and alpha = rank:
    SD 1.x files say lora_te_, and the alpha must be the trained one."""
    layers = {f"unet.{k}": v for k, v in get_peft_model_state_dict(unet).items()}
    if text_encoder is not None:
        layers |= {f"text_encoder.{k}": v for k, v in get_peft_model_state_dict(text_encoder).items()}
    kohya = {k.replace("lora_te1_", "lora_te_"): torch.tensor(float(args.lora_alpha)) if k.endswith(".alpha") else v.contiguous()
             for k, v in convert_state_dict_to_kohya(layers).items()}
    name = os.path.basename(os.path.realpath(args.output_dir))  # the folder's real name, also for `--output_dir .`
    save_file(kohya, os.path.join(args.output_dir, f"{name}.safetensors"))


def log_validation(accelerator, args, vae, text_encoder, tokenizer, model, ema_model, lora_params, noise_scheduler, global_step, name=None):
    """Each prompt's images at LoRA scale 0 (the base model), then at scale 1, from the same seeds: one row a prompt."""
    if not accelerator.is_main_process:
        return
    if ema_model is not None:  # sample with the EMA weights, then put the training weights back
        ema_model.store(lora_params)
        ema_model.copy_to(lora_params)
    unet, text_encoder = (accelerator.unwrap_model(m, keep_torch_compile=False) for m in (model, text_encoder))
    unet.eval()  # no LoRA dropout while sampling; train() again below
    text_encoder.eval()
    # Built from the modules already in memory (no second VAE or text encoder), the trained weights never
    # cast; a multistep solver gives a fair picture in 20 steps.
    pipeline = StableDiffusionPipeline(
        vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, unet=unet,
        scheduler=DPMSolverMultistepScheduler.from_config(noise_scheduler.config),
        safety_checker=None, feature_extractor=None, requires_safety_checker=False,
    )
    pipeline.set_progress_bar_config(disable=True)
    columns = []
    for scale in (0.0, 1.0):
        generator = torch.Generator("cpu").manual_seed(args.seed)  # the same starting noise every time
        with accelerator.autocast(), offload_models(vae, text_encoder, device=accelerator.device):  # back after caching
            columns.append(pipeline(args.validation_prompts, num_images_per_prompt=args.num_validation_images, num_inference_steps=20,
                                    generator=generator, height=args.resolution, width=args.resolution,
                                    cross_attention_kwargs={"scale": scale}, output_type="np").images)
    if ema_model is not None:
        ema_model.restore(lora_params)
    unet.train()
    text_encoder.train(args.train_text_encoder)  # a frozen one stays in eval mode, as loaded
    shape = (len(args.validation_prompts), args.num_validation_images, *columns[0].shape[1:])
    images = np.concatenate([c.reshape(shape) for c in columns], axis=1).reshape(-1, *shape[2:])  # prompt by prompt
    os.makedirs(os.path.join(args.output_dir, "samples"), exist_ok=True)
    torchvision.utils.save_image(torch.from_numpy(images).permute(0, 3, 1, 2),
                                 os.path.join(args.output_dir, "samples", f"{name or f'step-{global_step}'}.png"), nrow=2 * shape[1])
    for tracker in accelerator.trackers:
        if tracker.name == "tensorboard":
            tracker.writer.add_images(name or "validation", images, global_step, dataformats="NHWC")
        elif tracker.name == "wandb":
            import wandb
            captions = [f"{prompt} (LoRA scale {scale})" for prompt in args.validation_prompts for scale in (0, 1) for _ in range(shape[1])]
            tracker.log({name or "validation": [wandb.Image(image, caption=c) for image, c in zip(images, captions)]}, step=global_step)


def write_model_card(args, global_step):
    data = args.dataset_name or args.train_data_dir
    command = shlex.join(["accelerate", "launch", os.path.basename(__file__), *sys.argv[1:]])  # reruns this training
    grid = f"samples/step-{global_step}.png"
    prompt = args.instance_prompt or (args.validation_prompts or ["a photo"])[0]
    lines = [
        "---", f"base_model: {args.pretrained_model_name_or_path}", "library_name: diffusers",
        "tags: [stable-diffusion, text-to-image, diffusers, lora]", "---", "",
        f"# LoRA for {args.pretrained_model_name_or_path}", "",
        f"Rank {args.rank}, alpha {args.lora_alpha:g} LoRA on the UNet{' and text encoder' if args.train_text_encoder else ''} "
        f"of `{args.pretrained_model_name_or_path}`, trained on `{data}` for {global_step} steps with `train_lora.py`."
        + (f' Trigger prompt: "{args.instance_prompt}".' if args.instance_prompt else ""), "",
        "```python", "from diffusers import StableDiffusionPipeline",
        f'pipe = StableDiffusionPipeline.from_pretrained("{args.pretrained_model_name_or_path}")',
        f'pipe.load_lora_weights("{args.output_dir}")', f"image = pipe({prompt!r}).images[0]", "```", "",
        f"For ComfyUI or A1111: `{os.path.basename(os.path.realpath(args.output_dir))}.safetensors` in the loras folder.", "",
        "Trained with:", "", "```bash", command, "```",
    ]
    if os.path.isfile(os.path.join(args.output_dir, grid)):
        lines += ["", f"Validation prompts: {args.validation_prompts}; in each row the base model, then with the LoRA.", "",
                  f"![samples]({grid})"]
    with open(os.path.join(args.output_dir, "README.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main(parse_args())
