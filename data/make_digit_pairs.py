"""Build data/digit-pairs/: two bundled digits side by side, for the aspect-ratio bucket demo.

    python data/make_digit_pairs.py [--output_dir data/digit-pairs]

Each picture is 8 x 16 px (the scripts resize it to 16 x 32 at --resolution 16): a digit on the
left and another on the right, captioned with both names, left first: "a handwritten digit three
seven". A square crop of such a picture never holds both digits whole, so only a model trained at
the picture's own shape (--aspect_ratio_buckets 16,32) can learn which digit goes on which side.

The first 1,500 digits make the training pairs (2,000 of them, drawn with a fixed seed); the other
297 make 200 held-out pairs, for a denoising loss on pictures never trained on. The two folders,
`train/` and `held-out/`, are imagefolders as data/digits/ is.
"""

import argparse
import json
from pathlib import Path

import numpy as np
from PIL import Image

DATA = Path(__file__).resolve().parent
NAMES = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]


def caption(left, right):
    """The caption of a pair: every word is one token of data/make_tiny_sd.py's tokenizer."""
    return f"a handwritten digit {NAMES[left]} {NAMES[right]}"


def write_pairs(out, digits, labels, count, rng):
    """`count` pictures of two of `digits` side by side, drawn by `rng`, as an imagefolder."""
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "metadata.jsonl", "w") as f:
        for i, (a, b) in enumerate(rng.integers(len(digits), size=(count, 2))):
            name = f"{i:04d}.png"
            Image.fromarray(np.concatenate([digits[a], digits[b]], axis=1)).save(out / name)
            row = {"file_name": name, "text": caption(labels[a], labels[b])}
            f.write(json.dumps({**row, "left": int(labels[a]), "right": int(labels[b])}) + "\n")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--output_dir", type=Path, default=DATA / "digit-pairs")
    parser.add_argument("--count", type=int, default=2000, help="training pairs")
    args = parser.parse_args(argv)

    folder = DATA / "digits"
    rows = [json.loads(line) for line in (folder / "metadata.jsonl").read_text().splitlines()]
    digits = np.stack([np.asarray(Image.open(folder / row["file_name"])) for row in rows])
    labels = np.array([row["label"] for row in rows])
    rng = np.random.default_rng(0)
    write_pairs(args.output_dir / "train", digits[:1500], labels[:1500], args.count, rng)
    write_pairs(args.output_dir / "held-out", digits[1500:], labels[1500:], 200, rng)
    print(f"wrote {args.count} pairs to {args.output_dir}/train, 200 to {args.output_dir}/held-out")


if __name__ == "__main__":
    main()
