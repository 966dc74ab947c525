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
import contextlib
import io
import logging
import math
import os
import shutil
import time
from functools import partial

import datasets
import torch
import torch.nn.functional as F
import torchvision
from accelerate import Accelerator
from accelerate.logging import get_logger
from accelerate.utils import DataLoaderConfiguration, ProjectConfiguration, set_seed
from datasets import load_dataset
from diffusers import (AutoencoderKL, DDPMScheduler, DPMSolverMultistepScheduler, StableDiffusionPipeline,
                       UNet2DConditionModel)
from diffusers.optimization import SchedulerType, get_scheduler
from diffusers.training_utils import EMAModel, compute_snr
from PIL import Image
from torchvision import transforms
from tqdm.auto import tqdm
from transformers import CLIPTextModel, CLIPTokenizer

logger = get_logger(__name__)
INTERPOLATIONS = [mode.value for mode in transforms.InterpolationMode]
PIPELINE_PARTS = {"scheduler": "scheduler_config.json", "tokenizer": "tokenizer_config.json",
                  "text_encoder": "config.json", "vae": "config.json", "unet": "config.json"}


# 1. Arguments: the Diffusers example's flags and defaults, so existing commands work unchanged
def parse_args(argv=None):
    p = argparse.ArgumentParser(description="Fine-tune the UNet of a Stable Diffusion 1.x pipeline.")
    p.add_argument("--pretrained_model_name_or_path", default=None, help="A hub id or a local pipeline folder.")
    p.add_argument("--revision", default=None)
    p.add_argument("--variant", default=None, help='Weights variant to load, e.g. "fp16".')
    p.add_argument("--dataset_name", default=None, help="A hub dataset id, or a local dataset folder.")
    p.add_argument("--dataset_config_name", default=None)
    p.add_argument("--train_data_dir", default=None, help="A `datasets` imagefolder (used if no --dataset_name).")
    p.add_argument("--image_column", default="image", help="The dataset column that holds the images.")
    p.add_argument("--caption_column", default="text", help="The column with a caption or a list of captions.")
    p.add_argument("--max_train_samples", type=int, default=None, help="Train on a seeded random subset.")
    p.add_argument("--validation_prompts", nargs="+", default=None)
    p.add_argument("--validation_epochs", type=int, default=5, help="Sample the validation prompts every N epochs.")
    p.add_argument("--output_dir", default="sd-model-finetuned")
    p.add_argument("--cache_dir", default=None, help="Where models and datasets are cached.")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--resolution", type=int, default=512)
    p.add_argument("--center_crop", action="store_true", help="Center crop instead of a random crop.")
    p.add_argument("--random_flip", action="store_true", help="Flip images horizontally at random.")
    p.add_argument("--image_interpolation_mode", default="lanczos", choices=INTERPOLATIONS)
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
                   choices=["tensorboard", "wandb", "all", "none"])
    p.add_argument("--logging_dir", default="logs", help="TensorBoard folder, under output_dir.")
    p.add_argument("--tracker_project_name", default="text2image-fine-tune")
    p.add_argument("--mixed_precision", default=None, choices=["no", "fp16", "bf16"],
                   help="Defaults to the `accelerate config` setting.")
    p.add_argument("--allow_tf32", action="store_true", help="Faster fp32 matmuls on Ampere and newer GPUs.")
    p.add_argument("--prediction_type", default=None, choices=["epsilon", "v_prediction"],
                   help="Overrides the base model's scheduler config.")
    p.add_argument("--snr_gamma", type=float, default=None, help="Min-SNR-γ loss weighting; 5.0 is common.")
    p.add_argument("--noise_offset", type=float, default=0, help="Per-channel noise shift, e.g. 0.1.")
    p.add_argument("--input_perturbation", type=float, default=0, help="Extra noise on the UNet input, e.g. 0.1.")
    p.add_argument("--checkpointing_steps", type=int, default=500, help="Save the full state every N steps.")
    p.add_argument("--checkpoints_total_limit", type=int, default=None, help="Keep at most this many.")
    p.add_argument("--resume_from_checkpoint", default=None, help='A checkpoint-N folder name, or "latest".')
    args = p.parse_args(argv)
    if args.pretrained_model_name_or_path is None:
        p.error("give the base model: --pretrained_model_name_or_path")
    if args.dataset_name is None and args.train_data_dir is None:
        p.error("give a dataset: --dataset_name or --train_data_dir")
    return args


