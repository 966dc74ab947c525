#!/usr/bin/env python
"""train_unconditional.py: a DDPM trained from scratch, the first diffusion script to read.

A UNet learns to predict the noise ε mixed into an image (Ho et al. 2020). Every step is the
paper's Algorithm 1: images x_0, noise ε ~ N(0, I), timesteps t ~ U{0..T-1}, noisy images
x_t = √ᾱ_t·x_0 + √(1-ᾱ_t)·ε, and a gradient step on ‖ε - ε_θ(x_t, t)‖² (or on v or x_0, if
--prediction_type says so). Sampling (Algorithm 2) is the DDPMPipeline saved at the end.

    accelerate launch train_unconditional.py --train_data_dir data/digits --resolution 16 \
        --model_config_name_or_path configs/unet-digits --output_dir ddpm-digits
"""

import argparse
import atexit
import contextlib
import logging
import math
import multiprocessing
import os
import re
import shutil
import signal
import sys
import time
from collections import Counter
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
from diffusers import DDPMPipeline, DDPMScheduler, UNet2DModel
from diffusers.optimization import get_scheduler
from diffusers.training_utils import EMAModel, compute_snr
from huggingface_hub import create_repo, upload_folder
from PIL import Image
from torch.utils.data import default_collate
from torchvision import transforms
from tqdm.auto import tqdm

logger = get_logger(__name__)


# 1. Arguments: the Diffusers example's flags and defaults, so its commands run unchanged
def parse_args(argv=None):
    p = argparse.ArgumentParser(description="Train a DDPM (UNet2DModel) from scratch.")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--dataset_name", help="A Hub dataset, or a folder `datasets` loads.")
    p.add_argument("--dataset_config_name", help="The dataset's configuration, if it has several.")
    source.add_argument("--train_data_dir", help="A folder of images (an imagefolder).")
    p.add_argument("--image_column", default="image", help="The dataset's image column.")
    p.add_argument("--cache_dir", help="Where downloads are cached (default: the HF cache).")
    p.add_argument("--preserve_input_precision", action="store_true", help="Left out: 8-bit RGB.")
    p.add_argument("--model_config_name_or_path", help="UNet2DModel config; default: example's.")
    p.add_argument("--output_dir", default="ddpm-model-64", help="Where outputs go.")
    p.add_argument("--seed", type=int, default=0, help="Seeds weights, data order, noise.")
    p.add_argument("--resolution", type=count, default=64, help="Image side after resize, crop.")
    p.add_argument("--center_crop", action="store_true", help="Center crop; default: random.")
    p.add_argument("--random_flip", action="store_true", help="Flip half the images left-right.")
    p.add_argument("--train_batch_size", type=count, default=16, help="Images per process, pass.")
    p.add_argument("--eval_batch_size", type=count, default=16, help="Images per validation grid.")
    p.add_argument("--dataloader_num_workers", type=count_or_0, default=0, help="Loaders.")
    p.add_argument("--num_epochs", type=count, default=100, help="Passes over the data.")
    p.add_argument("--max_train_steps", type=count, help="Steps to train; overrides the epochs.")
    p.add_argument("--save_images_epochs", type=count, default=10, help="Validate every N epochs.")
    p.add_argument("--save_model_epochs", type=count, default=10, help="Save every N epochs.")
    p.add_argument("--gradient_accumulation_steps", type=count, default=1, help="Batches a step.")
    p.add_argument("--gradient_checkpointing", action="store_true", help="Less memory, slower.")
    p.add_argument("--learning_rate", type=at_least_0, default=1e-4, help="AdamW's LR, warmed up.")
    p.add_argument("--lr_scheduler", default="cosine", help="constant, linear, cosine, ...")
    p.add_argument("--lr_warmup_steps", type=count_or_0, default=500, help="Steps of LR warm-up.")
    p.add_argument("--adam_beta1", type=fraction, default=0.95, help="AdamW's β1 (momentum).")
    p.add_argument("--adam_beta2", type=fraction, default=0.999, help="AdamW's β2 (2nd moment).")
    p.add_argument("--adam_weight_decay", type=at_least_0, default=1e-6, help="Weight decay.")
    p.add_argument("--adam_epsilon", type=at_least_0, default=1e-08, help="AdamW's ε.")
    p.add_argument("--max_grad_norm", type=at_least_0, default=1.0, help="Clip gradients to this.")
    p.add_argument("--use_ema", action="store_true", help="Save and sample an EMA of the weights.")
    p.add_argument("--ema_inv_gamma", type=at_least_0, default=1.0, help="EMA warm-up's γ.")
    p.add_argument("--ema_power", type=at_least_0, default=3 / 4, help="EMA warm-up power.")
    p.add_argument("--ema_max_decay", type=fraction, default=0.9999, help="The EMA's decay.")
    p.add_argument("--logger", default="tensorboard", help="tensorboard, wandb or none.")
    p.add_argument("--logging_dir", default="logs", help="Trackers' folder, in --output_dir.")
    p.add_argument("--mixed_precision", choices=["no", "fp16", "bf16"], help="fp16/bf16 autocast.")
    p.add_argument("--allow_tf32", action="store_true", help="TF32 matmuls on Ampere+: faster.")
    p.add_argument(
        "--enable_xformers_memory_efficient_attention",
        action="store_true",
        help="Ignored: PyTorch's SDPA attention is used.",
    )
    p.add_argument(
        "--prediction_type",
        default="epsilon",
        choices=["epsilon", "v_prediction", "sample"],
        help="The target: the noise ε, v = √ᾱ_t·ε - √(1-ᾱ_t)·x_0, or the image x_0 (sample).",
    )
    p.add_argument("--snr_gamma", type=at_least_0, help="Min-SNR-γ's γ (paper: 5.0); default off.")
    p.add_argument("--ddpm_num_steps", type=count, default=1000, help="T, the number of timesteps.")
    p.add_argument("--ddpm_num_inference_steps", type=count, default=1000, help="Sampling steps.")
    p.add_argument("--ddpm_beta_schedule", default="linear", help="β_1..β_T schedule, e.g. linear.")
    p.add_argument("--checkpointing_steps", type=count, default=500, help="Checkpoint every N.")
    p.add_argument("--checkpoints_total_limit", type=count, help="Keep the newest N; default all.")
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
    refused = {
        "hub_token": "a token in a command lands in shell history; run `hf auth login`",
        "preserve_input_precision": "images are read as 8-bit RGB (16-bit ones are scaled)",
    }
    check_args(p, args, refused)
    return args


