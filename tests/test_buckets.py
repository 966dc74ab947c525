"""Users' own pictures (train_text_to_image.py and train_lora.py share the code): every image decoded as its
owner sees it, aspect-ratio buckets (one size per batch, nothing stretched, exact resume on 1 and 2 processes,
cached and not), and the files users load."""

import numpy as np
import pytest
import torch
from conftest import (assert_same_weights, digit_images, import_script, resume_copy, run_script, train_in_process,
                      weights, zero)
from PIL import Image

T2I, LORA_SCRIPT = "train_text_to_image.py", "train_lora.py"
LORA = "pytorch_lora_weights.safetensors"


def digit(size, index=0):
    """A digit on white, drawn at `size` (width, height) in RGB: what the kinds of pictures below hold."""
    image, _ = digit_images(index + 1, size)[index]
    return Image.fromarray(255 - np.asarray(image))


@pytest.fixture(scope="module")
def mixed_folder(tmp_path_factory):
    """A folder of the kinds of pictures people keep, and what each should decode to (RGB arrays)."""
    path = tmp_path_factory.mktemp("mixed")
    expected = {}
    portrait = digit((40, 80), 0)
    portrait.save(path / "portrait.png")
    expected["portrait.png"] = np.asarray(portrait)
    panorama = digit((100, 40), 1)
    panorama.save(path / "panorama.jpg", quality=95)
    grey16 = np.full((48, 48), 32896, np.uint16)  # mid-grey in 16 bits: 128 in 8
    grey16[:, :24] = 65535
    Image.fromarray(grey16).save(path / "sixteen bits.png")
    expected["sixteen bits.png"] = np.repeat(np.where(grey16 == 65535, 255, 128).astype(np.uint8)[..., None], 3, 2)
    transparent = np.zeros((48, 48, 4), np.uint8)  # transparent black, and an opaque red square
    transparent[8:24, 8:24] = [255, 0, 0, 255]
    Image.fromarray(transparent, "RGBA").save(path / "transparent.png")
    expected["transparent.png"] = np.where(transparent[..., 3:] == 255, transparent[..., :3], 255).astype(np.uint8)
    palette = digit((48, 48), 2).convert("P", palette=Image.Palette.ADAPTIVE, colors=8)
    palette.save(path / "palette.png")
    expected["palette.png"] = np.asarray(palette.convert("RGB"))
    digit((56, 48), 3).convert("CMYK").save(path / "cmyk.jpg", quality=95)
    rotated = digit((64, 48), 4)  # stored 64 x 48, shown upright as 48 x 64
    exif = Image.Exif()
    exif[0x0112] = 6
    rotated.save(path / "rotated.jpg", exif=exif, quality=95)
    digit((60, 40), 5).save(path / "photo.webp", lossless=True)
    digit((20, 20), 6).save(path / "small.png")
    digit((48, 48), 7).save(path / "café à la plage.png")
    (path / "notes.md").write_text("not a picture")
    return path, expected


def open_image(path):
    return import_script("train_text_to_image").open_image({"path": str(path), "bytes": None})


def test_every_picture_decodes_as_its_owner_sees_it(mixed_folder):
    path, expected = mixed_folder
    for name, pixels in expected.items():
        image = open_image(path / name)
        assert image.mode == "RGB" and np.array_equal(np.asarray(image), pixels), name
    sixteen = np.asarray(open_image(path / "sixteen bits.png"))
    assert sixteen[:, 24:].mean() == 128  # scaled, where a plain convert("RGB") clips it to 255
    assert open_image(path / "rotated.jpg").size == (48, 64)  # upright by its EXIF orientation
    cmyk = np.asarray(open_image(path / "cmyk.jpg")).astype(int)
    assert np.abs(cmyk - np.asarray(digit((56, 48), 3))).mean() < 8  # its colours, not CMYK read as RGB
    assert open_image(path / "photo.webp").size == (60, 40)


def test_sixteen_bit_pictures_round_to_eight_bits(tmp_path):
    """A 16-bit grey PNG (mode I;16) and a big-endian 16-bit TIFF (I;16B): 16 to 8 bits rounded, not clipped."""
    values = np.array([[0, 128, 32896, 40000], [65535, 1000, 1000, 65407]] * 4, np.uint16)
    Image.fromarray(values).save(tmp_path / "grey.png")
    assert np.array_equal(np.asarray(open_image(tmp_path / "grey.png"))[..., 0], np.rint(values / 257))
    Image.fromarray(values.astype(">u2")).save(tmp_path / "big-endian.tif")
    assert np.array_equal(np.asarray(open_image(tmp_path / "big-endian.tif"))[..., 0], np.rint(values / 257))


