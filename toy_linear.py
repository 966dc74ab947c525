#!/usr/bin/env python
"""toy_linear.py: the training loop on the smallest model there is: y = w·x, true w = [2, 3, 4, 7].

`train_plain` is the loop in plain PyTorch; `main` is the same loop under 🤗 Accelerate, in the
nine numbered sections of every diffusion script here: the bare skeleton, nothing in the way.

    python toy_linear.py --plain                        # plain PyTorch
    python toy_linear.py                                # under Accelerate
    accelerate launch --num_processes 2 toy_linear.py --train_batch_size 16  # the same w
"""

import argparse
import logging
import math
import os
import re
import shutil
from contextlib import contextmanager

import torch
from accelerate import Accelerator
from accelerate.logging import get_logger
from accelerate.utils import DataLoaderConfiguration, ProjectConfiguration, set_seed
from diffusers.optimization import get_scheduler
from safetensors.torch import save_file
from torch.utils.data import DataLoader, RandomSampler, TensorDataset
from tqdm.auto import tqdm

TRUE_W = [2.0, 3.0, 4.0, 7.0]
logger = get_logger(__name__)


# 1. Arguments: the Diffusers examples' flag names, so the same commands work across scripts
def parse_args(argv=None):
    p = argparse.ArgumentParser(description="Learn y = w·x, with or without Accelerate.")
    p.add_argument("--plain", action="store_true", help="The plain PyTorch loop, no Accelerate.")
    p.add_argument("--output_dir", default="toy-linear", help="Checkpoints, logs and w go here.")
    p.add_argument("--seed", type=int, default=0, help="Seeds the data, the initial w, the order.")
    p.add_argument("--train_batch_size", type=int, default=32, help="Examples per process a step.")
    p.add_argument("--num_train_epochs", type=int, default=20, help="Passes over the 1,024 pairs.")
    p.add_argument("--max_train_steps", type=int, help="Optimizer steps; overrides the epochs.")
    p.add_argument("--gradient_accumulation_steps", type=int, default=1, help="Batches a step.")
    p.add_argument("--learning_rate", type=float, default=0.1, help="SGD's starting step size.")
    p.add_argument("--report_to", default="tensorboard", help="tensorboard, wandb or none.")
    p.add_argument("--checkpointing_steps", type=int, default=100, help="Save every N steps.")
    p.add_argument("--checkpoints_total_limit", type=int, help="Keep the newest N; default: all.")
    p.add_argument("--resume_from_checkpoint", help='checkpoint-N in --output_dir, or "latest".')
    return p.parse_args(argv)


def make_dataset(args, n=1024):
    """x ~ N(0, 1) in four dimensions, y = w·x plus some noise."""
    g = torch.Generator().manual_seed(args.seed)
    x = torch.randn(n, 4, generator=g)
    return TensorDataset(x, (x @ torch.tensor(TRUE_W) + 0.1 * torch.randn(n, generator=g))[:, None])


