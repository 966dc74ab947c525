"""Regenerate data/bold-digits/: the style that the LoRA demo teaches, BOLD handwritten digits.

    python data/make_bold_digits.py [--output_dir data/bold-digits]

300 of the bundled digits (the first 30 of each class) with strokes one pixel thicker on every
side, as 16 px PNGs in the same `datasets` imagefolder format as data/digits/. Each caption adds
the trigger word: "a bold handwritten digit seven".

The style number is `ink`: the mean grey level of an image in [0, 1] (black background 0, full
stroke 1). Bold digits carry about half as much ink again as normal ones (printed when run).
"""

import argparse
import json
from pathlib import Path

import numpy as np
from PIL import Image
from scipy import ndimage

DATA = Path(__file__).resolve().parent
TRIGGER = "bold"
PER_CLASS = 30
SIZE = 16  # the demos' --resolution


def read_images(folder, size=SIZE):
    """An imagefolder's images as grey arrays (N, size, size) in [0, 1], with its metadata rows.

    Resized with Lanczos, as train_text_to_image.py and train_lora.py resize.
    """
    rows = [json.loads(line) for line in (Path(folder) / "metadata.jsonl").read_text().splitlines()]
    images = []
    for row in rows:
        image = Image.open(Path(folder) / row["file_name"]).convert("L")
        images.append(np.asarray(image.resize((size, size), Image.Resampling.LANCZOS)))
    return np.stack(images).astype(np.float32) / 255, rows


def ink(images):
    """The style number of each image: its mean grey level, how much of the picture is stroke.

    Takes (N, H, W) or (N, H, W, channels) in [0, 1]; returns N numbers.
    """
    images = np.asarray(images, dtype=np.float32)
    return images.reshape(len(images), -1).mean(1)


def embolden(image):
    """Thicken the strokes: each pixel takes its brightest neighbour's value (a grey dilation).

    A cross, not a 3x3 square: with the square, the digits classifier misreads about a quarter of
    all digits (most zeros); with the cross, about 5%.
    """
    return ndimage.grey_dilation(image, footprint=ndimage.generate_binary_structure(2, 1))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--output_dir", type=Path, default=DATA / "bold-digits")
    out = parser.parse_args(argv).output_dir

    images, rows = read_images(DATA / "digits")
    labels = np.array([row["label"] for row in rows])
    keep = np.concatenate([np.flatnonzero(labels == digit)[:PER_CLASS] for digit in range(10)])
    keep.sort()  # keep the data's order, so the classes stay mixed
    bold = np.stack([embolden(images[i]) for i in keep])

    out.mkdir(parents=True, exist_ok=True)
    with open(out / "metadata.jsonl", "w") as f:
        for i, image in zip(keep, bold):
            row = rows[i]  # the source digit's file name, so each bold digit can be traced back
            Image.fromarray(np.round(image * 255).astype(np.uint8)).save(out / row["file_name"])
            text = row["text"].replace("a handwritten", f"a {TRIGGER} handwritten")
            f.write(json.dumps({**row, "text": text}) + "\n")
    print(f"wrote {len(keep)} images to {out}")
    print(f"ink: {ink(images[keep]).mean():.3f} normal, {ink(bold).mean():.3f} bold (same digits)")


if __name__ == "__main__":
    main()