def test_an_empty_or_undecodable_file_ends_in_one_line_naming_it(tmp_path, capsys):
    (tmp_path / "empty.png").write_bytes(b"")
    with pytest.raises(SystemExit) as stop:
        open_image(tmp_path / "empty.png")
    assert str(stop.value.code).startswith(f"error: image {tmp_path / 'empty.png'}: ") and "\n" not in str(stop.value)


def test_cover_and_crop_never_stretches_and_a_square_is_the_old_resize_and_crop(mixed_folder, monkeypatch):
    from torchvision import transforms

    script = import_script("train_text_to_image")
    args = script.parse_args(["--pretrained_model_name_or_path", "x", "--train_data_dir", "y"])
    resize, seen = transforms.functional.resize, []

    def record(image, size, *rest, **kwargs):
        out = resize(image, size, *rest, **kwargs)
        seen.append((image.size, out.size))
        return out

    monkeypatch.setattr(transforms.functional, "resize", record)
    path, _ = mixed_folder
    for name in ["portrait.png", "panorama.jpg", "small.png", "rotated.jpg"]:
        for size in [(64, 64), (32, 128), (128, 32), (80, 48)]:
            image = open_image(path / name)
            assert script.cover_and_crop(image, size, args).size == (size[1], size[0])
            (w, h), (w2, h2) = seen[-1]
            assert w2 >= size[1] and h2 >= size[0] and abs(w2 / w - h2 / h) <= 1 / min(w, h)  # covers, one scale
    args.center_crop = False  # a random crop, seeded alike: as transforms.Resize(64) then RandomCrop(64) drew it
    image = open_image(path / "panorama.jpg")
    torch.manual_seed(3)
    ours = script.cover_and_crop(image, (64, 64), args)
    torch.manual_seed(3)
    old = transforms.RandomCrop(64)(transforms.Resize(64, transforms.InterpolationMode.LANCZOS)(image))
    assert np.array_equal(np.asarray(ours), np.asarray(old))


def test_auto_buckets_are_about_the_resolution_squared_in_the_models_steps():
    script = import_script("train_text_to_image")
    args = script.parse_args(["--pretrained_model_name_or_path", "x", "--train_data_dir", "y",
                              "--aspect_ratio_buckets", "auto"])
    sizes = script.parse_buckets(args, step=64)
    assert (512, 512) in sizes and (256, 1024) in sizes and (1024, 256) in sizes
    for height, width in sizes:
        assert height % 64 == 0 and width % 64 == 0 and max(height, width) <= 4 * min(height, width)
        assert 0.75 * 512**2 <= height * width <= 512**2
    args.aspect_ratio_buckets = "512,512;384,640"
    assert script.parse_buckets(args, step=64) == [(512, 512), (384, 640)]
    args.aspect_ratio_buckets, args.resolution = "auto", 32
    with pytest.raises(SystemExit, match="^error: --aspect_ratio_buckets auto: sides in steps of 64 px, --resolution 64 or more$"):
        script.parse_buckets(args, step=64)
    for wrong in ["512,500", "512", "a,b"]:
        args.aspect_ratio_buckets = wrong
        with pytest.raises(SystemExit, match="--aspect_ratio_buckets"):
            script.parse_buckets(args, step=64)


@pytest.fixture(scope="module")
def bucket_args(tiny_sd_path, mixed_folder):
    """The mixed folder (10 pictures) at --resolution 32 in auto buckets (sides in steps of 16: the tiny VAE's 8
    times the tiny UNet's 2), one prompt for all, batches of 2: 5 to 6 batches an epoch."""
    path, _ = mixed_folder
    return ["--pretrained_model_name_or_path", tiny_sd_path, "--train_data_dir", path, "--resolution", "32",
            "--aspect_ratio_buckets", "auto", "--instance_prompt", "a handwritten digit", "--random_flip",
            "--train_batch_size", "2", "--learning_rate", "1e-3", "--lr_warmup_steps", "0", "--max_train_steps", "6",
            "--checkpointing_steps", "2", "--report_to", "none"]


