#!/usr/bin/env python
"""train_unconditional.py: a DDPM trained from scratch, the first diffusion script to read.

A `UNet2DModel` learns to predict the noise that was added to an image (Ho et al. 2020). Training
repeats Algorithm 1 of the paper: take an image x_0, pick a timestep t, mix in Gaussian noise
ε to get x_t ~ q(x_t | x_0), and regress the UNet's output on ε. Sampling (Algorithm 2) is the
`DDPMPipeline` you get at the end.

    accelerate launch train_unconditional.py --train_data_dir data/digits --resolution 32 \
        --model_config_name_or_path configs/unet-digits --output_dir ddpm-digits

Sections, the same in every script of this repo: 1 arguments, 2 accelerator/logging/seed,
3 models, 4 data, 5 optimizer and LR schedule, 6 checkpoint hooks and resume, 7 training loop,
8 validation, 9 final save.
"""
import argparse
import importlib.util
import json
import logging
import math
import os
import secrets
import shutil
import time
from datetime import timedelta
from functools import partial

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
from diffusers import DDIMScheduler, DDPMPipeline, DDPMScheduler, DPMSolverMultistepScheduler, UNet2DModel
from diffusers.optimization import SchedulerType, get_scheduler
from huggingface_hub import create_repo, upload_folder
from diffusers.training_utils import EMAModel, compute_snr
from PIL import Image
from torch.utils.flop_counter import FlopCounterMode
from torchvision import transforms
from tqdm.auto import tqdm

logger = get_logger(__name__)
TRAINER = "train_unconditional"  # recorded in checkpoints: another script's checkpoint is refused
ROW = "__row__"  # a private column: each image's row in the full dataset, for its per-sample seed
PER_STEP = ("num_processes", "train_batch_size", "gradient_accumulation_steps")  # their product: images per step
SHARDING = (DistributedType.DEEPSPEED, DistributedType.FSDP)  # backends that store a checkpoint in their own way
SPLIT_NAMES = {"train", "training", "test", "testing", "eval", "evaluation", "valid", "validation", "val", "dev"}
FULL_IMAGE_CHECK = 10_000  # datasets up to this size are decoded in full before training; larger ones as they load
# Dense bf16/fp16 tensor-core peaks (datasheets, sparsity excluded) in TFLOP/s, for MFU. The first key found in
# torch.cuda.get_device_name() wins: H100 SXM calls itself "H100 80GB HBM3"; GeForce figures are with fp32 accumulation.
PEAK_TFLOPS = {"H100 NVL": 835, "H100 PCIe": 756, "H100": 989, "H200 NVL": 835, "H200": 989, "B200": 2250, "A100": 312,
               "A10G": 70, "A10": 125, "L40S": 362, "L40": 181, "L4": 121, "RTX 4090": 165, "RTX 3090": 71, "V100": 125}


