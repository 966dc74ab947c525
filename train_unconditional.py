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
from diffusers import DDPMPipeline, DDPMScheduler, UNet2DModel
from diffusers.optimization import SchedulerType, get_scheduler
from diffusers.training_utils import EMAModel, compute_snr
from PIL import Image
from torchvision import transforms
from tqdm.auto import tqdm

logger = get_logger(__name__)


# 1. Arguments: the Diffusers example's flags and defaults, so existing commands work unchanged
def parse_args(argv=None):
    p = argparse.ArgumentParser(description="Train a DDPM (UNet2DModel) from scratch.")
    p.add_argument("--dataset_name", default=None, help="A hub dataset id, or a local dataset folder.")
    p.add_argument("--dataset_config_name", default=None)
    p.add_argument("--train_data_dir", default=None, help="A `datasets` imagefolder (used if no --dataset_name).")
    p.add_argument("--image_column", default="image", help="The dataset column that holds the images.")
    p.add_argument("--model_config_name_or_path", default=None, help="A folder with a UNet2DModel config.json.")
    p.add_argument("--output_dir", default="ddpm-model-64")
    p.add_argument("--cache_dir", default=None, help="Where `datasets` caches downloads.")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--resolution", type=int, default=64)
    p.add_argument("--center_crop", action="store_true", help="Center crop instead of a random crop.")
    p.add_argument("--random_flip", action="store_true", help="Flip images horizontally at random.")
    p.add_argument("--train_batch_size", type=int, default=16, help="Batch size per device.")
    p.add_argument("--eval_batch_size", type=int, default=16, help="How many images to sample for validation.")
    p.add_argument("--dataloader_num_workers", type=int, default=0)
    p.add_argument("--num_epochs", "--num_train_epochs", dest="num_train_epochs", type=int, default=100)
    p.add_argument("--max_train_steps", type=int, default=None, help="Overrides --num_epochs if set.")
    p.add_argument("--save_images_epochs", type=int, default=10, help="Sample validation images every N epochs.")
    p.add_argument("--save_model_epochs", type=int, default=10, help="Save the pipeline every N epochs.")
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
                   choices=["tensorboard", "wandb", "all", "none"])
    p.add_argument("--logging_dir", default="logs", help="TensorBoard folder, under output_dir.")
    p.add_argument("--mixed_precision", default=None, choices=["no", "fp16", "bf16"],
                   help="Defaults to the `accelerate config` setting.")
    p.add_argument("--allow_tf32", action="store_true", help="Faster fp32 matmuls on Ampere and newer GPUs.")
    p.add_argument("--prediction_type", default="epsilon", choices=["epsilon", "sample"])
    p.add_argument("--snr_gamma", type=float, default=None, help="Min-SNR-γ loss weighting; 5.0 is common.")
    p.add_argument("--ddpm_num_steps", type=int, default=1000)
    p.add_argument("--ddpm_num_inference_steps", type=int, default=1000)
    p.add_argument("--ddpm_beta_schedule", default="linear",
                   choices=["linear", "scaled_linear", "squaredcos_cap_v2", "sigmoid", "laplace"])
    p.add_argument("--checkpointing_steps", type=int, default=500, help="Save the full state every N steps.")
    p.add_argument("--checkpoints_total_limit", type=int, default=None, help="Keep at most this many.")
    p.add_argument("--resume_from_checkpoint", default=None, help='A checkpoint-N folder name, or "latest".')
    args = p.parse_args(argv)
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
    check_images(train_dataset, args.image_column)
    train_dataset = train_dataset.add_column("row", list(range(len(train_dataset))))
    train_transforms = transforms.Compose([
        transforms.Resize(args.resolution, interpolation=transforms.InterpolationMode.BILINEAR),
        transforms.CenterCrop(args.resolution) if args.center_crop else transforms.RandomCrop(args.resolution),
        transforms.RandomHorizontalFlip() if args.random_flip else transforms.Lambda(lambda x: x),
        transforms.ToTensor(),
        transforms.Normalize([0.5], [0.5]),
    ])

    def preprocess_train(examples, epoch):
        # Each image's crop, flip, noise ε and timestep t come from a seed of (seed, epoch, row), not from
        # the global random stream: the same draws however the run is batched, split across processes
        # or resumed (the dataloader reads a batch ahead, which would shift a shared stream).
        columns = {"pixel_values": [], "noise": [], "timesteps": []}
        for image, row in zip(examples[args.image_column], examples["row"]):
            with torch.random.fork_rng(devices=[]):
                torch.default_generator.manual_seed(hash((args.seed, epoch, row)) % 2**63)  # the CPU stream
                pixel_values = train_transforms(image.convert("RGB"))
                columns["pixel_values"].append(pixel_values)
                columns["noise"].append(torch.randn(pixel_values.shape))
                columns["timesteps"].append(torch.randint(0, noise_scheduler.config.num_train_timesteps, ()))
        return columns

    train_dataset.set_transform(partial(preprocess_train, epoch=0))
    train_dataloader = torch.utils.data.DataLoader(
        train_dataset, batch_size=args.train_batch_size, shuffle=True, num_workers=args.dataloader_num_workers
    )

    # 5. Optimizer and LR schedule. Steps are counted on the *prepared* (per-process) dataloader; the
    #    prepared scheduler steps once per process, hence the `* num_processes`.
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
    if args.use_ema:
        ema_model.to(accelerator.device)

    # 6. Checkpoint hooks and resume. The hooks write the UNet (and its EMA) as `save_pretrained`
    #    folders, and pop them so accelerate does not store the weights twice.
    def save_model_hook(models, weights, output_dir):
        if accelerator.is_main_process:
            if args.use_ema:
                ema_model.save_pretrained(os.path.join(output_dir, "unet_ema"))
            accelerator.unwrap_model(models[0]).save_pretrained(os.path.join(output_dir, "unet"))
        weights.pop()

    def load_model_hook(models, input_dir):
        if args.use_ema:
            loaded = EMAModel.from_pretrained(os.path.join(input_dir, "unet_ema"), UNet2DModel)
            ema_model.load_state_dict(loaded.state_dict())
            ema_model.to(accelerator.device)
        loaded = UNet2DModel.from_pretrained(input_dir, subfolder="unet")
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
        accelerator.init_trackers("train_unconditional", config={k: v for k, v in vars(args).items() if v is not None})

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
            clean_images, noise, timesteps = batch["pixel_values"], batch["noise"], batch["timesteps"]
            # The forward process in closed form: x_t = √ᾱ_t·x_0 + √(1−ᾱ_t)·ε
            noisy_images = noise_scheduler.add_noise(clean_images, noise, timesteps)

            with accelerator.accumulate(model):
                model_output = model(noisy_images, timesteps).sample
                target = noise if args.prediction_type == "epsilon" else clean_images
                # Algorithm 1's loss ‖ε − ε_θ(x_t, t)‖², one value per image so it can be weighted
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
                    ema_model.step(model.parameters())
                global_step += 1
                images_per_s = total_batch_size / (time.perf_counter() - step_start)
                logs = {"train_loss": train_loss, "lr": lr_scheduler.get_last_lr()[0], "img/s": images_per_s}
                if args.use_ema:
                    logs["ema_decay"] = ema_model.cur_decay_value
                progress_bar.update(1)
                progress_bar.set_postfix(loss=train_loss, img_s=f"{images_per_s:.1f}")
                accelerator.log(logs, step=global_step)
                if global_step % args.checkpointing_steps == 0:
                    save_checkpoint(accelerator, args, global_step)
                train_loss, step_start = 0.0, time.perf_counter()
            if global_step >= args.max_train_steps:
                break

        # 8. Validation: sample images with a fixed seed (EMA weights if used), log and save them
        last_epoch = epoch == args.num_train_epochs - 1 or global_step >= args.max_train_steps
        if accelerator.is_main_process and (epoch % args.save_images_epochs == 0 or last_epoch):
            log_validation(accelerator, args, model, ema_model if args.use_ema else None, noise_scheduler, global_step)
        if accelerator.is_main_process and (epoch % args.save_model_epochs == 0 or last_epoch):
            save_pipeline(accelerator, args, model, ema_model if args.use_ema else None, noise_scheduler)
        step_start = time.perf_counter()
        if global_step >= args.max_train_steps:
            break

    # 9. Final save: a DDPMPipeline folder, with the EMA weights if --use_ema
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        save_pipeline(accelerator, args, model, ema_model if args.use_ema else None, noise_scheduler)
        logger.info(f"Saved the pipeline to {args.output_dir}")
    accelerator.end_training()


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
            dataset = load_dataset(args.dataset_name, args.dataset_config_name, cache_dir=args.cache_dir, split="train")
        else:
            dataset = load_dataset("imagefolder", data_dir=args.train_data_dir, cache_dir=args.cache_dir, split="train")
    except Exception as e:  # datasets raises many kinds: say which input failed, and why
        raise SystemExit(f"error: could not load {flag} {source}: {type(e).__name__}: {e}") from None
    if len(dataset) == 0:
        raise SystemExit(f"error: {flag} {source} has no images")
    return dataset


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


