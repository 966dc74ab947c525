"""The README's "Your own photos", rehearsed: its LoRA and full fine-tune commands as written, but for a tiny local
pipeline in place of SD 1.5, 64 px in place of 512 and a few steps, on a folder of photos of mixed shapes with a
caption file beside each; then the files the section promises, and its loading lines as pasted (on a CPU)."""

import re
import shlex
from pathlib import Path

import pytest
import torch
from conftest import REPO, run_script
from test_held_out import scalars

SD15 = "stable-diffusion-v1-5/stable-diffusion-v1-5"
LORA = "pytorch_lora_weights.safetensors"


def section():
    text = (REPO / "README.md").read_text()
    return text[text.index("## Your own photos"):text.index("\n## ", text.index("## Your own photos") + 1)]


def commands():
    """{script: its flags} for each ```bash block of the section, continuation lines joined."""
    found = {}
    for block in re.findall(r"```bash\n(.*?)```", section(), re.S):
        words = shlex.split(block.replace("\\\n", " "))
        assert words[:2] == [".venv/bin/accelerate", "launch"], words[:3]
        found[words[2]] = words[3:]
    return found


@pytest.fixture(scope="module")
def photos(tmp_path_factory):
    """Ten of scikit-image's photos, cut to portraits, landscapes and squares of about 100 px, a caption file
    beside each, as the section lays them out."""
    import skimage.data
    from PIL import Image

    folder = tmp_path_factory.mktemp("my-photos")
    names = ["astronaut", "coffee", "chelsea", "rocket", "hubble_deep_field", "immunohistochemistry",
             "camera", "retina", "cat", "colorwheel"]
    shapes = [(96, 96), (128, 80), (80, 128), (112, 64), (64, 112), (100, 100), (120, 90), (90, 120), (96, 72),
              (72, 96)]
    for i, (name, size) in enumerate(zip(names, shapes)):
        picture = getattr(skimage.data, name)()
        Image.fromarray(picture[..., :3] if picture.ndim == 3 else picture).convert("RGB").resize(size).save(
            folder / f"photo{i}.jpg")
        (folder / f"photo{i}.txt").write_text(f"a photo of sks {name.replace('_', ' ')}\n")
    return folder


def rehearse(flags, tiny_sd_path, photos, out):
    small = {SD15: str(tiny_sd_path), "my-photos": str(photos), "512": "64", "1500": "4", "250": "2",
             "500": "2", "20": "1", "my-lora": str(out), "my-sd": str(out)}
    return [small.get(flag, flag) for flag in flags]


def test_the_lora_command_makes_every_file_the_section_promises(tiny_sd_path, photos, tmp_path, monkeypatch):
    out = tmp_path / "my-lora"
    run_script("train_lora.py", rehearse(commands()["train_lora.py"], tiny_sd_path, photos, out))
    assert (out / "pytorch_lora_weights.safetensors").exists() and (out / "my-lora.safetensors").exists()
    card = (out / "README.md").read_text()
    assert f"Fine-tuned from {tiny_sd_path}" in card and "Held-out loss of these weights: " in card
    assert "--aspect_ratio_buckets auto" in card
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-4"]
    assert (out / "checkpoint-2" / "pytorch_lora_weights.safetensors").exists()
    # "for the one prompt, 4 tiles without the LoRA, then 4 with it": one row of 8 tiles of 64 px, 2 px apart.
    from PIL import Image

    grids = sorted((out / "samples").glob("step-*.png"))
    assert grids and Image.open(grids[-1]).size == (2 + 8 * 66, 2 + 66)
    # "step 13 for 15 photos: 2 held out, 13 train": datasets' split of 15 at a tenth.
    import datasets

    assert len(datasets.Dataset.from_dict({"row": range(15)}).train_test_split(0.1, seed=0)["test"]) == 2
    logged = scalars(out)  # one picture of ten held out, at t = T/2: quarter 2
    assert {"loss", "val_loss", "val_loss_t2"} <= set(logged)
    # The loading lines, on this machine's CPU and the tiny pipeline.
    lines = re.search(r"```python\n(.*?)```", section(), re.S).group(1)
    lines = lines.replace(SD15, str(tiny_sd_path)).replace('"my-lora"', repr(str(out))).replace("float16", "float32")
    monkeypatch.chdir(tmp_path)
    exec(lines.replace('"cuda"', '"cpu"'), {})
    assert (tmp_path / "dog.png").exists()
    # "The same command with --resume_from_checkpoint checkpoint-1000 --max_train_steps 1000 writes its files":
    # here checkpoint-2, whose LoRA (bf16 copies of the fp32 masters the files hold) replaces the last one's.
    from safetensors.torch import load_file

    text = " ".join(section().split())
    resume = re.search(r"the same command with `(--resume_from_checkpoint checkpoint-(\d+) --max_train_steps "
                       r"(\d+))`", text)
    assert resume[2] == resume[3]
    step = dict(zip(["1000"], ["2"]))[resume[2]]
    flags = commands()["train_lora.py"] + resume[1].replace(resume[2], step).split()
    last = load_file(out / "my-lora.safetensors")
    run_script("train_lora.py", rehearse(flags, tiny_sd_path, photos, out))
    saved, kept = load_file(out / "pytorch_lora_weights.safetensors"), load_file(out / "checkpoint-2" / LORA)
    assert saved.keys() == kept.keys() and all(torch.allclose(saved[k].float(), kept[k].float(), rtol=1e-2, atol=1e-3)
                                               for k in saved)
    assert any(not torch.equal(a, load_file(out / "my-lora.safetensors")[k]) for k, a in last.items())


def test_the_full_fine_tune_command_saves_a_pipeline(tiny_sd_path, photos, tmp_path):
    from diffusers import StableDiffusionPipeline

    out = tmp_path / "my-sd"
    run_script("train_text_to_image.py", rehearse(commands()["train_text_to_image.py"], tiny_sd_path, photos, out))
    StableDiffusionPipeline.from_pretrained(out)
    assert [p.name for p in out.glob("checkpoint-*")] == ["checkpoint-4"] and (out / "README.md").exists()


def test_the_section_names_files_the_scripts_write():
    text = " ".join(section().split())
    for name in ["pytorch_lora_weights.safetensors", "my-lora.safetensors", "README.md", "samples/step-N.png",
                 "checkpoint-N/", "val_loss_t0", "val_loss_t3", "--logdir my-lora/logs"]:
        assert name in text, name
    assert Path(REPO / "benchmarks" / "gpu_table_h100_2026-11-26.md").exists()
    table = (REPO / "benchmarks" / "gpu_table_h100_2026-11-26.md").read_text()
    # The H100 figures the section quotes are the table's rows.
    assert "| LoRA, batch 1, gradient checkpointing | 4.18 it/s, **2.5 GiB** |" in table
    assert "4.18 steps/s and peaked at 2.5 GiB" in text
    assert "| full fine-tune, batch 4 | 5.81 it/s, 16.5 GiB |" in table and "5.81 steps/s and 16.5 GiB" in text