def main(args):
    # 2. Accelerator, logging, seed
    accelerator = Accelerator(
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        mixed_precision=args.mixed_precision,
        log_with=None if args.report_to == "none" else args.report_to,
        project_config=ProjectConfiguration(args.output_dir, os.path.join(args.output_dir, args.logging_dir)),
        # every process draws the same seeded permutation each epoch and takes its own share of it
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, data_seed=args.seed or 0),
    )
    if accelerator.mixed_precision == "fp16" and accelerator.device.type == "cpu":
        raise SystemExit("error: --mixed_precision fp16 needs a GPU; on a CPU use bf16 or no.")
    # INFO lines (progress notes, saved checkpoints) from the main process; library chatter from the others is muted
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", level=logging.INFO)
    if not accelerator.is_main_process:
        datasets.utils.logging.set_verbosity_error()
    if args.seed is not None:
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
    tokenizer = CLIPTokenizer.from_pretrained(subfolder="tokenizer", **load)
    # Under DeepSpeed ZeRO-3, models created now would be split across GPUs. The frozen ones run outside
    # DeepSpeed and must stay whole, so that splitting is switched off while they load.
    plugin = accelerator.state.deepspeed_plugin
    with plugin.zero3_init_context_manager(enable=False) if plugin else contextlib.nullcontext():
        text_encoder = CLIPTextModel.from_pretrained(subfolder="text_encoder", variant=args.variant, **load)
        vae = AutoencoderKL.from_pretrained(subfolder="vae", variant=args.variant, **load)
    model = UNet2DConditionModel.from_pretrained(subfolder="unet", variant=args.variant, **load)
    downsampling = 2 ** (len(vae.config.block_out_channels) - 1)
    if args.resolution % downsampling:
        raise SystemExit(f"error: --resolution {args.resolution} must be a multiple of {downsampling}, the VAE's downsampling factor.")
    vae.requires_grad_(False)
    text_encoder.requires_grad_(False)
    # Frozen models run in the mixed-precision dtype; the UNet keeps fp32 master weights for the optimizer
    weight_dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(accelerator.mixed_precision, torch.float32)
    vae.to(accelerator.device, dtype=weight_dtype)
    text_encoder.to(accelerator.device, dtype=weight_dtype)
    if args.gradient_checkpointing:
        model.enable_gradient_checkpointing()
    if args.use_ema:
        ema_model = EMAModel(model.parameters(), model_cls=UNet2DConditionModel, model_config=model.config,
                             foreach=args.foreach_ema)

    # 4. Data: a hub dataset or a local imagefolder with captions; images resized, cropped, flipped, scaled
    #    to [-1, 1]; captions tokenized to the text encoder's fixed length
    train_dataset = load_train_dataset(args)
    for column, flag in [(args.image_column, "--image_column"), (args.caption_column, "--caption_column")]:
        if column not in train_dataset.column_names:
            raise SystemExit(f"error: {flag} '{column}' is not in the dataset; its columns are {train_dataset.column_names}")
    if args.max_train_samples is not None:
        train_dataset = train_dataset.shuffle(seed=args.seed).select(range(min(args.max_train_samples, len(train_dataset))))
    check_captions(train_dataset, args.caption_column)
    check_images(train_dataset, args.image_column)
    train_dataset = train_dataset.add_column("row", list(range(len(train_dataset))))
    train_transforms = transforms.Compose([
        transforms.Resize(args.resolution, interpolation=transforms.InterpolationMode(args.image_interpolation_mode)),
        transforms.CenterCrop(args.resolution) if args.center_crop else transforms.RandomCrop(args.resolution),
        transforms.RandomHorizontalFlip() if args.random_flip else transforms.Lambda(lambda x: x),
        transforms.ToTensor(),
        transforms.Normalize([0.5], [0.5]),
    ])
    latent_shape = (vae.config.latent_channels, args.resolution // downsampling, args.resolution // downsampling)

    def preprocess_train(examples, epoch):
        # Each image's crop, flip, caption choice, noise ε and timestep t come from a seed of (seed, epoch,
        # row), not from the global random stream: the same draws however the run is batched, split across
        # processes or resumed (the dataloader reads a batch ahead, which would shift a shared stream).
        columns = {"pixel_values": [], "captions": [], "noise": [], "perturbation": [], "timesteps": [], "latent_noise": []}
        for image, caption, row in zip(examples[args.image_column], examples[args.caption_column], examples["row"]):
            with torch.random.fork_rng(devices=[]):
                torch.default_generator.manual_seed(hash((args.seed, epoch, row)) % 2**63)  # the CPU stream
                columns["pixel_values"].append(train_transforms(image.convert("RGB")))
                columns["captions"].append(caption if isinstance(caption, str) else caption[torch.randint(len(caption), ())])
                noise = torch.randn(latent_shape)
                noise += args.noise_offset * torch.randn(latent_shape[0], 1, 1)  # shifts whole channels: learns brightness
                columns["noise"].append(noise)
                columns["perturbation"].append(args.input_perturbation * torch.randn(latent_shape))  # UNet input only
                columns["timesteps"].append(torch.randint(0, noise_scheduler.config.num_train_timesteps, ()))
                columns["latent_noise"].append(torch.randn(latent_shape))  # to sample the VAE's posterior
        columns["input_ids"] = list(tokenizer(columns.pop("captions"), max_length=tokenizer.model_max_length,
                                              padding="max_length", truncation=True, return_tensors="pt").input_ids)
        return columns

    train_dataset.set_transform(partial(preprocess_train, epoch=0))
    train_dataloader = torch.utils.data.DataLoader(
        train_dataset, batch_size=args.train_batch_size, shuffle=True, num_workers=args.dataloader_num_workers
    )

    # 5. Optimizer and LR schedule. Steps are counted on the *prepared* (per-process) dataloader; the
    #    prepared scheduler steps once per process, hence the `* num_processes`.
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
    model, optimizer, train_dataloader = accelerator.prepare(model, optimizer, train_dataloader)
    num_update_steps_per_epoch = math.ceil(len(train_dataloader) / args.gradient_accumulation_steps)
    if args.max_train_steps is None:
        args.max_train_steps = args.num_train_epochs * num_update_steps_per_epoch
    args.num_train_epochs = math.ceil(args.max_train_steps / num_update_steps_per_epoch)
    lr_scheduler = accelerator.prepare(get_scheduler(
        args.lr_scheduler, optimizer=optimizer,
        num_warmup_steps=args.lr_warmup_steps * accelerator.num_processes,
        num_training_steps=args.max_train_steps * accelerator.num_processes,
    ))
    if args.use_ema and args.offload_ema and accelerator.device.type == "cuda":
        ema_model.pin_memory()  # page-locked host memory: the copies to and from the GPU need not wait
    elif args.use_ema and not args.offload_ema:
        ema_model.to(accelerator.device)

    # 6. Checkpoint hooks and resume. The hooks write the UNet (and its EMA) as `save_pretrained`
    #    folders, and pop them so accelerate does not store the weights twice.
    def save_model_hook(models, weights, output_dir):
        if accelerator.is_main_process:
            if args.use_ema:
                ema_model.save_pretrained(os.path.join(output_dir, "unet_ema"))
            accelerator.unwrap_model(models[0]).save_pretrained(os.path.join(output_dir, "unet"))
        if weights:  # empty under DeepSpeed, which saves its own way
            weights.pop()

    def load_model_hook(models, input_dir):
        if args.use_ema:
            loaded = EMAModel.from_pretrained(os.path.join(input_dir, "unet_ema"), UNet2DConditionModel, foreach=args.foreach_ema)
            ema_model.load_state_dict(loaded.state_dict())
            ema_model.to("cpu" if args.offload_ema else accelerator.device)
        loaded = UNet2DConditionModel.from_pretrained(input_dir, subfolder="unet")
        accelerator.unwrap_model(models.pop()).load_state_dict(loaded.state_dict())

    accelerator.register_save_state_pre_hook(save_model_hook)
    accelerator.register_load_state_pre_hook(load_model_hook)

    global_step, first_epoch, resume_step = 0, 0, 0
    if args.resume_from_checkpoint:
        path = find_checkpoint(args.output_dir, args.resume_from_checkpoint)
        if path is None:
            accelerator.print(f"Checkpoint '{args.resume_from_checkpoint}' not found; starting a new run.")
        else:
            accelerator.print(f"Resuming from {path}")
            accelerator.load_state(path)
            global_step = int(os.path.basename(path).split("-")[1])
            first_epoch = global_step // num_update_steps_per_epoch
            # the batches of the partial epoch already trained on, skipped below
            resume_step = (global_step % num_update_steps_per_epoch) * args.gradient_accumulation_steps
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
    train_loss, step_start = 0.0, time.perf_counter()
    for epoch in range(first_epoch, args.num_train_epochs):
        model.train()
        train_dataset.set_transform(partial(preprocess_train, epoch=epoch))
        train_dataloader.set_epoch(epoch)
        batches = train_dataloader
        if epoch == first_epoch and resume_step:
            batches = accelerator.skip_first_batches(train_dataloader, resume_step)
        for batch in batches:
            noise, timesteps = batch["noise"], batch["timesteps"]
            with torch.no_grad():
                # z_0: a sample of the VAE's posterior N(μ, σ²), scaled to unit variance
                posterior = vae.encode(batch["pixel_values"].to(weight_dtype)).latent_dist
                latents = (posterior.mean + posterior.std * batch["latent_noise"].to(weight_dtype)).float()
                latents = latents * vae.config.scaling_factor
                encoder_hidden_states = text_encoder(batch["input_ids"], return_dict=False)[0]
            # The forward process in closed form: z_t = √ᾱ_t·z_0 + √(1−ᾱ_t)·ε (ε perturbed if asked)
            noisy_latents = noise_scheduler.add_noise(latents, noise + batch["perturbation"], timesteps)

            with accelerator.accumulate(model):
                model_output = model(noisy_latents, timesteps, encoder_hidden_states, return_dict=False)[0]
                if noise_scheduler.config.prediction_type == "epsilon":
                    target = noise
                else:  # v = √ᾱ_t·ε − √(1−ᾱ_t)·z_0
                    target = noise_scheduler.get_velocity(latents, noise, timesteps)
                # the same loss as Algorithm 1, now on latents; one value per image so it can be weighted
                loss = F.mse_loss(model_output.float(), target.float(), reduction="none").mean(dim=[1, 2, 3])
                loss = (loss * snr_loss_weights(noise_scheduler, timesteps, args)).mean()
                # the mean over all processes, for the log
                train_loss += accelerator.gather(loss.detach()).mean().item() / args.gradient_accumulation_steps
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)
                optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad()

            if accelerator.sync_gradients:  # an optimizer step happened
                if args.use_ema:
                    if args.offload_ema:
                        ema_model.to(accelerator.device, non_blocking=True)
                    ema_model.step(model.parameters())
                    if args.offload_ema:
                        ema_model.to("cpu", non_blocking=True)
                global_step += 1
                images_per_s = total_batch_size / (time.perf_counter() - step_start)
                logs = {"train_loss": train_loss, "lr": lr_scheduler.get_last_lr()[0], "img/s": images_per_s}
                progress_bar.update(1)
                progress_bar.set_postfix(loss=train_loss, img_s=f"{images_per_s:.1f}")
                accelerator.log(logs, step=global_step)
                if global_step % args.checkpointing_steps == 0:
                    save_checkpoint(accelerator, args, global_step)
                train_loss, step_start = 0.0, time.perf_counter()
            if global_step >= args.max_train_steps:
                break

        # 8. Validation: the validation prompts with a fixed seed (EMA weights if used), logged and saved
        last_epoch = epoch == args.num_train_epochs - 1 or global_step >= args.max_train_steps
        if accelerator.is_main_process and args.validation_prompts and (epoch % args.validation_epochs == 0 or last_epoch):
            log_validation(accelerator, args, vae, text_encoder, tokenizer, model, ema_model if args.use_ema else None,
                           noise_scheduler, global_step)
        step_start = time.perf_counter()
        if global_step >= args.max_train_steps:
            break

    # 9. Final save: a complete pipeline folder, the UNet holding the EMA weights if --use_ema. The frozen
    #    parts come from the base model as they are on disk, not in the mixed-precision dtype used here.
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        unet = accelerator.unwrap_model(model)
        if args.use_ema:
            ema_model.copy_to(unet.parameters())
        pipeline = StableDiffusionPipeline.from_pretrained(unet=unet, variant=args.variant, **load)
        # the base scheduler's config, carrying the prediction type this UNet was trained for
        pipeline.scheduler.register_to_config(prediction_type=noise_scheduler.config.prediction_type)
        pipeline.save_pretrained(args.output_dir)
        write_model_card(args, global_step)
        logger.info(f"Saved the pipeline to {args.output_dir}")
    accelerator.end_training()


