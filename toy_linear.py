#!/usr/bin/env python
"""toy_linear.py: the training loop, taught on the smallest model there is: y = w·x, true w = [2, 3, 4, 7].

`train_plain` is the loop in plain PyTorch; `main` is the same loop under 🤗 Accelerate, in the nine
numbered sections every diffusion script here uses: the bare skeleton, nothing else in the way.

    python toy_linear.py --plain                        # plain PyTorch
    python toy_linear.py                                # the same loop under Accelerate, same result
    accelerate launch --num_processes 2 toy_linear.py   # data-parallel, same result again
"""

import argparse
import math
import os
import shutil

import torch
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration, ProjectConfiguration, set_seed
from diffusers.optimization import get_scheduler
from safetensors.torch import save_file
from torch.utils.data import DataLoader, RandomSampler, TensorDataset
from tqdm.auto import tqdm

TRUE_W = [2.0, 3.0, 4.0, 7.0]


# 1. Arguments: the Diffusers examples' flag names, so the same commands work across scripts
def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description="Learn y = w·x, first in plain PyTorch, then with Accelerate."
    )
    p.add_argument(
        "--plain", action="store_true", help="Run the plain PyTorch loop instead of Accelerate."
    )
    p.add_argument(
        "--output_dir", default="toy-linear", help="Where checkpoints, logs and the model go."
    )
    p.add_argument(
        "--seed", type=int, default=0, help="Seeds the data, the initial w and the data order."
    )
    p.add_argument("--train_batch_size", type=int, default=32, help="Batch size per device.")
    p.add_argument("--num_train_epochs", type=int, default=20)
    p.add_argument(
        "--max_train_steps", type=int, default=None, help="Overrides --num_train_epochs if set."
    )
    p.add_argument("--gradient_accumulation_steps", type=int, default=1)
    p.add_argument("--learning_rate", type=float, default=0.1)
    p.add_argument("--lr_scheduler", default="cosine", help='"constant", "linear", "cosine", ...')
    p.add_argument("--lr_warmup_steps", type=int, default=0)
    p.add_argument("--mixed_precision", default=None, choices=["no", "fp16", "bf16"])
    p.add_argument(
        "--report_to", default="tensorboard", help='"tensorboard", "wandb", "all" or "none".'
    )
    p.add_argument("--logging_dir", default="logs", help="TensorBoard folder, under output_dir.")
    p.add_argument(
        "--checkpointing_steps", type=int, default=100, help="Save the full state every N steps."
    )
    p.add_argument(
        "--checkpoints_total_limit", type=int, default=None, help="Keep at most this many."
    )
    p.add_argument(
        "--resume_from_checkpoint", default=None, help='A checkpoint-N folder name, or "latest".'
    )
    return p.parse_args(argv)


def make_dataset(args, n=1024):
    """x ~ N(0, 1) in four dimensions; y = x·w plus a little noise, so the fit is not trivial."""
    g = torch.Generator().manual_seed(args.seed)
    x = torch.randn(n, 4, generator=g)
    return TensorDataset(
        x, (x @ torch.tensor(TRUE_W) + 0.1 * torch.randn(n, generator=g)).unsqueeze(1)
    )


def make_scheduler(args, optimizer):
    """A learning rate that warms up, then decays to 0 over the run (counted in optimizer steps)."""
    return get_scheduler(
        args.lr_scheduler,
        optimizer,
        num_warmup_steps=args.lr_warmup_steps,
        num_training_steps=args.max_train_steps,
    )


