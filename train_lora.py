#!/usr/bin/env python
"""train_lora.py: teach Stable Diffusion 1.x a subject or a style with LoRA, on a few images.

The training of train_text_to_image.py with the UNet frozen: LoRA (Hu et al. 2021) adds to the
chosen linear layers W a low-rank update W' = W + (α/r)·B·A (A: r x in; B: out x r, from zero)
and trains only A and B. Rank 4 on SD 1.5's attention: 0.8 M parameters, not the UNet's 860 M.

    accelerate launch train_lora.py --pretrained_model_name_or_path PATH_OR_HUB_ID \
        --train_data_dir my_photos --instance_prompt "a photo of sks dog" --resolution 512
"""

import argparse
import atexit
import contextlib
import logging
import math
import multiprocessing
import os
import re
import shlex
import shutil
import signal
import sys
import textwrap
import time
from collections import Counter
from dataclasses import replace
from datetime import timedelta
from functools import partial
from pathlib import Path

import datasets
import torch
import torch.nn.functional as F
import torchvision
from accelerate import Accelerator, DistributedType
from accelerate.logging import get_logger
from accelerate.utils import DataLoaderConfiguration, InitProcessGroupKwargs, ProjectConfiguration
from accelerate.utils import set_seed
from diffusers import DDPMScheduler, DPMSolverMultistepScheduler, StableDiffusionPipeline
from diffusers.models.autoencoders.vae import DiagonalGaussianDistribution
from diffusers.optimization import get_scheduler
from diffusers.training_utils import EMAModel, cast_training_params, compute_snr
from diffusers.training_utils import parse_buckets_string
from diffusers.utils import convert_state_dict_to_kohya
from huggingface_hub import ModelCard, ModelCardData, create_repo, upload_folder
from peft import LoraConfig, get_peft_model_state_dict, inject_adapter_in_model
from peft import set_peft_model_state_dict
from safetensors.torch import load_file, save_file
from PIL import Image
from torch.utils.data import default_collate
from torchvision import transforms
from tqdm.auto import tqdm

logger = get_logger(__name__)


# 1. Arguments: the Diffusers example's flags and defaults, so its commands run unchanged
def parse_args(argv=None):
    p = argparse.ArgumentParser(description="Train a LoRA for Stable Diffusion 1.x.")
    p.add_argument("--pretrained_model_name_or_path", required=True, help="SD 1.x hub id or folder")
    p.add_argument("--revision", help="The model's Git revision on the Hub (branch, tag, commit).")
    p.add_argument("--variant", help='Load the weight files of this variant, e.g. "fp16".')
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--dataset_name", help="A Hub dataset, or a folder `datasets` loads.")
    p.add_argument("--dataset_config_name", help="The dataset's configuration, if it has several.")
    source.add_argument("--train_data_dir", help="A folder of images (an imagefolder).")
    p.add_argument("--image_column", default="image", help="The dataset's image column.")
    p.add_argument("--caption_column", default="text", help="Captions (or lists): 77 tokens read.")
    p.add_argument("--caption_extension", default=".txt", help="Caption files: 77 tokens read.")
    p.add_argument("--instance_prompt", help="One caption for every image, over any other.")
    p.add_argument(
        "--caption_dropout_rate", type=fraction, default=0.0, help="Share of empty captions."
    )
    p.add_argument("--max_train_samples", type=count, help="Train on N random images.")
    p.add_argument("--cache_dir", help="Where downloads are cached (default: the HF cache).")
    p.add_argument("--validation_prompts", "--validation_prompt", nargs="+", help="Sample prompts.")
    p.add_argument(
        "--num_validation_images", type=count_or_0, default=4, help="Per prompt; 0: none."
    )
    p.add_argument("--validation_epochs", type=count, default=1, help="Validate every N epochs.")
    p.add_argument("--guidance_scale", type=float, default=7.5, help="Validation's guidance scale.")
    p.add_argument("--num_inference_steps", type=count, default=20, help="Steps to sample.")
    p.add_argument("--output_dir", default="sd-model-finetuned-lora", help="Where outputs go.")
    p.add_argument("--seed", type=int, default=0, help="Seeds weights, data order, noise.")
    p.add_argument("--resolution", type=count, default=512, help="Image side, resized.")
    p.add_argument("--aspect_ratio_buckets", help='"h,w;h,w;..." or "auto".')
    p.add_argument(
        "--image_interpolation_mode",
        default="lanczos",
        choices=[mode.name.lower() for mode in transforms.InterpolationMode],
        help="The filter that resizes images.",
    )
    p.add_argument("--center_crop", action="store_true", help="Center crop; default: random.")
    p.add_argument("--random_flip", action="store_true", help="Flip half the images left-right.")
    p.add_argument("--cache_latents", action="store_true", help="Encode each image once, up front.")
    p.add_argument("--train_batch_size", type=count, default=16, help="Per process, pass.")
    p.add_argument("--dataloader_num_workers", type=count_or_0, default=0, help="Loaders.")
    p.add_argument("--num_train_epochs", type=count, default=100, help="Passes over the data.")
    p.add_argument("--max_train_steps", type=count, help="Steps to train; overrides the epochs.")
    p.add_argument("--gradient_accumulation_steps", type=count, default=1, help="Batches per step.")
    p.add_argument("--gradient_checkpointing", action="store_true", help="Less memory, slower.")
    p.add_argument("--rank", type=count, default=4, help="The rank r of each LoRA update B·A.")
    p.add_argument(
        "--lora_alpha", type=at_least_0, help="The update's scale is α/r; default α = r."
    )
    p.add_argument(
        "--lora_target_modules", default="to_k,to_q,to_v,to_out.0", help="Layers to adapt."
    )
    p.add_argument("--train_text_encoder", action="store_true", help="A LoRA on CLIP too.")
    p.add_argument("--learning_rate", type=at_least_0, default=1e-4, help="AdamW's LR.")
    p.add_argument("--scale_lr", action="store_true", help="LR × total batch size.")
    p.add_argument("--lr_scheduler", default="constant", help="constant, linear, cosine, ...")
    p.add_argument("--lr_warmup_steps", type=count_or_0, default=500, help="LR warm-up.")
    p.add_argument("--adam_beta1", type=fraction, default=0.9, help="AdamW's β1 (momentum).")
    p.add_argument("--adam_beta2", type=fraction, default=0.999, help="AdamW's β2 (second moment).")
    p.add_argument("--adam_weight_decay", type=at_least_0, default=1e-2, help="Weight decay.")
    p.add_argument("--adam_epsilon", type=at_least_0, default=1e-08, help="AdamW's ε.")
    p.add_argument("--use_8bit_adam", action="store_true", help="bitsandbytes' 8-bit AdamW.")
    p.add_argument("--max_grad_norm", type=at_least_0, default=1.0, help="Clip gradients to this.")
    p.add_argument("--use_ema", action="store_true", help="Save and sample an EMA of the weights.")
    p.add_argument("--report_to", default="tensorboard", help="tensorboard, wandb or none.")
    p.add_argument("--logging_dir", default="logs", help="Trackers' folder, in --output_dir.")
    p.add_argument("--mixed_precision", choices=["no", "fp16", "bf16"], help="fp16/bf16 autocast.")
    p.add_argument("--allow_tf32", action="store_true", help="TF32 matmuls on Ampere+: faster.")
    p.add_argument(
        "--enable_xformers_memory_efficient_attention",
        action="store_true",
        help="Ignored: PyTorch's SDPA attention is used.",
    )
    p.add_argument("--prediction_type", choices=["epsilon", "v_prediction"], help="Target: ε or v.")
    p.add_argument("--snr_gamma", type=at_least_0, help="Min-SNR-γ's γ (paper: 5.0); default off.")
    p.add_argument("--noise_offset", type=at_least_0, default=0.0, help="Shift ε per channel.")
    p.add_argument("--checkpointing_steps", type=count, default=500, help="Checkpoint every N.")
    p.add_argument("--checkpoints_total_limit", type=count, help="Keep the newest N; default: all.")
    p.add_argument(
        "--validation_split",
        type=fraction,
        help="Hold out this share of the pictures (seeded); resume with the same share and --seed.",
    )
    p.add_argument("--validate_every_n_steps", type=count, help="Held-out loss every N steps.")
    # --overwrite_output_dir in a requeued command would remove the run at every restart.
    again = p.add_mutually_exclusive_group()
    again.add_argument(
        "--resume_from_checkpoint", help='checkpoint-N in --output_dir, or "latest".'
    )
    again.add_argument(
        "--overwrite_output_dir", action="store_true", help="Start again over a run."
    )
    p.add_argument("--push_to_hub", action="store_true", help="Upload to the Hub; log in first.")
    p.add_argument("--hub_model_id", help="The Hub repo; default: --output_dir's name.")
    p.add_argument("--hub_private_repo", action="store_true", help="Make the Hub repo private.")
    p.add_argument("--hub_token", help="Left out: run `hf auth login` or set HF_TOKEN instead.")
    p.add_argument("--local_rank", type=int, default=-1, help="Passed by old launchers; unused.")
    args = p.parse_args(argv)
    if args.cache_latents and not args.center_crop:
        p.error("--cache_latents needs --center_crop (a random crop differs each epoch)")
    refused = {"hub_token": "a token in a command lands in shell history; run `hf auth login`"}
    check_args(p, args, refused)
    args.lora_alpha = args.lora_alpha or args.rank
    return args