def check_pipeline_folder(path):
    """A local base model must be a Stable Diffusion pipeline folder: say which part is missing."""
    if not os.path.isdir(path):
        if path.startswith(("/", ".", "~")):
            raise SystemExit(f"error: --pretrained_model_name_or_path {path} is not a folder")
        return  # a hub id
    for part, config in PIPELINE_PARTS.items():
        if not os.path.isfile(os.path.join(path, part, config)):
            raise SystemExit(f"error: --pretrained_model_name_or_path {path} is not a Stable Diffusion pipeline: no {part}/{config}")


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
            dataset = load_dataset(args.dataset_name, args.dataset_config_name, cache_dir=args.cache_dir, split="train")
        else:
            dataset = load_dataset("imagefolder", data_dir=args.train_data_dir, cache_dir=args.cache_dir, split="train")
    except Exception as e:  # datasets raises many kinds: say which input failed, and why
        raise SystemExit(f"error: could not load {flag} {source}: {type(e).__name__}: {e}") from None
    if len(dataset) == 0:
        raise SystemExit(f"error: {flag} {source} has no images")
    return dataset


def check_captions(dataset, column):
    """Every caption must be a string or a non-empty list of strings; name the first row that is not."""
    for i, caption in enumerate(dataset[column]):
        if not (isinstance(caption, str) or (isinstance(caption, list) and caption and all(isinstance(c, str) for c in caption))):
            raise SystemExit(f"error: --caption_column '{column}' row {i} is {caption!r}: give a string or a list of strings")