def main(args):
    # 2. Accelerator, logging, seed. `accelerate launch` or `accelerate config` sets the devices,
    #    processes and precision: one file for a CPU, a GPU or many.
    accelerator = Accelerator(
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        mixed_precision=args.mixed_precision,
        log_with=None if args.logger == "none" else args.logger,
        project_config=ProjectConfiguration(
            args.output_dir, logging_dir=os.path.join(args.output_dir, args.logging_dir)
        ),
        # Every process draws the same permutation each epoch and takes its share of it.
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, data_seed=args.seed),
        # The loop steps the LR schedule once per optimizer step.
        step_scheduler_with_optimizer=False,
        kwargs_handlers=[process_group_kwargs()],
    )
    # The model without its DDP, DeepSpeed or torch.compile wrapper.
    unwrap = partial(accelerator.unwrap_model, keep_torch_compile=False)
    logging.basicConfig(level=logging.INFO)
    # What a real launch needs beside the lesson: "Running for real", at the end of the file.
    start_run(accelerator, args)
    check_folders(args, "model_index.json")
    # The same initial weights on every process.
    set_seed(args.seed)
    torch.backends.cuda.matmul.allow_tf32 = args.allow_tf32
    if args.push_to_hub and accelerator.is_main_process:
        repo_id = args.hub_model_id or os.path.basename(os.path.abspath(args.output_dir))
        # Now, not after hours of training.
        with as_one_line("--push_to_hub"):
            repo = create_repo(repo_id, private=args.hub_private_repo, exist_ok=True)

    # 3. Models: the UNet ε_θ, and the noise schedule β_1..β_T of the forward process
    dtypes = {"fp16": torch.float16, "bf16": torch.bfloat16}
    weight_dtype = dtypes.get(accelerator.mixed_precision, torch.float32)
    if args.model_config_name_or_path:
        with as_one_line(f"--model_config_name_or_path {args.model_config_name_or_path}"):
            model = UNet2DModel.from_config(UNet2DModel.load_config(args.model_config_name_or_path))
    else:
        # The Diffusers example's UNet.
        model = UNet2DModel(
            sample_size=args.resolution,
            layers_per_block=2,
            block_out_channels=(128, 128, 256, 256, 512, 512),
            down_block_types=("DownBlock2D",) * 4 + ("AttnDownBlock2D", "DownBlock2D"),
            up_block_types=("UpBlock2D", "AttnUpBlock2D") + ("UpBlock2D",) * 4,
        )
    if args.gradient_checkpointing:
        model.enable_gradient_checkpointing()
    noise_scheduler = DDPMScheduler(
        num_train_timesteps=args.ddpm_num_steps,
        beta_schedule=args.ddpm_beta_schedule,
        prediction_type=args.prediction_type,
    )
    ema_model = None
    # The EMA, an average of the weights that samples better; its decay after n steps is
    # 1 - (1 + n/inv_gamma)^-power, at most --ema_max_decay.
    if args.use_ema:
        ema_model = EMAModel(
            model.parameters(),
            decay=args.ema_max_decay,
            use_ema_warmup=True,
            inv_gamma=args.ema_inv_gamma,
            power=args.ema_power,
        )

    # 4. Data: images resized, cropped, flipped, scaled to [-1, 1]; the held-out ones apart
    # The main process writes the datasets' cache files; the others then read them.
    with accelerator.main_process_first():
        splits = load_datasets(args, args.image_column)
    train_dataset, held_out = splits["train"], splits.get("validation")
    crop = transforms.CenterCrop if args.center_crop else transforms.RandomCrop
    # Pixels in [0, 1] become (x - 0.5) / 0.5, in [-1, 1].
    to_tensor = transforms.Compose([transforms.ToTensor(), transforms.Normalize([0.5], [0.5])])
    augment = transforms.Compose(
        [transforms.Resize(args.resolution), crop(args.resolution), to_tensor]
    )
    transform = partial(preprocess, args=args, augment=augment)
    # The held-out pictures keep epoch 0's crops and flips.
    if held_out:
        held_out.set_transform(partial(transform, epoch=0))
    train_dataloader = torch.utils.data.DataLoader(
        train_dataset,
        batch_size=args.train_batch_size,
        shuffle=True,
        num_workers=args.dataloader_num_workers,
        # Its own generator: each epoch's shuffle would draw from the global RNG of ε and t.
        generator=torch.Generator().manual_seed(args.seed),
        worker_init_fn=ignore_signals,
    )

    # 5. Optimizer and LR schedule, over each process's share of the batches
    # fused: one call updates all the weights (on CUDA, a kernel per chunk of them).
    optimizer = torch.optim.AdamW(
        model.parameters(),
        lr=args.learning_rate,
        betas=(args.adam_beta1, args.adam_beta2),
        weight_decay=args.adam_weight_decay,
        eps=args.adam_epsilon,
        fused=True,
    )
    accumulation = args.gradient_accumulation_steps
    steps_per_epoch = math.ceil(len(train_dataloader) / accelerator.num_processes / accumulation)
    max_train_steps = args.max_train_steps or args.num_epochs * steps_per_epoch
    num_epochs = math.ceil(max_train_steps / steps_per_epoch)
    lr_scheduler = get_scheduler(
        args.lr_scheduler,
        optimizer,
        num_warmup_steps=args.lr_warmup_steps,
        num_training_steps=max_train_steps,
    )
    model, optimizer, train_dataloader, lr_scheduler = accelerator.prepare(
        model, optimizer, train_dataloader, lr_scheduler
    )
    # Each process draws its own ε and t (the Diffusers text-to-image examples draw the same on
    # every GPU).
    set_seed(args.seed, device_specific=True)

    # 6. Checkpoint hooks and resume. save_state stores the optimizer, LR schedule and every
    #    process's RNG states; the hooks add the model as a `from_pretrained` folder.
    def save_model_hook(models, weights, output_dir):
        if accelerator.is_main_process:
            unwrap(models[0]).save_pretrained(f"{output_dir}/unet")
        # Saved above: accelerate must not store them again.
        weights.clear()

    # models is empty under DeepSpeed, which loads its own files.
    def load_model_hook(models, input_dir):
        if models:
            loaded = UNet2DModel.from_pretrained(input_dir, subfolder="unet")
            unwrap(models.pop()).load_state_dict(loaded.state_dict())

    accelerator.register_save_state_pre_hook(save_model_hook)
    accelerator.register_load_state_pre_hook(load_model_hook)
    # The EMA too, so that a resume goes on with the same average (as its state: guide 2).
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
    accelerator.init_trackers("train_unconditional", config=hparams)

    # 7. The training loop: Algorithm 1 of DDPM; section 8 runs at the end of each step
    T = noise_scheduler.config.num_train_timesteps

    def diffusion_loss(model, clean_images, noise, timesteps):
        """Each image's loss for given ε and t, in the loop and on the held-out pictures."""
        # x_t = √ᾱ_t·x_0 + √(1-ᾱ_t)·ε: the forward process in closed form (DDPM, eq. 4).
        noisy_images = noise_scheduler.add_noise(clean_images, noise, timesteps)
        # The target: ε itself, v = √ᾱ_t·ε - √(1-ᾱ_t)·x_0 (Salimans & Ho 2022), or x_0.
        if args.prediction_type == "epsilon":
            target = noise
        elif args.prediction_type == "v_prediction":
            target = noise_scheduler.get_velocity(clean_images, noise, timesteps)
        else:
            target = clean_images
        # The prediction of the target, ε_θ(x_t, t) for ε; its input in the mixed-precision
        # dtype, which DeepSpeed keeps the weights in.
        model_output = model(noisy_images.to(weight_dtype), timesteps).sample
        # ‖target - prediction‖²: the simple loss (DDPM eq. 14), per image for Min-SNR-γ.
        loss = F.mse_loss(model_output.float(), target.float(), reduction="none")
        loss = loss.mean(dim=[1, 2, 3])
        if args.snr_gamma is not None:
            loss = loss * min_snr_weights(noise_scheduler, timesteps, args.snr_gamma)
        return loss

    # A held-out picture's loss at t = fraction·T, with the generator's ε (section 8).
    def picture_loss(batch, generator, fraction):
        # On the device: the held-out pictures come straight from their dataset.
        batch = {name: value.to(accelerator.device) for name, value in batch.items()}
        clean_images = batch["pixel_values"]
        noise = torch.randn(clean_images.shape, generator=generator).to(accelerator.device)
        timesteps = torch.tensor([int(fraction * T)], device=accelerator.device)
        return diffusion_loss(unwrap(model), clean_images, noise, timesteps)

    total_batch_size = args.train_batch_size * accelerator.num_processes * accumulation
    logger.info(f"{len(train_dataset)} images, {max_train_steps} steps of {total_batch_size}")
    progress_bar = tqdm(
        range(max_train_steps), initial=global_step, disable=not accelerator.is_local_main_process
    )
    # The held-out loss where the run starts (at step 0: the untrained baseline). A picture that
    # cannot be read stops the run here, before it trains.
    shown = {}
    if held_out:
        with ema_weights(ema_model, model.parameters()):
            shown = log_held_out_loss(accelerator, held_out, picture_loss, model, global_step)
    # From now on a signal saves a checkpoint first.
    signals = handle_signals(accelerator, args, at_once=False)
    # The loss is summed on the device, read every 10 steps: a read makes the CPU wait.
    train_loss = 0.0
    logged_step = global_step
    for epoch in range(first_epoch, num_epochs):
        model.train()
        # This epoch's crops and flips (preprocess), and permutation, also when resuming.
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
            with accelerator.accumulate(model):
                # x_0 ~ q(x_0): a batch of training images.
                clean_images = batch["pixel_values"]
                # ε ~ N(0, I): the noise to mix in.
                noise = torch.randn_like(clean_images)
                # t ~ U{0, ..., T-1}: a timestep per image.
                timesteps = torch.randint(0, T, (len(noise),), device=noise.device)
                # x_t, the target, the prediction, ‖target - prediction‖², over the batch.
                loss = diffusion_loss(model, clean_images, noise, timesteps).mean()
                # ∇_θ of the loss, averaged over processes; clipped once every micro-batch is in.
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)
                # A gradient step (accelerate skips it until the last micro-batch).
                optimizer.step()
                optimizer.zero_grad()
                train_loss += loss.detach() / accumulation
            # The rest runs once per optimizer step.
            if not accelerator.sync_gradients:
                continue
            lr_scheduler.step()
            if args.use_ema:
                ema_model.step(model.parameters())
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
            #    and at the last step; at an epoch's end, Algorithm 2 from the same noise
            # Without --validate_every_n_steps, at every checkpoint.
            every = args.validate_every_n_steps or args.checkpointing_steps
            held_out_due = held_out and (global_step % every == 0 or last_step)
            if held_out_due:
                with ema_weights(ema_model, model.parameters()):
                    shown = log_held_out_loss(
                        accelerator, held_out, picture_loss, model, global_step
                    )
            last_epoch = epoch == num_epochs - 1 or last_step
            images_due = epoch_end and (epoch % args.save_images_epochs == 0 or last_epoch)
            if images_due and accelerator.is_main_process:
                log_validation(
                    accelerator, args, unwrap(model), ema_model, noise_scheduler, global_step
                )
            if save:
                save_checkpoint(accelerator, args, global_step)
        if global_step >= max_train_steps:
            break
        if accelerator.is_main_process and epoch % args.save_model_epochs == 0:
            save_pipeline(args, unwrap(model), ema_model, noise_scheduler)

    # 9. Final save: a folder that DDPMPipeline.from_pretrained loads, EMA weights if any
    if accelerator.is_main_process:
        save_pipeline(args, unwrap(model), ema_model, noise_scheduler)
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


