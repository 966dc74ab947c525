"""Regenerate data/digits/: scikit-learn's handwritten digits as a `datasets` imagefolder.

    python data/make_digits.py

1,797 grey 8x8 images (UCI Optical Recognition of Handwritten Digits, CC BY 4.0), written as PNG
files with a metadata.jsonl that gives each one a caption (`text`) and a class (`label`), the same
format the training scripts take with --train_data_dir. The training scripts resize them to 32 px.
"""
import json
from pathlib import Path

import numpy as np
from PIL import Image
from sklearn.datasets import load_digits

NAMES = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]
OUT = Path(__file__).resolve().parent / "digits"


def main():
    digits = load_digits()
    OUT.mkdir(parents=True, exist_ok=True)
    with open(OUT / "metadata.jsonl", "w") as f:
        for i, (image, label) in enumerate(zip(digits.images, digits.target)):
            # sklearn's pixels are ink counts 0..16: white ink on black, scaled to 0..255
            pixels = np.round(image * 255 / 16).astype(np.uint8)
            name = f"{i:04d}.png"
            Image.fromarray(pixels, mode="L").save(OUT / name)
            row = {"file_name": name, "text": f"a handwritten digit {NAMES[label]}", "label": int(label)}
            f.write(json.dumps(row) + "\n")
    print(f"wrote {len(digits.images)} images to {OUT}")


if __name__ == "__main__":
    main()