def check_images(dataset, column):
    """Open every image once before training, so a broken file stops the run now, by name."""
    for i, item in enumerate(dataset.select_columns([column]).cast_column(column, datasets.Image(decode=False))):
        item = item[column]
        try:
            Image.open(io.BytesIO(item["bytes"]) if item["bytes"] else item["path"]).verify()
        except Exception as e:
            raise SystemExit(f"error: image {item['path'] or f'row {i}'} cannot be read: {e}") from None


def find_checkpoint(output_dir, name):
    """`latest` is the highest checkpoint-N; any other name is a folder under output_dir."""
    if name == "latest":
        found = [d for d in os.listdir(output_dir) if is_checkpoint_name(d)] if os.path.isdir(output_dir) else []
        return os.path.join(output_dir, max(found, key=lambda d: int(d[11:]))) if found else None
    path = os.path.join(output_dir, os.path.basename(os.path.normpath(name)))
    if not os.path.exists(path):
        return None
    if not (is_checkpoint_name(os.path.basename(path)) and os.path.isfile(os.path.join(path, "optimizer.bin"))):
        raise SystemExit(f"error: --resume_from_checkpoint {path} is not a checkpoint-N folder written by this script")
    return path


def is_checkpoint_name(name):
    return name.startswith("checkpoint-") and name[len("checkpoint-"):].isdigit()