def preprocess(examples, args, augment, epoch):
    """Images to tensors, each crop and flip drawn from a seed of (seed, epoch, row): the global
    stream of ε and t would shift at a resume, as the dataloader reads a batch ahead. Module
    level, so that spawned workers can unpickle it."""
    batch = {"pixel_values": []}
    for i, row in enumerate(examples["row"]):
        with torch.random.fork_rng(devices=[]):
            # One seed per image and epoch; torch keeps 32 bits of a seed.
            seed = (args.seed * 1_000_003 + epoch) * 1_000_003 + row
            torch.default_generator.manual_seed(seed % 2**32)
            # Drawn only with --random_flip: without it, the crop's draws stay the same.
            flip = args.random_flip and bool(torch.rand(()) < 0.5)
            pixels = augment(open_image(examples[args.image_column][i]))
            batch["pixel_values"].append(pixels.flip(-1) if flip else pixels)
    return batch


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


def log_validation(accelerator, args, model, ema_model, noise_scheduler, global_step):
    """A grid of images from fixed noise by Algorithm 2, with the EMA weights if any."""
    # No dropout while sampling.
    model.eval()
    pipeline = DDPMPipeline(unet=model, scheduler=DDPMScheduler.from_config(noise_scheduler.config))
    pipeline.set_progress_bar_config(disable=True)
    with ema_weights(ema_model, model.parameters()):
        images = pipeline(
            batch_size=args.eval_batch_size,
            num_inference_steps=args.ddpm_num_inference_steps,
            generator=torch.Generator().manual_seed(0),
            output_type="pt",
        ).images.float()
    model.train()
    # One grid: output_dir/samples/step-N.png, and in TensorBoard or wandb.
    os.makedirs(f"{args.output_dir}/samples", exist_ok=True)
    grid = f"{args.output_dir}/samples/step-{global_step}.png"
    torchvision.utils.save_image(images, grid, nrow=math.ceil(len(images) ** 0.5))
    for tracker in accelerator.trackers:
        tracker.log_images({"samples": images}, step=global_step)


def save_pipeline(args, model, ema_model, noise_scheduler):
    """The DDPMPipeline folder in --output_dir, with the EMA weights if any."""
    with ema_weights(ema_model, model.parameters()):
        DDPMPipeline(unet=model, scheduler=noise_scheduler).save_pretrained(args.output_dir)


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
    """Before the models load, on every process: no earlier run (checkpoints, final_file) to replace
    in --output_dir, pictures in --train_data_dir, and its files that are not read named."""
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
    zero_stage = (
        accelerator.state.deepspeed_plugin and accelerator.state.deepspeed_plugin.zero_stage
    )
    if accelerator.distributed_type == DistributedType.FSDP or zero_stage == 3:
        raise SystemExit("error: launch with DDP or DeepSpeed ZeRO-1/2, not FSDP or ZeRO-3")
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