def train_plain(args):
    """The whole loop in plain PyTorch: forward, loss, zero_grad, backward, step; --num_train_epochs epochs."""
    torch.manual_seed(args.seed)
    model = torch.nn.Linear(4, 1, bias=False)  # its one weight matrix is w
    dataset = make_dataset(args)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.learning_rate)
    args.max_train_steps = args.num_train_epochs * math.ceil(len(dataset) / args.train_batch_size)
    lr_scheduler = make_scheduler(args, optimizer)
    for epoch in range(args.num_train_epochs):
        # A new seeded shuffle each epoch: the same order Accelerate's seedable sampler draws
        order = RandomSampler(dataset, generator=torch.Generator().manual_seed(args.seed + epoch))
        for x, y in DataLoader(dataset, batch_size=args.train_batch_size, sampler=order):
            loss = torch.nn.functional.mse_loss(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            lr_scheduler.step()
    print("learned w:", [round(v, 4) for v in model.weight.flatten().tolist()], " true w:", TRUE_W)
    os.makedirs(args.output_dir, exist_ok=True)
    save_file(model.state_dict(), os.path.join(args.output_dir, "model.safetensors"))


def main(args):
    # 2. Accelerator, logging, seed. Accelerate picks the device(s), precision and process count
    #    from `accelerate launch` / `accelerate config`, so this file runs unchanged everywhere.
    accelerator = Accelerator(
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        mixed_precision=args.mixed_precision,
        log_with=None if args.report_to == "none" else args.report_to,
        project_config=ProjectConfiguration(
            args.output_dir, os.path.join(args.output_dir, args.logging_dir)
        ),
        # every process draws the same seeded permutation each epoch and takes its own share of it
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, data_seed=args.seed),
        step_scheduler_with_optimizer=False,  # the loop steps the LR schedule once per optimizer step
    )
    if accelerator.mixed_precision == "fp16" and accelerator.device.type == "cpu":
        raise SystemExit("error: --mixed_precision fp16 needs a GPU; on a CPU use bf16 or no.")
    set_seed(args.seed)

    # 3. Model: y = w·x is a linear layer with four inputs, one output and no bias.
    model = torch.nn.Linear(4, 1, bias=False)

    # 4. Data
    dataset = make_dataset(args)
    train_dataloader = DataLoader(dataset, batch_size=args.train_batch_size, shuffle=True)

    # 5. Optimizer and LR schedule, prepared in one call (DeepSpeed wraps the scheduler only so), the step count
    #    computed beforehand from each process's share of the batches.
    optimizer = torch.optim.SGD(model.parameters(), lr=args.learning_rate)
    num_update_steps_per_epoch = math.ceil(
        math.ceil(len(train_dataloader) / accelerator.num_processes)
        / args.gradient_accumulation_steps
    )
    if args.max_train_steps is None:
        args.max_train_steps = args.num_train_epochs * num_update_steps_per_epoch
    args.num_train_epochs = math.ceil(args.max_train_steps / num_update_steps_per_epoch)
    lr_scheduler = make_scheduler(args, optimizer)
    model, optimizer, train_dataloader, lr_scheduler = accelerator.prepare(
        model, optimizer, train_dataloader, lr_scheduler
    )
    if accelerator.is_main_process:
        os.makedirs(args.output_dir, exist_ok=True)
        accelerator.init_trackers(
            "toy_linear", config={k: v for k, v in vars(args).items() if v is not None}
        )

    # 6. Resume: load_state restores model, optimizer, scheduler and every RNG; the step is in the name.
    global_step, first_epoch, resume_step = 0, 0, 0
    if args.resume_from_checkpoint:
        path = find_checkpoint(args.output_dir, args.resume_from_checkpoint)
        if path is None:  # `latest`, and none yet (a named checkpoint that is missing is an error)
            accelerator.print(f"No checkpoint in {args.output_dir} yet; starting a new run.")
        else:
            accelerator.print(f"Resuming from {path}")
            accelerator.load_state(path)
            global_step = int(os.path.basename(path).split("-")[1])
            first_epoch = global_step // num_update_steps_per_epoch
            # the batches of the partial epoch already trained on, skipped below
            resume_step = (
                global_step % num_update_steps_per_epoch
            ) * args.gradient_accumulation_steps

    # 7. The training loop
    progress_bar = tqdm(
        range(args.max_train_steps),
        initial=global_step,
        desc="Steps",
        disable=not accelerator.is_local_main_process,
    )
    for epoch in range(first_epoch, args.num_train_epochs):
        train_dataloader.set_epoch(epoch)
        batches = train_dataloader
        if epoch == first_epoch and resume_step:
            batches = accelerator.skip_first_batches(train_dataloader, resume_step)
        for x, y in batches:
            # inside `accumulate`, gradients add up over N batches and the optimizer only steps on the Nth
            with accelerator.accumulate(model):
                loss = torch.nn.functional.mse_loss(model(x).float(), y)
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
            if accelerator.sync_gradients:  # an optimizer step happened
                lr_scheduler.step()
                global_step += 1
                progress_bar.update(1)
                loss = (
                    accelerator.gather(loss.detach()).mean().item()
                )  # the mean over all processes
                progress_bar.set_postfix(loss=loss, lr=lr_scheduler.get_last_lr()[0])
                accelerator.log(
                    {"train_loss": loss, "lr": lr_scheduler.get_last_lr()[0]}, step=global_step
                )
                if global_step % args.checkpointing_steps == 0:
                    save_checkpoint(accelerator, args, global_step)
            if global_step >= args.max_train_steps:
                break

    # 8. Validation: how far the learned w is from the true one
    w = accelerator.unwrap_model(model).weight.detach().float().flatten().cpu()
    error = (w - torch.tensor(TRUE_W)).abs().max().item()
    accelerator.print(
        "learned w:",
        [round(v, 4) for v in w.tolist()],
        " true w:",
        TRUE_W,
        f" max error {error:.4f}",
    )
    accelerator.log({"max_abs_error": error}, step=global_step)

    # 9. Final save, by the main process only
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        accelerator.save_model(model, args.output_dir)
    accelerator.end_training()


def find_checkpoint(output_dir, name):
    """`latest` is the highest checkpoint-N; any other name is a folder under output_dir."""
    if name == "latest":
        found = (
            [d for d in os.listdir(output_dir) if is_checkpoint_name(d)]
            if os.path.isdir(output_dir)
            else []
        )
        return os.path.join(output_dir, max(found, key=lambda d: int(d[11:]))) if found else None
    path = os.path.join(output_dir, os.path.basename(os.path.normpath(name)))
    if not os.path.isdir(
        path
    ):  # starting afresh would let rotation delete the new run's checkpoints
        raise SystemExit(
            f"error: --resume_from_checkpoint {path} does not exist (`latest` starts afresh when there is none)"
        )
    return path


def is_checkpoint_name(name):
    return name.startswith("checkpoint-") and name[len("checkpoint-") :].isdigit()


def save_checkpoint(accelerator, args, global_step):
    """Delete the oldest so at most --checkpoints_total_limit remain after this one, then save (atomic in the others)."""
    if accelerator.is_main_process and args.checkpoints_total_limit is not None:
        old = sorted(
            (d for d in os.listdir(args.output_dir) if is_checkpoint_name(d)),
            key=lambda d: int(d[11:]),
        )
        for d in old[: max(0, len(old) - args.checkpoints_total_limit + 1)]:
            shutil.rmtree(os.path.join(args.output_dir, d))
    accelerator.wait_for_everyone()
    accelerator.save_state(
        os.path.join(args.output_dir, f"checkpoint-{global_step}")
    )  # each process: its RNG


if __name__ == "__main__":
    args = parse_args()
    train_plain(args) if args.plain else main(args)