# 1. Arguments: the Diffusers example's flags and defaults, so existing commands work unchanged
def parse_args(argv=None):
    p = argparse.ArgumentParser(description="Train a DDPM (UNet2DModel) from scratch.")
    p.add_argument("--dataset_name", default=None, help="A hub dataset id, or a local dataset folder.")
    p.add_argument("--dataset_config_name", default=None)
    p.add_argument("--train_data_dir", default=None, help="A `datasets` imagefolder (used if no --dataset_name).")
    p.add_argument("--image_column", default="image", help="The dataset column that holds the images.")
    p.add_argument("--model_config_name_or_path", default=None, help="A folder with a UNet2DModel config.json.")
    p.add_argument("--output_dir", default="ddpm-model-64")
    p.add_argument("--overwrite_output_dir", action="store_true", help="Accepted, as in the Diffusers example; no effect.")
    p.add_argument("--cache_dir", default=None, help="Where `datasets` caches downloads.")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--resolution", type=int, default=64)
    p.add_argument("--center_crop", action="store_true", help="Center crop instead of a random crop.")
    p.add_argument("--random_flip", action="store_true", help="Flip images horizontally at random.")
    p.add_argument("--preserve_input_precision", action="store_true", help="Train 16-bit images at 16 bits, not 8.")
    p.add_argument("--train_batch_size", type=int, default=16, help="Batch size per device.")
    p.add_argument("--eval_batch_size", type=int, default=16, help="How many images to sample for validation.")
    p.add_argument("--dataloader_num_workers", type=int, default=0)
    p.add_argument("--num_epochs", "--num_train_epochs", dest="num_train_epochs", type=int, default=100)
    p.add_argument("--max_train_steps", type=int, default=None, help="Overrides --num_epochs if set.")
    p.add_argument("--save_images_epochs", type=int, default=10, help="Sample validation images every N epochs.")
    p.add_argument("--save_model_epochs", type=int, default=10, help="Save the pipeline every N epochs.")
    p.add_argument("--validation_steps", type=int, default=None, help="Also sample validation images every N steps.")
    p.add_argument("--save_model_steps", type=int, default=None, help="Also save the pipeline every N steps.")
    p.add_argument("--gradient_accumulation_steps", type=int, default=1)
    p.add_argument("--gradient_checkpointing", action="store_true", help="Save memory at ~30% more compute.")
    p.add_argument("--learning_rate", type=float, default=1e-4)
    p.add_argument("--lr_scheduler", default="cosine", choices=[s.value for s in SchedulerType])
    p.add_argument("--lr_warmup_steps", type=int, default=500)
    p.add_argument("--adam_beta1", type=float, default=0.95)
    p.add_argument("--adam_beta2", type=float, default=0.999)
    p.add_argument("--adam_weight_decay", type=float, default=1e-6)
    p.add_argument("--adam_epsilon", type=float, default=1e-08)
    p.add_argument("--use_8bit_adam", action="store_true", help="bitsandbytes' 8-bit AdamW (GPU).")
    p.add_argument("--max_grad_norm", type=float, default=1.0)
    p.add_argument("--use_ema", action="store_true", help="Keep an exponential moving average of the weights.")
    p.add_argument("--ema_inv_gamma", type=float, default=1.0)
    p.add_argument("--ema_power", type=float, default=3 / 4)
    p.add_argument("--ema_max_decay", type=float, default=0.9999)
    p.add_argument("--logger", "--report_to", dest="report_to", default="tensorboard",
                   choices=[*LOGGER_TYPE_TO_CLASS, "all", "none"])
    p.add_argument("--logging_dir", default="logs", help="TensorBoard folder, under output_dir.")
    p.add_argument("--mixed_precision", default=None, choices=["no", "fp16", "bf16"],
                   help="Defaults to the `accelerate config` setting.")
    p.add_argument("--allow_tf32", action="store_true", help="Faster fp32 matmuls on Ampere and newer GPUs.")
    p.add_argument("--peak_tflops", type=float, default=None, help="The accelerator's dense peak, for the MFU log.")
    p.add_argument("--prediction_type", default="epsilon", choices=["epsilon", "sample"])
    p.add_argument("--snr_gamma", type=float, default=None, help="Min-SNR-γ loss weighting; 5.0 is common.")
    p.add_argument("--ddpm_num_steps", type=int, default=1000)
    p.add_argument("--ddpm_num_inference_steps", type=int, default=1000)
    p.add_argument("--validation_sampler", default="ddpm", choices=["ddpm", "ddim", "dpm"],
                   help="ddim or dpm (DPM-Solver++) sample validation images in far fewer steps than ddpm.")
    p.add_argument("--validation_inference_steps", type=int, default=50, help="Steps for --validation_sampler ddim or dpm.")
    p.add_argument("--ddpm_beta_schedule", default="linear",
                   choices=["linear", "scaled_linear", "squaredcos_cap_v2", "sigmoid", "laplace"])
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
    if args.dataset_name is None and args.train_data_dir is None:
        p.error("give a dataset: --dataset_name or --train_data_dir")
    if args.report_to in ("wandb", "all") and args.hub_token is not None:  # as the Diffusers examples refuse it
        p.error("--hub_token with --report_to wandb would store the token in the wandb run: log in with `hf auth login` instead")
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

    # 3. Models: the UNet and the noise schedule β_1..β_T of the forward process
    if args.model_config_name_or_path:
        model = UNet2DModel.from_config(UNet2DModel.load_config(args.model_config_name_or_path))
    else:  # the Diffusers example's default
        model = UNet2DModel(
            sample_size=args.resolution,
            layers_per_block=2,
            block_out_channels=(128, 128, 256, 256, 512, 512),
            down_block_types=("DownBlock2D",) * 4 + ("AttnDownBlock2D", "DownBlock2D"),
            up_block_types=("UpBlock2D", "AttnUpBlock2D") + ("UpBlock2D",) * 4,
        )
    downsampling = 2 ** (len(model.config.block_out_channels) - 1)
    if args.resolution % downsampling:
        raise SystemExit(f"error: --resolution {args.resolution} must be a multiple of {downsampling}, the UNet's downsampling factor.")
    if args.gradient_checkpointing:
        model.enable_gradient_checkpointing()
    if args.enable_xformers_memory_efficient_attention and importlib.util.find_spec("xformers") is None:
        logger.info("xformers is not installed: PyTorch's scaled-dot-product attention, the default, is used")
    elif args.enable_xformers_memory_efficient_attention:
        model.enable_xformers_memory_efficient_attention()
    noise_scheduler = DDPMScheduler(
        num_train_timesteps=args.ddpm_num_steps,
        beta_schedule=args.ddpm_beta_schedule,
        prediction_type=args.prediction_type,
    )
    if args.use_ema:  # decay warms up as 1 - (1 + step / inv_gamma) ** -power, capped at --ema_max_decay
        ema_model = EMAModel(
            model.parameters(), decay=args.ema_max_decay, use_ema_warmup=True, inv_gamma=args.ema_inv_gamma,
            power=args.ema_power, model_cls=UNet2DModel, model_config=model.config,
        )

    # 4. Data: a hub dataset or a local imagefolder; images resized, cropped, flipped, scaled to [-1, 1]
    train_dataset = load_train_dataset(args)
    if args.image_column not in train_dataset.column_names:
        raise SystemExit(f"error: --image_column '{args.image_column}' is not in the dataset; its columns are {train_dataset.column_names}")
    # decoded by preprocess_train, so that a broken file is reported by name rather than deep inside `datasets`
    train_dataset = train_dataset.cast_column(args.image_column, datasets.Image(decode=False))
    train_dataset = train_dataset.add_column(ROW, np.arange(len(train_dataset)))  # before any subset: no rewrite
    if len(train_dataset) <= FULL_IMAGE_CHECK and accelerator.is_local_main_process:
        check_images(train_dataset, args.image_column)
    train_transforms = transforms.Compose([
        transforms.Resize(args.resolution, interpolation=transforms.InterpolationMode.BILINEAR),
        transforms.CenterCrop(args.resolution) if args.center_crop else transforms.RandomCrop(args.resolution),
        transforms.RandomHorizontalFlip(0.5 if args.random_flip else 0.0),
        transforms.ToTensor(),
        transforms.Normalize([0.5], [0.5]),
    ])
    data = dict(args=args, train_transforms=train_transforms, in_channels=model.config.in_channels)  # grey UNet: grey images
    train_dataset.set_transform(partial(preprocess_train, **data, epoch=0))
    train_dataloader = torch.utils.data.DataLoader(
        train_dataset, batch_size=args.train_batch_size, shuffle=True, num_workers=args.dataloader_num_workers,
        pin_memory=accelerator.device.type == "cuda",
    )

    # 5. Optimizer and LR schedule, prepared in one call (DeepSpeed wraps the scheduler only so). Steps are
    #    counted on each process's share of the batches. The schedule counts optimizer steps (the loop steps it,
    #    not accelerate), so a checkpoint means the same on any number of processes.
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
    if args.use_ema:
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
        accelerator.init_trackers("train_unconditional", config={k: v for k, v in vars(args).items() if v is not None})

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
            clean_images, noise, timesteps = batch["pixel_values"], batch["noise"], batch["timesteps"]
            # The forward process in closed form: x_t = √ᾱ_t·x_0 + √(1−ᾱ_t)·ε
            noisy_images = noise_scheduler.add_noise(clean_images, noise, timesteps)
            if flops is None:  # once, at the first micro-batch
                unet = accelerator.unwrap_model(model, keep_torch_compile=False)
                flops = training_flops(unet, args, noisy_images, timesteps)
                logger.info(f"One micro-batch of {len(timesteps)} images: UNet forward and backward {flops:.4g} FLOPs")

            with accelerator.accumulate(model):
                model_output = model(noisy_images.to(input_dtype), timesteps).sample
                target = noise if args.prediction_type == "epsilon" else clean_images
                # Algorithm 1's loss ‖ε − ε_θ(x_t, t)‖² (or ‖x_0 − x_θ‖² when predicting the sample), one
                # value per image so it can be weighted
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
                    ema_model.step(model.parameters())
                global_step += 1
                train_loss = accelerator.reduce(train_loss, "mean").item()  # the mean over all processes, for the log
                seconds = time.perf_counter() - step_start
                tflops = flops * args.gradient_accumulation_steps / seconds / 1e12  # the UNet's, on each process
                logs = {"loss": train_loss, "lr": lr_scheduler.get_last_lr()[0], "img/s": total_batch_size / seconds,
                        "tflops": tflops, **({"mfu": tflops / peak} if peak else {})}
                if args.use_ema:
                    logs["ema_decay"] = ema_model.cur_decay_value
                progress_bar.update(1)
                progress_bar.set_postfix(loss=train_loss, img_s=f"{logs['img/s']:.1f}", tflops=f"{tflops:.3g}")
                accelerator.log(logs, step=global_step)
                if global_step % args.checkpointing_steps == 0:
                    save_checkpoint(accelerator, args, global_step)
                if args.validation_steps and global_step % args.validation_steps == 0:
                    log_validation(accelerator, args, model, ema_model if args.use_ema else None, noise_scheduler, global_step, sharded)
                if args.save_model_steps and global_step % args.save_model_steps == 0:
                    save_pipeline(accelerator, args, model, ema_model if args.use_ema else None, noise_scheduler, sharded)
                train_loss, step_start = torch.zeros((), device=accelerator.device), time.perf_counter()
            if global_step >= args.max_train_steps:
                break

        # 8. Validation: sample images with a fixed seed (EMA weights if used), log and save them. With a sharded
        #    model every process takes part; otherwise the main process alone.
        last_epoch = epoch == args.num_train_epochs - 1 or global_step >= args.max_train_steps
        if epoch % args.save_images_epochs == 0 or last_epoch:
            log_validation(accelerator, args, model, ema_model if args.use_ema else None, noise_scheduler, global_step, sharded)
        if epoch % args.save_model_epochs == 0 and not last_epoch:  # the last one is the final save below
            save_pipeline(accelerator, args, model, ema_model if args.use_ema else None, noise_scheduler, sharded)
        step_start = time.perf_counter()
        if global_step >= args.max_train_steps:
            break

    # 9. Final save: a DDPMPipeline folder, with the EMA weights if --use_ema
    progress_bar.close()
    save_pipeline(accelerator, args, model, ema_model if args.use_ema else None, noise_scheduler, sharded)
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


