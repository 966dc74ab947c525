"""data/make_tiny_sd.py (the demos' tiny SD 1.x pipeline) and data/make_bold_digits.py (the LoRA
demo's style data). The checks of the tool build it with a 5-step VAE; the VAE's figures are
checked on the SD demos' build (conftest's demo_sd: 300 VAE steps in CI, full size with FULL_RUNS=1)."""

import importlib
import json
import os
import sys

import numpy as np
import pytest
import torch
from conftest import DIGIT_NAMES, REPO

FULL = os.environ.get("FULL_RUNS") == "1"
DATA = REPO / "data"
SHORT = ["--vae_steps", "5"]


def tool(name):
    """A script of data/ as a module (they import each other from their folder, as scripts)."""
    if str(DATA) not in sys.path:
        sys.path.append(str(DATA))
    return importlib.import_module(name)


@pytest.fixture(scope="module")
def tiny_sd(tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny-sd")
    tool("make_tiny_sd").main(["--output_dir", str(out), *SHORT])
    return out


@pytest.fixture(scope="module")
def pipe(tiny_sd):
    from diffusers import StableDiffusionPipeline

    pipe = StableDiffusionPipeline.from_pretrained(tiny_sd, local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def captions(folder):
    return [
        json.loads(row)["text"]
        for row in (DATA / folder / "metadata.jsonl").read_text().splitlines()
    ]


def test_pipeline_loads_and_draws_16px_images(pipe):
    prompts = ["a handwritten digit seven", "a bold handwritten digit two"]
    images = pipe(prompts, num_inference_steps=2, generator=torch.manual_seed(0), output_type="np")
    assert images.images.shape == (2, 16, 16, 3) and np.isfinite(images.images).all()


def test_every_caption_word_is_one_token(pipe):
    tokenizer = pipe.tokenizer
    texts = sorted(set(captions("digits") + captions("bold-digits")))
    words = {word for text in texts for word in text.split()}
    assert {tool("make_bold_digits").TRIGGER, *DIGIT_NAMES} <= words
    for word in words:
        assert tokenizer.tokenize(word) == [word + "</w>"]
    assert max(len(ids) for ids in tokenizer(texts).input_ids) <= tokenizer.model_max_length
    assert len(tokenizer.tokenize("seventeen")) > 1  # other words fall back to pieces


def test_scaling_factor_gives_latents_unit_variance(pipe):
    grey, _ = tool("make_bold_digits").read_images(DATA / "digits")
    pixels = torch.as_tensor(grey)[:, None].expand(-1, 3, -1, -1) * 2 - 1  # RGB in [-1, 1]
    with torch.no_grad():
        latents = pipe.vae.encode(pixels).latent_dist.sample(torch.manual_seed(1))
    assert latents.shape[1:] == (4, 8, 8)
    assert pipe.vae.config.scaling_factor == pytest.approx(1 / latents.std().item(), rel=0.01)


def test_text_encoder_tells_captions_apart(pipe):
    texts = [
        "a handwritten digit three",
        "a handwritten digit eight",
        "a bold handwritten digit three",
    ]
    ids = pipe.tokenizer([*texts, texts[0]], padding="max_length", return_tensors="pt").input_ids
    with torch.no_grad():
        three, eight, bold_three, three_again = pipe.text_encoder(ids).last_hidden_state
    torch.testing.assert_close(three, three_again)
    for other in (eight, bold_three):
        assert (three - other).norm() > 0.1 * three.norm()


def test_bold_digits_are_the_tools_output_and_inkier(tmp_path):
    bold_tool = tool("make_bold_digits")
    bold_tool.main(["--output_dir", str(tmp_path)])
    committed = DATA / "bold-digits"
    assert (tmp_path / "metadata.jsonl").read_text() == (committed / "metadata.jsonl").read_text()
    bold, rows = bold_tool.read_images(committed)
    np.testing.assert_array_equal(bold, bold_tool.read_images(tmp_path)[0])

    for row in rows:
        assert row["text"] == f"a {bold_tool.TRIGGER} handwritten digit {DIGIT_NAMES[row['label']]}"
    assert set(np.bincount([row["label"] for row in rows])) == {bold_tool.PER_CLASS}
    digits, digit_rows = bold_tool.read_images(DATA / "digits")
    by_name = dict(zip([row["file_name"] for row in digit_rows], digits))
    normal = np.stack([by_name[row["file_name"]] for row in rows])  # the same digits, not bold
    assert (bold_tool.ink(bold) > bold_tool.ink(normal)).all()
    assert bold_tool.ink(bold).mean() > 1.3 * bold_tool.ink(normal).mean()


def test_build_is_seeded(tiny_sd, tmp_path):
    from safetensors.torch import load_file

    tool("make_tiny_sd").main(["--output_dir", str(tmp_path), *SHORT])
    for model in ["vae", "unet", "text_encoder"]:
        first, second = (
            load_file(next((out / model).glob("*.safetensors"))) for out in (tiny_sd, tmp_path)
        )
        assert first.keys() == second.keys()
        assert all(torch.equal(first[k], second[k]) for k in first)


@pytest.mark.slow
def test_the_demos_vae_draws_digits_bold_digits_and_pairs(demo_sd):
    """The SD demos' VAE (conftest: full size with FULL_RUNS=1, 300 steps in CI): the classifier
    reads its reconstructions, also of two digits side by side (a shape it never trained on), and
    they keep the bold digits' extra ink (most of it, full size)."""
    digits, bold, pairs = demo_sd[1]["digits"], demo_sd[1]["bold digits"], demo_sd[1]["pairs"]
    print(f"read again: {digits['read_again']:.1%} digits, {bold['read_again']:.1%} bold, "
          f"{pairs['read_again']:.1%} halves of pairs; ink again: {digits['ink_again']:.3f} digits, "
          f"{bold['ink_again']:.3f} bold")
    assert digits["read_again"] >= 0.9 and bold["read_again"] >= 0.9 and pairs["read_again"] >= 0.9
    kept = (bold["ink_again"] - digits["ink_again"]) / (bold["ink"] - digits["ink"])
    assert kept > (0.5 if FULL else 0.2)
