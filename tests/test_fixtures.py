"""Checks that the shared fixtures and helpers in conftest.py do what the other tests rely on."""
from pathlib import Path

import pytest
from conftest import CORRUPT_FILE, run_script

PROMPT = "a handwritten digit seven"


def test_tiny_sd_generates_offline(tiny_sd_path):
    import numpy as np
    import torch
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(tiny_sd_path)
    pipe.set_progress_bar_config(disable=True)
    assert pipe.vae_scale_factor == 8
    images = pipe(
        PROMPT, num_inference_steps=2, height=64, width=64, output_type="np", generator=torch.manual_seed(0)
    ).images
    assert images.shape == (1, 64, 64, 3)
    assert np.isfinite(images).all()


def test_tokenizer_round_trips(tiny_sd_path):
    from transformers import CLIPTokenizer

    tokenizer = CLIPTokenizer.from_pretrained(tiny_sd_path, subfolder="tokenizer")
    ids = tokenizer(PROMPT, padding="max_length", max_length=77).input_ids
    assert len(ids) == 77 and max(ids) < tokenizer.vocab_size
    words = tokenizer.convert_tokens_to_ids(["a</w>", "handwritten</w>", "digit</w>", "seven</w>"])
    assert ids[:6] == [tokenizer.bos_token_id, *words, tokenizer.eos_token_id]  # one token per word
    assert tokenizer.decode(ids, skip_special_tokens=True) == PROMPT


def test_unet_config_builds(tiny_unet_config_path):
    from diffusers import UNet2DModel

    unet = UNet2DModel.from_config(UNet2DModel.load_config(tiny_unet_config_path))
    assert unet.config.sample_size == 32 and unet.config.in_channels == 3


@pytest.mark.parametrize(
    "folder, rows, columns",
    [
        ("caption_folder", 20, {"image", "text", "label"}),
        ("label_folder", 6, {"image", "label"}),
        ("nocaption_folder", 6, {"image", "label"}),
        ("plain_image_folder", 6, {"image"}),
    ],
)
def test_imagefolder_loads(request, folder, rows, columns):
    from datasets import load_dataset

    dataset = load_dataset("imagefolder", data_dir=request.getfixturevalue(folder), split="train")
    assert set(dataset.column_names) == columns
    assert dataset.num_rows == rows
    assert dataset[0]["image"].size == (64, 64)


def test_broken_folders(corrupt_image_folder, empty_folder):
    from PIL import Image, UnidentifiedImageError

    with pytest.raises(UnidentifiedImageError):
        Image.open(Path(corrupt_image_folder) / CORRUPT_FILE)
    assert len((Path(corrupt_image_folder) / "metadata.jsonl").read_text().splitlines()) == 6
    assert list(Path(empty_folder).iterdir()) == []


@pytest.mark.parametrize("num_processes", [1, 2])
def test_run_script(tmp_path, num_processes):
    script = tmp_path / "count.py"
    # A bare PartialState() ignores ACCELERATE_USE_CPU; Accelerator(), as the training scripts use, does not.
    script.write_text(
        "import os, sys, accelerate\n"
        "n = accelerate.Accelerator().num_processes\n"
        # one write per rank: the two ranks share the pipe, and print() writes in pieces that can interleave
        "sys.stdout.write(f\"processes {n} offline {os.environ['HF_HUB_OFFLINE']}\\n\")\n"
    )
    log = run_script(script, [], num_processes=num_processes)
    assert log.count(f"processes {num_processes} offline 1") == num_processes


def test_run_script_expect_fail(tmp_path):
    script = tmp_path / "fail.py"
    script.write_text("import sys\nraise ValueError(f'deliberate failure {sys.argv[1:]}')\n")
    error = "ValueError: deliberate failure ['--flag', '3']"
    assert error in run_script(script, ["--flag", 3], expect_fail=True)
    with pytest.raises(pytest.fail.Exception, match="exit code 1, expected success") as failure:
        run_script(script, ["--flag", 3])
    assert error in str(failure.value)