def preprocess_train(examples, args, train_transforms, in_channels, epoch):
    """A module-level function (and a `partial` of it) pickles, so dataloader workers can be spawned.

    Each image's crop, flip, noise ε and timestep t come from a seed of (seed, epoch, row), not from the global
    random stream: the same draws however the run is batched, split across processes or resumed (the
    dataloader reads a batch ahead, which would shift a shared stream)."""
    columns = {"pixel_values": [], "noise": [], "timesteps": [], "unreadable": []}
    for item, row in zip(examples[args.image_column], examples[ROW]):
        image = open_image(item)
        columns["unreadable"].append("" if image is not None else item["path"] or f"row {row}")  # the loop stops on it
        with torch.random.fork_rng(devices=[]):
            torch.default_generator.manual_seed(sample_seed(args.seed, epoch, row))  # CPU only: 100x cheaper than torch.manual_seed
            pixel_values = train_transforms(image_for_model(image, args, in_channels)).expand(in_channels, -1, -1)
            columns["pixel_values"].append(pixel_values)
            columns["noise"].append(torch.randn(pixel_values.shape))
            columns["timesteps"].append(torch.randint(0, args.ddpm_num_steps, ()))
    return columns


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


def image_for_model(image, args, channels):
    """Grey for a one-channel UNet, else RGB; with --preserve_input_precision a 16-bit image becomes a float one in
    [0, 1] instead of 8-bit (its one channel is copied to each of the UNet's)."""
    mode = "L" if channels == 1 else "RGB"
    if image is None:  # unreadable: a stand-in, the training loop stops on it
        return Image.new(mode, (1, 1))
    if args.preserve_input_precision and image.mode.startswith("I"):  # 16-bit PNGs open as I or I;16
        return Image.fromarray(np.asarray(image, dtype=np.float32) / 65535).convert("F")
    return image.convert(mode)