def main(args):
    # 2. Accelerator, logging, seed. `accelerate launch` or `accelerate config` sets the devices,
    #    processes and precision: one file for a CPU, a GPU or many.
    accelerator = Accelerator(
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        mixed_precision=args.mixed_precision,
        log_with=None if args.report_to == "none" else args.report_to,
        project_config=ProjectConfiguration(
            args.output_dir, logging_dir=os.path.join(args.output_dir, args.logging_dir)
        ),
        # Every process draws the same permutation each epoch and takes its share of it.
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, data_seed=args.seed),
        # The loop steps the LR schedule once per optimizer step.
        step_scheduler_with_optimizer=False,
        kwargs_handlers=[process_group_kwargs()],
    )
    # The model without its DDP or torch.compile wrapper.
    unwrap = partial(accelerator.unwrap_model, keep_torch_compile=False)
    logging.basicConfig(level=logging.INFO)
    # What a real launch needs beside the lesson: "Running for real", at the end of the file.
    start_run(accelerator, args)
    check_folders(args, "pytorch_lora_weights.safetensors", args.instance_prompt is None)
    # The same initial weights on every process.
    set_seed(args.seed)
    torch.backends.cuda.matmul.allow_tf32 = args.allow_tf32
    if args.push_to_hub and accelerator.is_main_process:
        repo_id = args.hub_model_id or os.path.basename(os.path.abspath(args.output_dir))
        # Now, not after hours of training.
        with as_one_line("--push_to_hub"):
            repo = create_repo(repo_id, private=args.hub_private_repo, exist_ok=True)

    # 3. Models: the base pipeline's noise schedule, tokenizer, text encoder, VAE and UNet
    base_path = args.pretrained_model_name_or_path
    with as_one_line(f"--pretrained_model_name_or_path {base_path}"):
        base = StableDiffusionPipeline.from_pretrained(
            base_path,
            revision=args.revision,
            variant=args.variant,
            cache_dir=args.cache_dir,
            safety_checker=None,
            requires_safety_checker=False,
        )
    # The schedule of the forward process, as the base model was trained with.
    noise_scheduler = DDPMScheduler.from_config(base.scheduler.config)
    tokenizer, text_encoder, vae, unet = base.tokenizer, base.text_encoder, base.vae, base.unet
    # --prediction_type: what the UNet learns to predict, ε or v; the saved scheduler says it.
    if args.prediction_type is not None:
        noise_scheduler.register_to_config(prediction_type=args.prediction_type)
    # Validation samples with the base pipeline, which holds the very modules that train (no
    # second copy, none cast), and DPM-Solver++ in 20-odd steps, not DDPM's 1,000.
    base.scheduler = DPMSolverMultistepScheduler.from_config(noise_scheduler.config)
    # All three are frozen, in the mixed-precision dtype: half the memory.
    dtypes = {"fp16": torch.float16, "bf16": torch.bfloat16}
    weight_dtype = dtypes.get(accelerator.mixed_precision, torch.float32)
    for frozen in (vae, text_encoder, unet):
        frozen.requires_grad_(False).to(accelerator.device, dtype=weight_dtype)
    # LoRA: A Gaussian, B zero (so W' = W at first), as in the Diffusers example.
    lora_config = LoraConfig(
        r=args.rank,
        lora_alpha=args.lora_alpha,
        init_lora_weights="gaussian",
        target_modules=args.lora_target_modules.split(","),
    )
    with as_one_line(f"--lora_target_modules {args.lora_target_modules}"):
        unet.add_adapter(lora_config)
    # On CLIP's attention projections, with the same r and α.
    if args.train_text_encoder:
        clip_targets = ["q_proj", "k_proj", "v_proj", "out_proj"]
        # peft's own call, without transformers' gate on peft's version (docs/reference.md).
        inject_adapter_in_model(replace(lora_config, target_modules=clip_targets), text_encoder)
    trained = [unet, text_encoder] if args.train_text_encoder else [unet]
    # A and B in fp32: fp16 gradients could not be unscaled, bf16 updates of 1e-4 would round away
    # (under bf16, section 5 keeps fp32 masters of bf16 copies).
    cast_training_params(trained, dtype=torch.float32)
    lora_params = [p for m in trained for p in m.parameters() if p.requires_grad]
    if args.gradient_checkpointing:
        unet.enable_gradient_checkpointing()
    # Only a text encoder that learns runs backward; transformers checkpoints in training mode.
    if args.gradient_checkpointing and args.train_text_encoder:
        text_encoder.gradient_checkpointing_enable()
        text_encoder.train()
    ema_model = None
    # An EMA of A and B alone.
    if args.use_ema:
        ema_model = EMAModel(lora_params)

    # 4. Data: images resized, cropped, flipped, scaled to [-1, 1]; captions tokenized; the
    #    held-out ones apart
    # The main process writes the datasets' cache files; the others then read them.
    with accelerator.main_process_first():
        splits = load_datasets(args, args.image_column)
    if args.instance_prompt is None and args.caption_column not in splits["train"].column_names:
        # kohya's layout: a caption file beside each image (0001.png, 0001.txt).
        with as_one_line(
            f"no column {args.caption_column!r}; give --instance_prompt or caption files"
        ):
            splits = splits.map(partial(read_caption, args=args), input_columns=args.image_column)
    # Aspect-ratio buckets: each image trains at the size (height, width) of the bucket nearest its
    # aspect ratio, so that a portrait or a panorama is not cut to a square.
    bucket_sizes = [(args.resolution, args.resolution)]
    if args.aspect_ratio_buckets:
        # A side must divide by the VAE's factor, 2^(blocks - 1), times the UNet's.
        step = 2 ** (len(vae.config.block_out_channels) + len(unet.config.block_out_channels) - 2)
        bucket_sizes = parse_buckets(args, step)
        with accelerator.main_process_first():
            splits = splits.map(
                partial(nearest_bucket, bucket_sizes=bucket_sizes), input_columns=args.image_column
            )
    # Pixels in [0, 1] become (x - 0.5) / 0.5, in [-1, 1]; cover_and_crop resizes and crops each
    # image first, and preprocess flips it.
    to_tensor = transforms.Compose([transforms.ToTensor(), transforms.Normalize([0.5], [0.5])])
    # --cache_latents: the frozen VAE encodes each image once, here, not in every epoch.
    cache = (
        cache_latents(args, splits, to_tensor, bucket_sizes, vae) if args.cache_latents else None
    )
    train_dataset, held_out = splits["train"], splits.get("validation")
    if args.max_train_samples is not None:
        train_dataset = train_dataset.shuffle(seed=args.seed, keep_in_memory=True)
        train_dataset = train_dataset.select(range(min(args.max_train_samples, len(train_dataset))))
    transform = partial(
        preprocess,
        args=args,
        to_tensor=to_tensor,
        tokenizer=tokenizer,
        bucket_sizes=bucket_sizes,
        cache=cache,
    )
    # The held-out pictures keep epoch 0's crops and flips.
    if held_out:
        held_out.set_transform(partial(transform, epoch=0))
    # Its own generator: each epoch's shuffle would draw from the global RNG of ε and t.
    generator = torch.Generator().manual_seed(args.seed)
    loader_args = dict(batch_size=args.train_batch_size, shuffle=True)
    if args.aspect_ratio_buckets:
        sampler = torch.utils.data.RandomSampler(train_dataset, generator=generator)
        loader_args = dict(batch_sampler=BucketBatches(sampler, train_dataset["bucket"], args))
    train_dataloader = torch.utils.data.DataLoader(
        train_dataset,
        num_workers=args.dataloader_num_workers,
        generator=generator,
        worker_init_fn=ignore_signals,
        **loader_args,
    )

    # 5. Optimizer and LR schedule, over each process's share of the batches
    accumulation = args.gradient_accumulation_steps
    total_batch_size = args.train_batch_size * accelerator.num_processes * accumulation
    if args.scale_lr:
        args.learning_rate *= total_batch_size
    # fused: one call updates all the weights (on CUDA, a kernel per chunk of them).
    optimizer_class = partial(torch.optim.AdamW, fused=True)
    if args.use_8bit_adam:
        import bitsandbytes

        optimizer_class = bitsandbytes.optim.AdamW8bit
    # Under bf16 the UNet computes with bf16 copies of A and B (fp32 ones cost casts at every
    # adapted layer) and the optimizer updates fp32 masters.
    master_params = lora_params
    if weight_dtype == torch.bfloat16:
        # requires_grad: EMAModel.step averages only such weights (it copies the others).
        master_params = [p.detach().clone().requires_grad_() for p in lora_params]
        cast_training_params(trained, dtype=weight_dtype)
    optimizer = optimizer_class(
        master_params,
        lr=args.learning_rate,
        betas=(args.adam_beta1, args.adam_beta2),
        weight_decay=args.adam_weight_decay,
        eps=args.adam_epsilon,
    )
    # Before each step a hook copies the gradients of the bf16 copies into the fp32 masters (they
    # accumulate in bf16); after it, another rounds the updated masters into the copies.
    if master_params is not lora_params:
        grads = [torch.zeros_like(p) for p in master_params]
        optimizer.register_step_pre_hook(partial(to_masters, lora_params, master_params, grads))
        optimizer.register_step_post_hook(partial(to_copies, lora_params, master_params))
    steps_per_epoch = math.ceil(len(train_dataloader) / accelerator.num_processes / accumulation)
    max_train_steps = args.max_train_steps or args.num_train_epochs * steps_per_epoch
    num_epochs = math.ceil(max_train_steps / steps_per_epoch)
    lr_scheduler = get_scheduler(
        args.lr_scheduler,
        optimizer,
        num_warmup_steps=args.lr_warmup_steps,
        num_training_steps=max_train_steps,
    )
    unet, optimizer, train_dataloader, lr_scheduler = accelerator.prepare(
        unet, optimizer, train_dataloader, lr_scheduler
    )
    # The text encoder's LoRA learns too: DDP wraps it as well.
    if args.train_text_encoder:
        text_encoder = accelerator.prepare(text_encoder)
    # Each process draws its own ε and t (the Diffusers examples draw the same on every GPU).
    set_seed(args.seed, device_specific=True)

    # 6. Checkpoint hooks and resume. save_state stores the optimizer, LR schedule and every
    #    process's RNG states; the hooks add the LoRA alone, in the file load_lora_weights reads.
    def save_model_hook(models, weights, output_dir):
        if accelerator.is_main_process:
            save_lora(output_dir, *map(unwrap, models))
        # Saved above: accelerate must not store them again.
        weights.clear()

    def load_model_hook(models, input_dir):
        saved = load_file(f"{input_dir}/pytorch_lora_weights.safetensors")
        for module, prefix in zip(models, ["unet.", "text_encoder."]):
            layers = {k[len(prefix) :]: v for k, v in saved.items() if k.startswith(prefix)}
            set_peft_model_state_dict(unwrap(module), layers)
        models.clear()

    accelerator.register_save_state_pre_hook(save_model_hook)
    accelerator.register_load_state_pre_hook(load_model_hook)
    # The masters (in fp32 the model's A and B themselves) and the EMA go into each checkpoint.
    accelerator.register_for_checkpointing(torch.nn.ParameterList(master_params))
    if args.use_ema:
        accelerator.register_for_checkpointing(ema_model)
    global_step = resume_from_checkpoint(accelerator, args)
    # The EMA goes to the device after the resume, which loads it on the CPU.
    if args.use_ema:
        ema_model.to(accelerator.device)
    first_epoch = global_step // steps_per_epoch
    skip_batches = (global_step % steps_per_epoch) * accumulation
    remove_earlier_run(accelerator, args)
    hparams = {k: v for k, v in vars(args).items() if isinstance(v, (int, float, str))}
    # The Diffusers LoRA example's project name.
    accelerator.init_trackers("text2image-fine-tune", config=hparams)

    # 7. The training loop: Algorithm 1 of DDPM on latents, conditioned on the captions; section 8
    #    runs at the end of each step
    T = noise_scheduler.config.num_train_timesteps

    def diffusion_loss(unet, latents, noise, timesteps, encoder_hidden_states):
        """Each image's loss for given ε and t, in the loop and on the held-out pictures."""
        # z_t = √ᾱ_t·z_0 + √(1-ᾱ_t)·ε: the forward process in closed form (DDPM, eq. 4).
        noisy_latents = noise_scheduler.add_noise(latents, noise, timesteps)
        # The target: ε, or v = √ᾱ_t·ε - √(1-ᾱ_t)·z_0 (Salimans & Ho 2022).
        if noise_scheduler.config.prediction_type == "epsilon":
            target = noise
        else:
            target = noise_scheduler.get_velocity(latents, noise, timesteps)
        # The prediction of the target, ε_θ(z_t, t, c) for ε; its input in the mixed-precision
        # dtype, the frozen UNet's.
        inputs = noisy_latents.to(weight_dtype)
        model_output = unet(inputs, timesteps, encoder_hidden_states).sample
        # ‖target - prediction‖²: the simple loss (DDPM eq. 14), per image for Min-SNR-γ.
        loss = F.mse_loss(model_output.float(), target.float(), reduction="none")
        loss = loss.mean(dim=[1, 2, 3])
        if args.snr_gamma is not None:
            loss = loss * min_snr_weights(noise_scheduler, timesteps, args.snr_gamma)
        return loss

    # A held-out picture's loss at t = fraction·T, with the generator's ε (section 8), without
    # --noise_offset, which adds noise of its own.
    def picture_loss(batch, generator, fraction):
        # On the device: the held-out pictures come straight from their dataset.
        batch = {name: value.to(accelerator.device) for name, value in batch.items()}
        # The VAE posterior's mean, not a sample: the same latent each time.
        latents = sample_latents(vae, batch, args, mean=True)
        encoder_hidden_states = unwrap(text_encoder)(batch["input_ids"])[0]
        noise = torch.randn(latents.shape, generator=generator).to(accelerator.device)
        timesteps = torch.tensor([int(fraction * T)], device=accelerator.device)
        return diffusion_loss(unwrap(unet), latents, noise, timesteps, encoder_hidden_states)

    logger.info(f"{len(train_dataset)} images, {max_train_steps} steps of {total_batch_size}")
    progress_bar = tqdm(
        range(max_train_steps), initial=global_step, disable=not accelerator.is_local_main_process
    )
    # The held-out loss where the run starts (at step 0: the untrained baseline), shown on the
    # progress bar and in the model card. A picture that cannot be read stops the run here.
    shown = {}
    if held_out:
        with ema_weights(ema_model, lora_params):
            shown = log_held_out_loss(accelerator, held_out, picture_loss, unet, global_step)
    # From now on a signal saves a checkpoint first.
    signals = handle_signals(accelerator, args, at_once=False)
    # The loss is summed on the device, read every 10 steps: a read makes the CPU wait.
    train_loss = 0.0
    logged_step = global_step
    for epoch in range(first_epoch, num_epochs):
        unet.train()
        # This epoch's crops, flips and captions (preprocess), and permutation, also when resuming.
        train_dataset.set_transform(partial(transform, epoch=epoch))
        train_dataloader.set_epoch(epoch)
        batches = train_dataloader
        # A resumed run skips the batches its checkpoint has trained on.
        if epoch == first_epoch and skip_batches:
            batches = accelerator.skip_first_batches(train_dataloader, skip_batches)
        for batch in batches:
            # Stop at max_train_steps, also when resumed at the last step.
            if global_step >= max_train_steps:
                break
            with accelerator.accumulate(unet, text_encoder):
                # z_0 ~ q(z_0): a batch of training images' latents.
                latents = sample_latents(vae, batch, args)
                # c: the caption's encoder states (autograd records them only if a weight learns).
                encoder_hidden_states = text_encoder(batch["input_ids"])[0]
                # ε ~ N(0, I): the noise to mix in.
                noise = torch.randn_like(latents)
                bsz = len(latents)
                device = latents.device
                # The noise offset shifts whole channels, so that very dark or light images learn.
                if args.noise_offset:
                    noise += args.noise_offset * torch.randn(*noise.shape[:2], 1, 1, device=device)
                # t ~ U{0, ..., T-1}: a timestep per image.
                timesteps = torch.randint(0, T, (bsz,), device=device)
                # z_t, the target, the prediction, ‖target - prediction‖², over the batch.
                loss = diffusion_loss(unet, latents, noise, timesteps, encoder_hidden_states)
                loss = loss.mean()
                # ∇_θ of the loss, averaged over processes; clipped once every micro-batch is in.
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(lora_params, args.max_grad_norm)
                # A gradient step (accelerate skips it until the last micro-batch).
                optimizer.step()
                optimizer.zero_grad()
                train_loss += loss.detach() / accumulation
            # The rest runs once per optimizer step.
            if not accelerator.sync_gradients:
                continue
            lr_scheduler.step()
            if args.use_ema:
                ema_model.step(master_params)
            global_step += 1
            progress_bar.update(1)
            save = global_step % args.checkpointing_steps == 0
            last_step = global_step >= max_train_steps
            epoch_end = global_step % steps_per_epoch == 0 or last_step
            # Read before anything is saved: a checkpoint, at an epoch's end, at the last step.
            read = global_step % 10 == 0 or save or epoch_end
            # A signal stops every process at the same step, before validation: one process reads
            # its handler's list at every step; several check together where they read the loss.
            stop = (
                signals if accelerator.num_processes == 1 else read and accelerator.check_trigger()
            )
            if read or stop:
                # The mean loss of the steps since the last read, over every process.
                steps = global_step - logged_step
                mean_loss = accelerator.reduce(train_loss, "mean").item() / steps
                logs = {"loss": mean_loss, "lr": lr_scheduler.get_last_lr()[0]}
                progress_bar.set_postfix(**logs, **shown)
                accelerator.log(logs, step=global_step)
                train_loss = 0.0
                logged_step = global_step
                # Diverged: stop before a checkpoint keeps the weights of a loss of inf or NaN.
                if not math.isfinite(mean_loss):
                    raise SystemExit(
                        f"error: the loss is {mean_loss} at step {global_step}: resume an earlier "
                        "checkpoint with a lower --learning_rate"
                    )
            if stop:
                stop_run(accelerator, args, f"Stopped at step {global_step}", global_step)

            # 8. Validation, EMA weights if any: the held-out loss every --validate_every_n_steps
            #    and at the last step; the prompts without and with the LoRA
            # Without --validate_every_n_steps, at every checkpoint.
            every = args.validate_every_n_steps or args.checkpointing_steps
            held_out_due = held_out and (global_step % every == 0 or last_step)
            if held_out_due:
                with ema_weights(ema_model, lora_params):
                    shown = log_held_out_loss(
                        accelerator, held_out, picture_loss, unet, global_step
                    )
            last_epoch = epoch == num_epochs - 1 or last_step
            due = epoch_end and (epoch % args.validation_epochs == 0 or last_epoch)
            if args.validation_prompts and due and accelerator.is_main_process:
                log_validation(accelerator, args, base, ema_model, global_step, lora_params)
            if save:
                save_checkpoint(accelerator, args, global_step)

    # 9. Final save: the LoRA (EMA weights if any) in the file diffusers loads, and in kohya's
    #    for ComfyUI, A1111/Forge and kohya's own scripts
    if accelerator.is_main_process:
        if args.use_ema:
            ema_model.copy_to(master_params)
        # The files take the masters: under bf16 the fp32 ones, not the bf16 copies; without
        # masters, A and B themselves.
        for p, master in zip(lora_params, master_params):
            p.data = master.data
        # The UNet's LoRA, and the text encoder's if it learns.
        save_lora(args.output_dir, *trained)
        save_kohya(args)
        prompt = (args.validation_prompts or ["a photo"])[0]
        where = repo.repo_id if args.push_to_hub else args.output_dir
        usage = "from diffusers import StableDiffusionPipeline\n\n"
        usage += f"pipeline = StableDiffusionPipeline.from_pretrained({base_path!r})\n"
        usage += f"pipeline.load_lora_weights({where!r})\n"
        usage += f"pipeline({prompt!r}).images[0].save('sample.png')"
        tags = ["stable-diffusion", "text-to-image", "lora"]
        save_model_card(args, tags, usage, shown)
        if args.push_to_hub:
            upload_folder(
                repo_id=repo.repo_id, folder_path=args.output_dir, ignore_patterns="*checkpoint*"
            )
    end_run(accelerator, args)