@pytest.fixture(scope="module")
def bucket_run(tmp_path_factory, bucket_args):
    """A bucketed run in this process, recording the shape of every batch of pixels and the log."""
    import logging

    script, shapes, log = import_script("train_text_to_image"), [], []
    sample_latents = script.sample_latents

    def record(vae, batch, args):
        shapes.append(tuple(batch["pixel_values"].shape))
        return sample_latents(vae, batch, args)

    handler = logging.Handler()
    handler.emit = lambda record: log.append(record.getMessage())
    logger = logging.getLogger("train_text_to_image")
    out = tmp_path_factory.mktemp("buckets") / "out"
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(script, "sample_latents", record)
        logger.addHandler(handler)
        level = logger.level
        logger.setLevel("INFO")
        try:
            train_in_process(T2I, bucket_args + ["--output_dir", out])
        finally:
            logger.removeHandler(handler)
            logger.setLevel(level)
    return out, shapes, log


def test_every_batch_is_one_bucket(bucket_run, bucket_args):
    _, shapes, log = bucket_run
    assert len(shapes) == 6 and len({shape[2:] for shape in shapes}) > 1  # several buckets, one a batch
    sizes = {shape[2:] for shape in shapes}
    assert any(h > w for h, w in sizes) and any(h < w for h, w in sizes)  # the portrait's, the panorama's


@pytest.mark.parametrize("cached", [False, True])
def test_a_bucketed_run_resumes_exactly_on_one_process(cached, bucket_args, tmp_path):
    args = bucket_args + (["--cache_latents", "--center_crop"] if cached else [])
    out = tmp_path / "out"
    train_in_process(T2I, args + ["--output_dir", out])
    resumed = resume_copy(out, "checkpoint-4")
    train_in_process(T2I, args + ["--output_dir", resumed, "--resume_from_checkpoint", "latest"])
    assert_same_weights(weights(resumed / "unet"), weights(out / "unet"))


@pytest.mark.parametrize("cached", [False, True])
def test_a_bucketed_lora_resumes_exactly_on_two_processes_and_its_files_load(cached, bucket_args, tiny_sd_path,
                                                                                tmp_path):
    from diffusers import StableDiffusionPipeline

    args = bucket_args + ["--train_batch_size", "1"]  # the last value of a flag holds
    args += ["--cache_latents", "--center_crop"] if cached else []
    out = tmp_path / "out"
    run_script(LORA_SCRIPT, args + ["--output_dir", out], num_processes=2)
    resumed = resume_copy(out, "checkpoint-4")
    run_script(LORA_SCRIPT, args + ["--output_dir", resumed, "--resume_from_checkpoint", "latest"], num_processes=2)
    assert_same_weights(weights(resumed, LORA), weights(out, LORA))
    for source in [out, out / f"{out.name}.safetensors"]:  # the diffusers file and kohya's
        pipe = StableDiffusionPipeline.from_pretrained(tiny_sd_path, safety_checker=None)
        pipe.load_lora_weights(str(source))
        assert pipe.unet.peft_config["default_0"].r == 4


def test_buckets_under_deepspeed_zero2_train_and_resume_exactly(bucket_args, tmp_path):
    """`accelerate launch --use_deepspeed` without a config file asks for an "auto" micro-batch, which accelerate
    reads from the DataLoader; a bucketed one has no batch size, so the script gives it --train_batch_size."""
    args = bucket_args + ["--use_ema", "--cache_latents", "--center_crop", "--dataloader_num_workers", "2"]
    out = tmp_path / "out"
    run_script(T2I, args + ["--output_dir", out], num_processes=2, launch_args=zero(2))
    resumed = resume_copy(out, "checkpoint-4")
    run_script(T2I, args + ["--output_dir", resumed, "--resume_from_checkpoint", "latest"], num_processes=2,
               launch_args=zero(2))
    assert_same_weights(weights(resumed / "unet"), weights(out / "unet"))


def test_without_the_flag_one_square_bucket_trains_the_same_weights(bucket_args, tmp_path):
    """The bucket machinery with a single square bucket of --resolution is the unbucketed run, weight for weight."""
    args = [a for a in bucket_args if a not in ("--aspect_ratio_buckets", "auto")]
    train_in_process(T2I, args + ["--output_dir", tmp_path / "plain"])
    train_in_process(T2I, args + ["--output_dir", tmp_path / "square", "--aspect_ratio_buckets", "32,32"])
    assert_same_weights(weights(tmp_path / "square" / "unet"), weights(tmp_path / "plain" / "unet"))