def snr_loss_weights(noise_scheduler, timesteps, args):
    """Per-image loss weights from SNR(t) = ᾱ_t / (1 − ᾱ_t)."""
    snr = compute_snr(noise_scheduler, timesteps)
    if args.prediction_type == "sample":  # an x_0 error times SNR(t) is the ε error: the same objective
        return snr.clamp(max=args.snr_gamma or float("inf"))
    if args.snr_gamma is None:
        return torch.ones_like(snr)
    return snr.clamp(max=args.snr_gamma) / snr  # min-SNR-γ: cap the weight of the easy, nearly clean timesteps


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
    for name in batch["unreadable"]:
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
        loaded = EMAModel.from_pretrained(os.path.join(input_dir, "unet_ema"), UNet2DModel)
        ema_model.load_state_dict(loaded.state_dict())
        ema_model.to(accelerator.device)
    if models:  # plain or DDP; DeepSpeed and FSDP have loaded the model already
        loaded = UNet2DModel.from_pretrained(input_dir, subfolder="unet")
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


def log_validation(accelerator, args, model, ema_model, noise_scheduler, global_step, sharded):
    if not (accelerator.is_main_process or sharded):
        return
    unet = accelerator.unwrap_model(model, keep_torch_compile=False)
    unet.eval()  # no dropout while sampling (a config may set some); train() again below
    if ema_model is not None:  # sample with the EMA weights, then put the training weights back
        ema_model.store(unet.parameters())
        ema_model.copy_to(unet.parameters())
    # the training schedule's βs; DDIM and DPM-Solver take larger steps through it than DDPM's ancestral sampler
    sampler = {"ddpm": DDPMScheduler, "ddim": DDIMScheduler, "dpm": DPMSolverMultistepScheduler}[args.validation_sampler]
    pipeline = DDPMPipeline(unet=unet, scheduler=sampler.from_config(noise_scheduler.config))
    pipeline.set_progress_bar_config(disable=True)
    generator = torch.Generator("cpu").manual_seed(0)  # the same starting noise every time: progress is visible
    steps = args.ddpm_num_inference_steps if args.validation_sampler == "ddpm" else args.validation_inference_steps
    with accelerator.autocast():  # float: under DeepSpeed a bf16 UNet samples in bf16, which numpy cannot hold
        images = pipeline(generator=generator, batch_size=args.eval_batch_size, num_inference_steps=steps, output_type="pt").images.float().cpu()
    if ema_model is not None:
        ema_model.restore(unet.parameters())
    unet.train()
    if not accelerator.is_main_process:
        return
    os.makedirs(os.path.join(args.output_dir, "samples"), exist_ok=True)
    grid = F.interpolate(images, scale_factor=max(1, 64 // args.resolution), mode="nearest")  # small images enlarged, unblurred
    torchvision.utils.save_image(grid, os.path.join(args.output_dir, "samples", f"step-{global_step}.png"),
                                 nrow=math.ceil(math.sqrt(len(grid))))
    for tracker in accelerator.trackers:
        if tracker.name == "tensorboard":
            tracker.writer.add_images("test_samples", images, global_step)
        elif tracker.name == "wandb":
            import wandb
            tracker.log({"test_samples": [wandb.Image(image.permute(1, 2, 0).numpy()) for image in images]}, step=global_step)


def save_pipeline(accelerator, args, model, ema_model, noise_scheduler, sharded):
    """The DDPMPipeline folder, written by the main process; every process must call this (see full_model)."""
    unet = full_model(accelerator, model, sharded)
    if accelerator.is_main_process:
        if ema_model is not None:
            ema_model.store(unet.parameters())
            ema_model.copy_to(unet.parameters())
        DDPMPipeline(unet=unet, scheduler=noise_scheduler).save_pretrained(args.output_dir)
        if ema_model is not None:
            ema_model.restore(unet.parameters())
    accelerator.wait_for_everyone()


if __name__ == "__main__":
    main(parse_args())