def load_datasets(args, *columns):
    """The pictures: "train" (a Hub dataset or an imagefolder) and, with --validation_split, a
    seeded share of them held out as "validation", the same on every process and at every resume.
    A "row" column seeds each picture's crop and flip."""
    if args.dataset_name:
        with as_one_line(f"--dataset_name {args.dataset_name}"):
            dataset = datasets.load_dataset(
                args.dataset_name, args.dataset_config_name, cache_dir=args.cache_dir, split="train"
            )
    else:
        folder = args.train_data_dir
        # Every picture under the folder, with a metadata file's columns.
        with as_one_line(f"--train_data_dir {folder}"):
            dataset = datasets.load_dataset(
                "imagefolder", data_files=f"{folder}/**", cache_dir=args.cache_dir, split="train"
            )
    for column in columns:
        if column not in dataset.column_names:
            raise SystemExit(f"error: no column {column!r}; the dataset has {dataset.column_names}")
    # Decoded by open_image, so that a file that cannot be read is named.
    dataset = dataset.cast_column(args.image_column, datasets.Image(decode=False))
    splits = datasets.DatasetDict(train=dataset.add_column("row", range(len(dataset))))
    if args.validation_split:
        with as_one_line("--validation_split"):
            split = splits["train"].train_test_split(args.validation_split, seed=args.seed)
        splits = datasets.DatasetDict(train=split["train"], validation=split["test"])
    return splits


