#!/usr/bin/env python
"""Batches per second of the cached-latents data path alone, with 0 and with 4 DataLoader workers.

`--cache_latents` stores each image's VAE moments (mean and log-variance: 2 x 4 x 64 x 64 float32
at 512 px, 128 KiB; twice that with --random_flip, one per side) as raw bytes in the dataset's
Arrow cache. Each step then reads a batch of them through train_lora.py's own `preprocess` (the
bytes to a tensor, the side drawn, the caption tokenized) and the DataLoader. This times that path
alone, no model, in the main process (0 workers) and in worker processes:

    python benchmarks/data_path.py                   # batch 4, 0 and 4 workers, 200 batches
    python benchmarks/data_path.py --batch 16 --random_flip --workers 0 2 4

The rows are written as the script's `encode_latents` writes them (random moments: the values do
not matter) and read back from disk through `datasets`, memory-mapped, as a training run reads
them. The tokenizer is the tests' tiny CLIP tokenizer (a word a token; CLIP's BPE costs more).
With --images, the uncached path for comparison: 512 px JPEG photos (benchmarks/gpu_table.py's)
decoded, resized, cropped and normalized by the same `preprocess`.
"""

import argparse
import os
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "benchmarks"))


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=256, help="Rows in the cached dataset.")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--batches", type=int, default=200, help="Batches timed per setting.")
    p.add_argument("--workers", type=int, nargs="+", default=[0, 4])
    p.add_argument("--random_flip", action="store_true", help="Two sides cached per row.")
    p.add_argument("--latent_size", type=int, default=64, help="64: 512 px images.")
    p.add_argument("--images", action="store_true", help="Time the uncached path instead.")
    args = p.parse_args()

    import datasets
    import torch
    from conftest import clip_tokenizer

    import train_lora

    work = Path(tempfile.mkdtemp(prefix="data-path-"))
    (work / "vocab").mkdir()
    tokenizer = clip_tokenizer(work / "vocab")
    sides, size = 2 if args.random_flip else 1, args.latent_size
    shape = (8, size, size)  # mean and log-variance of 4 channels
    moments = torch.randn(sides, *shape).numpy().tobytes()
    rows = {
        "latent_moments": [moments] * args.rows,
        "text": ["a photo of a handwritten digit seven"] * args.rows,
        "row": list(range(args.rows)),
        "bucket": [0] * args.rows,
    }
    datasets.Dataset.from_dict(rows).save_to_disk(work / "cached")
    dataset = datasets.load_from_disk(work / "cached")  # memory-mapped Arrow, as a run reads it
    script_args = argparse.Namespace(
        seed=0,
        random_flip=args.random_flip,
        cache_latents=not args.images,
        instance_prompt=None,
        caption_column="text",
        caption_dropout_rate=0.0,
        image_column="image",
        train_data_dir=None,
        dataset_name=None,
        dataset_config_name=None,
        cache_dir=None,
        center_crop=True,
        image_interpolation_mode="lanczos",
    )
    augment = None
    if args.images:
        from torchvision import transforms

        import gpu_table

        script_args.train_data_dir = str(gpu_table.photo_folder(work, 512, args.rows))
        dataset = train_lora.load_train_dataset(script_args, "image")
        dataset = dataset.add_column("bucket", [0] * len(dataset))
        # The script resizes and crops in cover_and_crop, then applies this.
        augment = transforms.Compose([transforms.ToTensor(), transforms.Normalize([0.5], [0.5])])
    transform = partial(
        train_lora.preprocess,
        args=script_args,
        augment=augment,
        tokenizer=tokenizer,
        bucket_sizes=[(512, 512)],
        latent_shapes=[shape],
    )
    dataset.set_transform(partial(transform, epoch=0))
    mib = len(moments) / 2**20
    what = "512 px JPEG photos" if args.images else f"rows of {mib:.3g} MiB of moments"
    print(
        f"torch {torch.__version__}, {os.cpu_count()} CPUs; {what}; "
        f"batch {args.batch}; {args.batches} batches a setting (after 5 untimed)"
    )
    print("\n| workers | batches/s | rows/s |\n|--:|--:|--:|")
    for workers in args.workers:
        loader = torch.utils.data.DataLoader(
            dataset,
            batch_size=args.batch,
            shuffle=True,
            num_workers=workers,
            generator=torch.Generator().manual_seed(0),
            persistent_workers=workers > 0,
        )
        done, batches = 0, iter(())
        start = None
        while done < args.batches + 5:
            try:
                next(batches)
            except StopIteration:
                batches = iter(loader)
                continue
            done += 1
            if done == 5:
                start = time.perf_counter()
        seconds = time.perf_counter() - start
        rate = args.batches / seconds
        print(f"| {workers} | {rate:.1f} | {rate * args.batch:.0f} |")


if __name__ == "__main__":
    main()