def log_validation(accelerator, args, model, ema_model, noise_scheduler, global_step):
    unet = accelerator.unwrap_model(model)
    if ema_model is not None:  # sample with the EMA weights, then put the training weights back
        ema_model.store(unet.parameters())
        ema_model.copy_to(unet.parameters())
    pipeline = DDPMPipeline(unet=unet, scheduler=DDPMScheduler.from_config(noise_scheduler.config))
    pipeline.set_progress_bar_config(disable=True)
    generator = torch.Generator("cpu").manual_seed(0)  # the same starting noise every time: progress is visible
    images = pipeline(generator=generator, batch_size=args.eval_batch_size,
                      num_inference_steps=args.ddpm_num_inference_steps, output_type="np").images
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
            tracker.log({"validation": [wandb.Image(image) for image in images]}, step=global_step)


def save_pipeline(accelerator, args, model, ema_model, noise_scheduler):
    unet = accelerator.unwrap_model(model)
    if ema_model is not None:
        ema_model.store(unet.parameters())
        ema_model.copy_to(unet.parameters())
    DDPMPipeline(unet=unet, scheduler=noise_scheduler).save_pretrained(args.output_dir)
    if ema_model is not None:
        ema_model.restore(unet.parameters())


if __name__ == "__main__":
    main(parse_args())