def read_caption(item, args):
    """The caption file beside an image, read as utf-8-sig: a Windows editor's BOM is dropped."""
    caption_file = os.path.splitext(item["path"])[0] + args.caption_extension
    return {args.caption_column: Path(caption_file).read_text(encoding="utf-8-sig").strip()}


def open_image(item):
    """One image in RGB as its owner sees it: upright by its EXIF orientation (as `datasets` decodes
    it), 16-bit greys rounded to 8 bits rather than clipped, transparent pixels on white."""
    with as_one_line(f"image {item['path']}"):
        image = datasets.Image().decode_example(item)
    # One channel of 16 bits (modes I;16, I;16B, I): 0..65535 to 0..255, rounded.
    if image.mode[0] == "I":
        values = transforms.functional.pil_to_tensor(image.convert("F")).double()
        image = transforms.functional.to_pil_image((values * 255 / 65535).round().byte())
    if image.has_transparency_data:
        image = Image.alpha_composite(Image.new("RGBA", image.size, "white"), image.convert("RGBA"))
    return image.convert("RGB")


def parse_buckets(args, step):
    """--aspect_ratio_buckets as sizes (height, width): "h1,w1;h2,w2;..." or, for "auto", sides in
    steps of `step` px, of about --resolution² pixels, up to 4:1 either way (guide 4)."""
    if args.aspect_ratio_buckets == "auto":
        area = args.resolution**2
        heights = range(step, 4 * args.resolution + 1, step)
        sizes = {(height, area // height // step * step) for height in heights}
        sizes |= {(width, height) for height, width in sizes}
        sizes = sorted(size for size in sizes if max(size) <= 4 * min(size))
    else:
        with as_one_line(f"--aspect_ratio_buckets {args.aspect_ratio_buckets}"):
            sizes = parse_buckets_string(args.aspect_ratio_buckets)
    # None for "auto" below --resolution `step`.
    if not sizes or any(height % step or width % step for height, width in sizes):
        why = f"sides in steps of {step} px, --resolution {step} or more"
        raise SystemExit(f"error: --aspect_ratio_buckets {args.aspect_ratio_buckets}: {why}")
    return sizes


def nearest_bucket(item, bucket_sizes):
    """The bucket whose aspect ratio is nearest the image's, in log scale (2:1 as far as 1:2)."""
    width, height = open_image(item).size
    distances = [abs(math.log(w / h * height / width)) for h, w in bucket_sizes]
    return {"bucket": distances.index(min(distances))}


def cover_and_crop(image, size, args):
    """The image resized to cover size (height, width), never stretched, then cropped to it. A
    square is torchvision's Resize(side), the shorter side to the side, as without buckets."""
    scale = max(size[0] / image.height, size[1] / image.width)
    cover = [math.ceil(image.height * scale), math.ceil(image.width * scale)]
    interpolation = transforms.InterpolationMode[args.image_interpolation_mode.upper()]
    image = transforms.functional.resize(
        image, min(size) if size[0] == size[1] else cover, interpolation
    )
    crop = transforms.CenterCrop if args.center_crop else transforms.RandomCrop
    return crop(size)(image)


class BucketBatches(torch.utils.data.BatchSampler):
    """Batches of one bucket each: the epoch's order (accelerate's seedable sampler, the same on
    every process) dealt to the buckets; a full batch goes out, the part-filled ones at the end."""

    def __init__(self, sampler, buckets, args):
        super().__init__(sampler, args.train_batch_size, drop_last=False)
        self.buckets = list(buckets)
        self.size = args.train_batch_size
        # Told no batch size, accelerate deals batches of several sizes whole to the processes.
        self.batch_size = None

    def __iter__(self):
        filling = {}
        for row in self.sampler:
            batch = filling.setdefault(self.buckets[row], [])
            batch.append(row)
            if len(batch) == self.size:
                yield filling.pop(self.buckets[row])
        yield from filling.values()

    def __len__(self):
        return sum(math.ceil(n / self.size) for n in Counter(self.buckets).values())


def cache_latents(args, splits, to_tensor, bucket_sizes, vae):
    """Each picture's VAE posterior, mean and log-variance, of both sides if flipping, by its row:
    each step still draws its own latent z_0 = μ + σ·n. Held in memory, as kohya does: every
    process encodes every picture once a run."""
    cache = {}
    for split in splits.values():
        for example in split:
            # Without --aspect_ratio_buckets, one bucket: the square.
            bucket = example["bucket"] if args.aspect_ratio_buckets else 0
            image = open_image(example[args.image_column])
            pixels = to_tensor(cover_and_crop(image, bucket_sizes[bucket], args))
            pixels = pixels[None].to(vae.device, vae.dtype)
            sides = torch.cat([pixels, pixels.flip(-1)] if args.random_flip else [pixels])
            with torch.no_grad():
                moments = vae.encode(sides).latent_dist.parameters
            cache[example["row"]] = moments.float().cpu()
    return cache


def preprocess(examples, args, to_tensor, tokenizer, bucket_sizes, cache, epoch):
    """Images to tensors (cached: their latents' moments), captions to token ids. As in
    train_unconditional, crop, flip and caption choice come from a seed of (seed, epoch, row)."""
    # The cached latents' moments, or the images.
    key = "latent_moments" if args.cache_latents else "pixel_values"
    batch = {key: []}
    captions = []
    for i, row in enumerate(examples["row"]):
        with torch.random.fork_rng(devices=[]):
            # One seed per image and epoch; torch keeps 32 bits of a seed.
            seed = (args.seed * 1_000_003 + epoch) * 1_000_003 + row
            torch.default_generator.manual_seed(seed % 2**32)
            # Drawn only with --random_flip: without it, the crop's draws stay the same.
            flip = args.random_flip and bool(torch.rand(()) < 0.5)
            # The moments of both sides are cached: the flip picks one.
            if args.cache_latents:
                batch[key].append(cache[row][int(flip)])
            else:
                bucket = examples["bucket"][i] if args.aspect_ratio_buckets else 0
                image = open_image(examples[args.image_column][i])
                pixels = to_tensor(cover_and_crop(image, bucket_sizes[bucket], args))
                batch[key].append(pixels.flip(-1) if flip else pixels)
            # --instance_prompt over the image's own caption; a missing caption (None) is ∅.
            caption = args.instance_prompt or examples[args.caption_column][i] or ""
            # A list of captions: one of them.
            if not isinstance(caption, str):
                caption = caption[torch.randint(len(caption), ())]
            if args.caption_dropout_rate and torch.rand(()) < args.caption_dropout_rate:
                # The empty prompt ∅, for guidance.
                caption = ""
            captions.append(caption)
    # Padded or cut to the tokenizer's length, CLIP's 77 tokens.
    tokens = tokenizer(captions, padding="max_length", truncation=True)
    batch["input_ids"] = torch.tensor(tokens.input_ids)
    return batch


def to_masters(lora_params, master_params, grads, *hook_args):
    """The optimizer's pre-step hook: the gradients of the bf16 copies, cast into the fp32
    masters' (one multi-tensor copy: one kernel, where a loop of copies would launch one each)."""
    torch._foreach_copy_(grads, [p.grad for p in lora_params])
    for master, grad in zip(master_params, grads):
        master.grad = grad


@torch.no_grad()
def to_copies(lora_params, master_params, *hook_args):
    """The optimizer's post-step hook: the updated masters, rounded into the bf16 copies, whose
    gradients start anew."""
    torch._foreach_copy_(lora_params, master_params)
    for p in lora_params:
        p.grad = None


def list_checkpoints(output_dir):
    """The checkpoint-N folders in output_dir, oldest first."""
    names = os.listdir(output_dir) if os.path.isdir(output_dir) else []
    names = [n for n in names if re.fullmatch(r"checkpoint-\d+", n)]
    return sorted(names, key=lambda n: int(n.split("-")[1]))


def save_checkpoint(accelerator, args, global_step):
    """Write tmp-checkpoint-N, rename it, then remove the oldest over the limit: a crash at any
    moment leaves a whole checkpoint for `latest`."""
    path = f"{args.output_dir}/checkpoint-{global_step}"
    tmp = f"{args.output_dir}/tmp-checkpoint-{global_step}"
    # On every process: each writes its RNG states.
    accelerator.save_state(tmp)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        # A checkpoint-N of a run before this one's resume gives way.
        shutil.rmtree(path, ignore_errors=True)
        os.rename(tmp, path)
        logger.info(f"Saved {path}")
        if args.checkpoints_total_limit is not None:
            old = list_checkpoints(args.output_dir)
            old.remove(os.path.basename(path))
            for name in old[: max(0, len(old) + 1 - args.checkpoints_total_limit)]:
                shutil.rmtree(f"{args.output_dir}/{name}")


def resume_from_checkpoint(accelerator, args):
    """Load --resume_from_checkpoint (`latest`: the newest, if any) and return its step."""
    name = args.resume_from_checkpoint
    if name == "latest":
        found = list_checkpoints(args.output_dir)
        # None yet: a new run.
        name = found[-1] if found else None
    if name is None:
        return 0
    checkpoint = os.path.join(args.output_dir, os.path.basename(os.path.normpath(name)))
    # A checkpoint that is missing, half written or another run's ends in one line.
    with as_one_line(f"--resume_from_checkpoint {checkpoint}"):
        accelerator.load_state(checkpoint)
        logger.info(f"Resumed from {checkpoint}")
        return int(checkpoint.rsplit("-", 1)[1])


@torch.no_grad()
def sample_latents(vae, batch, args, mean=False):
    """The batch's latents (x_0 or z_0): a sample of the VAE's posterior N(μ, σ²) of each image (or
    its mean μ), from its pixels or its cached μ and log σ², scaled to unit variance."""
    if args.cache_latents:
        posterior = DiagonalGaussianDistribution(batch["latent_moments"])
    else:
        posterior = vae.encode(batch["pixel_values"].to(vae.dtype)).latent_dist
    latents = posterior.mode() if mean else posterior.sample()
    return latents.float() * vae.config.scaling_factor


def min_snr_weights(noise_scheduler, timesteps, snr_gamma):
    """Min-SNR-γ (Hang et al. 2023): the loss on x_0 weighted by min(SNR(t), γ), with SNR(t) =
    ᾱ_t / (1 - ᾱ_t), so that the nearly clean timesteps no longer dominate the gradient. The loss
    on ε is the loss on x_0 times SNR(t), on v times SNR(t) + 1: divide by them."""
    snr = compute_snr(noise_scheduler, timesteps)
    divisors = {"epsilon": snr, "v_prediction": snr + 1, "sample": 1}
    return snr.clamp(max=snr_gamma) / divisors[noise_scheduler.config.prediction_type]


def log_held_out_loss(accelerator, held_out, picture_loss, model, global_step):
    """The loss on the held-out pictures: val_loss, and val_loss_t0 to t3 over the quarters of the
    schedule, low noise to high (val_loss is their mean weighted by their counts). Picture k of n
    gets t = (k + ½)·T/n and an ε seeded by k; every process measures every picture, so the numbers
    are the same for the same weights on any number of processes."""
    n = len(held_out)
    losses = []
    # No dropout.
    model.eval()
    with torch.no_grad():
        for k in range(n):
            batch = default_collate([held_out[k]])
            generator = torch.Generator().manual_seed(k)
            losses.append(picture_loss(batch, generator, (k + 0.5) / n).item())
    model.train()
    logs = {"val_loss": sum(losses) / n}
    quarters = [int(4 * (k + 0.5) / n) for k in range(n)]
    for q in sorted(set(quarters)):
        part = [loss for loss, quarter in zip(losses, quarters) if quarter == q]
        logs[f"val_loss_t{q}"] = sum(part) / len(part)
    accelerator.log(logs, step=global_step)
    logger.info(f"Held-out loss at step {global_step}: {logs['val_loss']:.4f}")
    return {"val_loss": logs["val_loss"]}


@contextlib.contextmanager
def ema_weights(ema_model, parameters):
    """The EMA's weights in `parameters` within the block, if there is an EMA; then the trained
    ones again."""
    parameters = list(parameters)
    if ema_model is not None:
        ema_model.store(parameters)
        ema_model.copy_to(parameters)
    yield
    if ema_model is not None:
        ema_model.restore(parameters)


def log_validation(accelerator, args, pipeline, ema_model, global_step, lora_params):
    """A row per prompt: its images at LoRA scale 0 (the base model), then at scale 1, from the
    same noise each time."""
    n = args.num_validation_images
    # None to draw: no validation at all.
    if not n:
        return
    unet = pipeline.unet
    # No dropout while sampling.
    unet.eval()
    pipeline.set_progress_bar_config(disable=True)
    images = []
    with ema_weights(ema_model, lora_params), accelerator.autocast():
        for scale in (0, 1):
            output = pipeline(
                args.validation_prompts,
                height=args.resolution,
                width=args.resolution,
                num_inference_steps=args.num_inference_steps,
                guidance_scale=args.guidance_scale,
                generator=torch.Generator().manual_seed(0),
                output_type="pt",
                num_images_per_prompt=n,
                cross_attention_kwargs={"scale": scale},
            )
            images.append(output.images.float().split(n))
    unet.train()
    images = torch.cat([torch.cat(row) for row in zip(*images)])
    # One grid: output_dir/samples/step-N.png, and in TensorBoard or wandb.
    os.makedirs(f"{args.output_dir}/samples", exist_ok=True)
    grid = f"{args.output_dir}/samples/step-{global_step}.png"
    torchvision.utils.save_image(images, grid, nrow=2 * n)
    for tracker in accelerator.trackers:
        tracker.log_images({"samples": images}, step=global_step)


def save_lora(output_dir, *models):
    """The UNet's A and B (then the text encoder's, if it learns) under peft's names (guide 5), each
    model's config beside them, else loaders take α = r."""
    saved = {}
    for name, module in zip(["unet", "text_encoder"], models):
        saved[f"{name}_lora_layers"] = get_peft_model_state_dict(module)
        saved[f"{name}_lora_adapter_metadata"] = module.peft_config["default"].to_dict()
    StableDiffusionPipeline.save_lora_weights(output_dir, **saved)


def save_kohya(args):
    """The file just saved, in kohya's format, with SD 1.x's names for the text encoder and the
    run's α (guide 5)."""
    layers = load_file(f"{args.output_dir}/pytorch_lora_weights.safetensors")
    for k in [k for k in layers if k.startswith("text_encoder.")]:
        clip_key = k.removeprefix("text_encoder.").removeprefix("text_model.")
        layers[f"text_encoder.text_model.{clip_key}"] = layers.pop(k)
    kohya = convert_state_dict_to_kohya(layers)
    kohya = {k.replace("lora_te1_", "lora_te_"): v for k, v in kohya.items()}
    kohya |= {k: torch.tensor(args.lora_alpha) for k in kohya if k.endswith(".alpha")}
    # The folder's name, also for --output_dir .
    name = os.path.basename(os.path.abspath(args.output_dir))
    save_file(kohya, f"{args.output_dir}/{name}.safetensors")


def save_model_card(args, tags, usage, shown):
    """README.md in --output_dir, as the Diffusers examples write one for the Hub: the base model,
    how to load the weights (lines that run as pasted), their held-out loss and the command. Code
    is indented, not fenced: a prompt cannot end the block. A README.md that is not a card of
    these scripts is kept."""
    path = Path(args.output_dir, "README.md")
    if path.exists() and "Held-out loss of these weights" not in path.read_text(errors="replace"):
        return logger.warning(f"{path} is not a model card of ours: kept, no card written")
    loss = f"{shown['val_loss']:.4f}" if shown else "not measured"
    base_model = args.pretrained_model_name_or_path
    text = (
        f"# {os.path.basename(os.path.abspath(args.output_dir))}\n\nFine-tuned from {base_model} "
        f"by `{os.path.basename(sys.argv[0])}`. Held-out loss of these weights: {loss}.\n\n"
        f"{textwrap.indent(usage, '    ')}\n\n## Training\n\n"
        f"{textwrap.indent(shlex.join(sys.argv), '    ')}\n"
    )
    # The Hub checks the header, where base_model must name a model of the Hub, not a folder.
    hub_model = None if os.path.isdir(base_model) else base_model
    card_data = ModelCardData(library_name="diffusers", tags=tags, base_model=hub_model)
    ModelCard(f"---\n{card_data.to_yaml()}\n---\n{text}").save(path)


# ------------------------------------------------------------------------------------------------
# Running for real: bad input in one line, signals, the file `stopped`, processes that end. None
# of it is diffusion; docs/reference.md ("Running for real") says what each part is for.


def check_args(p, args, refused):
    """Flags left out stop (the ignored ones say so in their help); flags that cannot go together
    stop."""
    for flag, value in vars(args).items():
        if value and flag in refused:
            p.error(f"--{flag} is left out: {refused[flag]}")
    if args.validate_every_n_steps and not args.validation_split:
        p.error("--validate_every_n_steps needs --validation_split")


def count(text, least=1):
    """argparse's type for a count: a whole number, `least` or more."""
    if int(text) < least:
        raise ValueError
    return int(text)


def count_or_0(text):
    return count(text, least=0)


def fraction(text, most=1):
    """argparse's type for a share: a number from 0 to `most` (NaN is none of them)."""
    if not 0 <= float(text) <= most:
        raise ValueError
    return float(text)


def at_least_0(text):
    return fraction(text, most=sys.float_info.max)


def process_group_kwargs():
    """Processes on CPUs talk over gloo (also under DeepSpeed); the others wait up to 2 h while
    the main process validates."""
    cpus = "LOCAL_RANK" in os.environ and not torch.accelerator.is_available()
    return InitProcessGroupKwargs(backend="gloo" if cpus else None, timeout=timedelta(hours=2))


@contextlib.contextmanager
def as_one_line(flag):
    """A library's error, re-raised as one line that names the flag or file it came from."""
    try:
        yield
    except Exception as e:
        raise SystemExit(f"error: {flag}: {type(e).__name__}: {' '.join(str(e).split())}") from None


def check_folders(args, final_file, reads_captions=False):
    """Before the models load, on every process: --output_dir holds no earlier run (checkpoints or
    final_file) that this one would replace, and --train_data_dir holds pictures; any other file
    in it that is not read (datasets' metadata, caption files where they are read) is named."""
    output_dir = Path(args.output_dir)
    if any(folder.is_file() for folder in [output_dir, *output_dir.absolute().parents]):
        raise SystemExit(f"error: --output_dir {output_dir}: a file is in the way")
    earlier = list_checkpoints(output_dir) or (output_dir / final_file).exists()
    if earlier and not (args.resume_from_checkpoint or args.overwrite_output_dir):
        raise SystemExit(
            f"error: --output_dir {output_dir} holds an earlier run: go on with "
            "--resume_from_checkpoint latest, or start again with --overwrite_output_dir"
        )
    if args.train_data_dir is None:
        return
    folder = Path(args.train_data_dir)
    if not folder.is_dir():
        raise SystemExit(f"error: --train_data_dir {folder}: no such folder")
    # What datasets' imagefolder reads: no hidden file; pictures by extension, metadata by name.
    imagefolder = datasets.packaged_modules.imagefolder.ImageFolder
    files = [
        p for p in folder.rglob("*") if p.is_file() and "/." not in f"/{p.relative_to(folder)}"
    ]
    kinds = Counter(
        sorted(p.suffix.lower() for p in files if p.name not in imagefolder.METADATA_FILENAMES)
    )
    # Zip archives of pictures too.
    pictures = {*imagefolder.EXTENSIONS, ".zip"}
    if not kinds.keys() & pictures:
        raise SystemExit(f"error: --train_data_dir {folder}: no pictures in it, only {dict(kinds)}")
    read = [*pictures, reads_captions and args.caption_extension]
    unread = {kind: n for kind, n in kinds.items() if kind not in read}
    if unread:
        logger.warning(
            f"{sum(unread.values())} files not read {unread}: convert pictures to JPEG or PNG"
        )


def remove_earlier_run(accelerator, args):
    """--overwrite_output_dir: the earlier run's checkpoints, samples and logs (where they lie in
    --output_dir) go; its final weights are replaced at the end; nothing else is touched."""
    # Every process has read the folder (check_folders) before prepare, where they all meet.
    if args.overwrite_output_dir and accelerator.is_main_process:
        output_dir = Path(args.output_dir)
        logs = output_dir / args.logging_dir
        earlier = [*output_dir.glob("tmp-checkpoint-*"), output_dir / "samples"]
        earlier += [output_dir / name for name in list_checkpoints(output_dir)]
        # The logs too, where they lie in --output_dir.
        if output_dir.resolve() in logs.resolve().parents:
            earlier.append(logs)
        for path in earlier:
            shutil.rmtree(path, ignore_errors=True)
    accelerator.wait_for_everyone()


def start_run(accelerator, args):
    """Before the models load: refuse a launch that cannot run; until the first step a signal
    ends the run at once; DataLoader workers die with the process."""
    if accelerator.mixed_precision == "fp16" and accelerator.device.type == "cpu":
        raise SystemExit("error: --mixed_precision fp16 needs a GPU; on a CPU use bf16 or no")
    if accelerator.distributed_type in (DistributedType.DEEPSPEED, DistributedType.FSDP):
        raise SystemExit("error: launch with DDP, not DeepSpeed or FSDP")
    handle_signals(accelerator, args, at_once=True)
    atexit.register(kill_workers)


def kill_workers():
    """At exit: DataLoader workers ignore SIGTERM (ignore_signals), so multiprocessing's own exit
    would wait on them forever. Without torch's SIGCHLD handler first, which raises once a worker
    has died (and may have fired once more as this began)."""
    for attempt in range(2):
        with contextlib.suppress(RuntimeError):
            if hasattr(signal, "SIGCHLD"):
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            for worker in multiprocessing.active_children():
                worker.kill()
            return


def handle_signals(accelerator, args, at_once):
    """SIGTERM (a scheduler's notice), SIGINT (Ctrl-C): the main process writes the file `stopped`
    in --output_dir at once, which a scheduler tests to requeue the run (a launcher may kill the
    processes before their checkpoint is whole). at_once the run ends; else the first signal asks
    the loop to checkpoint and stop (the list returned; set_trigger for the other processes), a
    second ends the run."""
    received = []

    def handler(signum, frame):
        # Slurm signals every process, which torchrun signals again: a repeat within 1 s is one.
        if not received or time.monotonic() - received[-1] > 1:
            received.append(time.monotonic())
            why = f"Stopped by {signal.Signals(signum).name}"
            if accelerator.is_main_process:
                os.makedirs(args.output_dir, exist_ok=True)
                Path(args.output_dir, "stopped").write_text(why)
            if at_once or len(received) > 1:
                stop_run(accelerator, args, why)
            accelerator.set_trigger()

    # Training starts: the file `stopped` of an earlier run goes, before a signal can write it.
    if not at_once and accelerator.is_main_process:
        Path(args.output_dir, "stopped").unlink(missing_ok=True)
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, handler)
    return received


def ignore_signals(*worker_id):
    """The signals of a DataLoader worker (its worker_init_fn), which leaves them to the main
    process, and of a finished run."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def stop_run(accelerator, args, why, global_step=None):
    """A checkpoint of global_step if given, then exit 75 (EX_TEMPFAIL, "try again later")."""
    if global_step is not None:
        save_checkpoint(accelerator, args, global_step)
    logger.info(f"{why}: go on with --resume_from_checkpoint latest")
    raise SystemExit(75)


def end_run(accelerator, args):
    """Finished: from now on a signal changes nothing, and there is nothing to requeue."""
    ignore_signals()
    if accelerator.is_main_process:
        Path(args.output_dir, "stopped").unlink(missing_ok=True)
    accelerator.end_training()


if __name__ == "__main__":
    main(parse_args())