def save_checkpoint(accelerator, args, global_step):
    """Rotate, then save to a temporary folder and rename it: a crash mid-save leaves no broken checkpoint-N."""
    final = os.path.join(args.output_dir, f"checkpoint-{global_step}")
    tmp = os.path.join(args.output_dir, f"tmp-checkpoint-{global_step}")
    if accelerator.is_main_process:
        if args.checkpoints_total_limit is not None:
            old = sorted((d for d in os.listdir(args.output_dir) if is_checkpoint_name(d)), key=lambda d: int(d[11:]))
            for d in old[: max(0, len(old) - args.checkpoints_total_limit + 1)]:
                shutil.rmtree(os.path.join(args.output_dir, d))
        shutil.rmtree(tmp, ignore_errors=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(tmp)  # every process writes its own RNG state
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        shutil.rmtree(final, ignore_errors=True)
        os.rename(tmp, final)
        logger.info(f"Saved state to {final}")


def log_validation(accelerator, args, vae, text_encoder, tokenizer, model, ema_model, noise_scheduler, global_step):
    unet = accelerator.unwrap_model(model)
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
    generator = torch.Generator("cpu").manual_seed(args.seed or 0)  # the same starting noise every time
    with accelerator.autocast():
        images = pipeline(args.validation_prompts, num_inference_steps=20, generator=generator,
                          height=args.resolution, width=args.resolution, output_type="np").images
    if ema_model is not None:
        ema_model.restore(unet.parameters())
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
    flags = " ".join(f"--{k} {v}" for k, v in sorted(vars(args).items()) if v not in (None, False) and k != "validation_prompts")
    grid = f"samples/step-{global_step}.png"
    lines = [
        "---", f"base_model: {args.pretrained_model_name_or_path}", "library_name: diffusers",
        "tags: [stable-diffusion, text-to-image, diffusers]", "---", "",
        f"# Fine-tune of {args.pretrained_model_name_or_path}", "",
        f"The UNet of `{args.pretrained_model_name_or_path}` trained on `{data}` for {global_step} steps "
        f"with `train_text_to_image.py`; the VAE, text encoder and tokenizer are the base model's.", "",
        "```python", "from diffusers import DiffusionPipeline",
        f'pipe = DiffusionPipeline.from_pretrained("{args.output_dir}")', "```", "",
        f"Flags: `{flags}`",
    ]
    if os.path.isfile(os.path.join(args.output_dir, grid)):
        lines += ["", f"Validation prompts: {args.validation_prompts}", "", f"![samples]({grid})"]
    with open(os.path.join(args.output_dir, "README.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main(parse_args())