def train_plain(args):
    """The whole loop in plain PyTorch: forward, loss, zero_grad, backward, step."""
    torch.manual_seed(args.seed)
    # A linear layer without bias: its one weight matrix is w.
    model = torch.nn.Linear(4, 1, bias=False)
    dataset = make_dataset(args)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.learning_rate)
    steps = args.num_train_epochs * math.ceil(len(dataset) / args.train_batch_size)
    lr_scheduler = get_scheduler("cosine", optimizer, num_warmup_steps=0, num_training_steps=steps)
    for epoch in range(args.num_train_epochs):
        # A new permutation each epoch, seeded as Accelerate's seedable sampler seeds it.
        order = RandomSampler(dataset, generator=torch.Generator().manual_seed(args.seed + epoch))
        for x, y in DataLoader(dataset, batch_size=args.train_batch_size, sampler=order):
            loss = torch.nn.functional.mse_loss(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            lr_scheduler.step()
    print("learned w:", [round(v, 4) for v in model.weight.flatten().tolist()], " true w:", TRUE_W)
    os.makedirs(args.output_dir, exist_ok=True)
    save_file(model.state_dict(), f"{args.output_dir}/model.safetensors")


def main(args):
    # 2. Accelerator, logging, seed. Accelerate takes the devices, processes and precision from
    #    `accelerate launch` or `accelerate config`: one file for a CPU, a GPU or many.
    accelerator = Accelerator(
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        log_with=None if args.report_to == "none" else args.report_to,
        project_config=ProjectConfiguration(args.output_dir, logging_dir=f"{args.output_dir}/logs"),
        # Every process draws the same permutation each epoch and takes its own share of it.
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, data_seed=args.seed),
        # The loop steps the LR schedule once per optimizer step.
        step_scheduler_with_optimizer=False,
    )
    logging.basicConfig(level=logging.INFO)
    # The same initial weights on every process.
    set_seed(args.seed)

    # 3. Model: y = w·x is a linear layer with four inputs, one output and no bias
    model = torch.nn.Linear(4, 1, bias=False)

    # 4. Data
    dataset = make_dataset(args)
    train_dataloader = DataLoader(dataset, batch_size=args.train_batch_size, shuffle=True)

    # 5. Optimizer and LR schedule, over each process's share of the batches
    optimizer = torch.optim.SGD(model.parameters(), lr=args.learning_rate)
    accumulation = args.gradient_accumulation_steps
    steps_per_epoch = math.ceil(len(train_dataloader) / accelerator.num_processes / accumulation)
    max_train_steps = args.max_train_steps or args.num_train_epochs * steps_per_epoch
    num_epochs = math.ceil(max_train_steps / steps_per_epoch)
    # The learning rate falls along a half cosine, to 0 at the last step.
    lr_scheduler = get_scheduler(
        "cosine", optimizer, num_warmup_steps=0, num_training_steps=max_train_steps
    )
    model, optimizer, train_dataloader, lr_scheduler = accelerator.prepare(
        model, optimizer, train_dataloader, lr_scheduler
    )

    # 6. Resume: load_state restores the model, optimizer, LR schedule and every RNG
    global_step = resume_from_checkpoint(accelerator, args)
    first_epoch = global_step // steps_per_epoch
    skip_batches = (global_step % steps_per_epoch) * accumulation
    if accelerator.is_main_process:
        accelerator.init_trackers("toy_linear")

    # 7. The training loop
    progress_bar = tqdm(
        range(max_train_steps), initial=global_step, disable=not accelerator.is_local_main_process
    )
    # The loss is summed on the device, read every 10 steps: a read makes the CPU wait.
    train_loss = 0.0
    logged_step = global_step
    for epoch in range(first_epoch, num_epochs):
        # This epoch's permutation, also when resuming.
        train_dataloader.set_epoch(epoch)
        batches = train_dataloader
        # A resumed run skips the batches its checkpoint has trained on.
        if epoch == first_epoch and skip_batches:
            batches = accelerator.skip_first_batches(train_dataloader, skip_batches)
        for x, y in batches:
            # Gradients add up over micro-batches; the optimizer steps on the last one.
            with accelerator.accumulate(model):
                loss = torch.nn.functional.mse_loss(model(x), y)
                # Gradients, averaged over processes (and divided by the accumulation steps).
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
                # Each micro-batch's share of the step's mean loss.
                train_loss += loss.detach() / accumulation
            # An optimizer step happened.
            if accelerator.sync_gradients:
                lr_scheduler.step()
                global_step += 1
                progress_bar.update(1)
                if global_step % 10 == 0 or global_step >= max_train_steps:
                    # The mean loss of the steps since the last read, over every process.
                    steps = global_step - logged_step
                    mean_loss = accelerator.reduce(train_loss, "mean").item() / steps
                    logs = {"loss": mean_loss, "lr": lr_scheduler.get_last_lr()[0]}
                    progress_bar.set_postfix(**logs)
                    accelerator.log(logs, step=global_step)
                    train_loss = 0.0
                    logged_step = global_step
                if global_step % args.checkpointing_steps == 0:
                    save_checkpoint(accelerator, args, global_step)
            if global_step >= max_train_steps:
                break

    # 8. Validation: how far the learned w is from the true one
    w = accelerator.unwrap_model(model).weight.detach().float().flatten().cpu()
    accelerator.print("learned w:", [round(v, 4) for v in w.tolist()], " true w:", TRUE_W)

    # 9. Final save: every process takes part, the main one writes.
    accelerator.wait_for_everyone()
    accelerator.save_model(model, args.output_dir)
    accelerator.end_training()


@contextmanager
def as_one_line(flag):
    """A library's error, re-raised as one line that names the flag or file it came from."""
    try:
        yield
    except Exception as e:
        raise SystemExit(f"error: {flag}: {type(e).__name__}: {' '.join(str(e).split())}") from None


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


if __name__ == "__main__":
    args = parse_args()
    if args.plain:
        train_plain(args)
    else:
        main(args)
