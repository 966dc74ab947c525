"""train_text_to_image.py: exact resume, the checkpoint contract, the pipeline users load (only the UNet
changed), captions (metadata, kohya files, instance prompt, lists, dropout), cached latents, bad input."""

import shutil

import pytest
import torch
from conftest import (require_deepspeed, assert_same_ema, assert_same_optimizer_state, assert_same_weights, checkpoints,
                      ema_weights, import_script, resume_copy,
                      run_script, train_in_process, weights, zero)

SCRIPT = "train_text_to_image.py"
PROMPTS = ["a handwritten digit seven", "a handwritten digit one"]


@pytest.fixture(scope="module")
def common(tiny_sd_path, sd_folder):
    """12 captioned digits of 72 x 80 px cropped at random to 64 and flipped, every extra of the loss on,
    EMA; 3 steps an epoch at batch 4."""
    return ["--pretrained_model_name_or_path", tiny_sd_path, "--train_data_dir", sd_folder, "--resolution", "64",
            "--random_flip", "--use_ema", "--caption_dropout_rate", "0.3", "--noise_offset", "0.1",
            "--input_perturbation", "0.1", "--snr_gamma", "5", "--learning_rate", "1e-3", "--lr_warmup_steps", "0",
            "--max_train_steps", "6", "--checkpointing_steps", "2", "--train_batch_size", "4",
            "--num_inference_steps", "2", "--report_to", "none"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory, common):
    out = tmp_path_factory.mktemp("t2i") / "ref"
    train_in_process(SCRIPT, common + ["--output_dir", out, "--validation_prompts", *PROMPTS, "--validation_epochs", "1"])
    return out


def test_resume_is_exact(reference, common):
    out = resume_copy(reference, "checkpoint-4")
    train_in_process(SCRIPT, common + ["--output_dir", out, "--resume_from_checkpoint", "latest"])
    for sub in ["checkpoint-6/unet", "unet"]:
        assert_same_weights(weights(out / sub), weights(reference / sub))
    assert_same_ema(out / "checkpoint-6", reference / "checkpoint-6", "unet")
    assert_same_optimizer_state(out / "checkpoint-6", reference / "checkpoint-6")


def test_only_the_unet_learns_and_the_output_is_a_whole_pipeline(reference, tiny_sd_path):
    from diffusers import StableDiffusionPipeline, UNet2DConditionModel

    assert checkpoints(reference) == ["checkpoint-2", "checkpoint-4", "checkpoint-6"]
    UNet2DConditionModel.from_pretrained(reference / "checkpoint-6", subfolder="unet")
    for part in ["vae", "text_encoder"]:  # as they were on disk
        name = "model.safetensors" if part == "text_encoder" else "diffusion_pytorch_model.safetensors"
        assert_same_weights(weights(reference / part, name), weights(f"{tiny_sd_path}/{part}", name))
    trained, base = weights(reference / "unet"), weights(f"{tiny_sd_path}/unet")
    assert all(not torch.equal(trained[k], base[k]) for k in ["conv_in.weight", "conv_out.weight"])
    averaged = ema_weights(reference / "checkpoint-6", "unet")[0]
    assert_same_weights({k: trained[k] for k in averaged}, averaged)  # EMA weights saved
    pipeline = StableDiffusionPipeline.from_pretrained(reference)
    images = pipeline(PROMPTS[0], num_inference_steps=2, output_type="np").images
    assert images.shape == (1, 64, 64, 3)
    assert sorted(p.name for p in (reference / "samples").iterdir()) == ["step-3.png", "step-6.png"]


def test_a_v_prediction_run_saves_a_scheduler_that_says_so(common, tmp_path):
    from diffusers import StableDiffusionPipeline

    train_in_process(SCRIPT, common + ["--output_dir", tmp_path, "--prediction_type", "v_prediction", "--max_train_steps", "1"])
    assert StableDiffusionPipeline.from_pretrained(tmp_path).scheduler.config.prediction_type == "v_prediction"


def captions_of(folder, tiny_sd_path, *flags, epoch=0):
    """The captions that the script's transform gives each image, decoded back from the token ids."""
    from transformers import CLIPTokenizer

    script = import_script("train_text_to_image")
    args = script.parse_args(["--pretrained_model_name_or_path", tiny_sd_path, "--train_data_dir", str(folder), *flags])
    dataset = script.load_datasets(args, args.image_column)["train"]
    if args.instance_prompt is None and args.caption_column not in dataset.column_names:
        dataset = dataset.map(script.read_caption, input_columns="image", fn_kwargs=dict(args=args))
    tokenizer = CLIPTokenizer.from_pretrained(tiny_sd_path, subfolder="tokenizer")
    batch = script.preprocess(dataset[:12], args, lambda image: torch.zeros(1), tokenizer, [(64, 64)], None, epoch)
    return tokenizer.batch_decode(batch["input_ids"], skip_special_tokens=True)


def test_captions_come_from_metadata_caption_files_or_the_instance_prompt(sd_folder, kohya_folder, tiny_sd_path, tmp_path):
    from conftest import caption, digit_images

    expected = [caption(label) for _, label in digit_images(12)]
    assert captions_of(sd_folder, tiny_sd_path) == expected
    kohya = shutil.copytree(kohya_folder, tmp_path / "kohya")
    for path in sorted(kohya.glob("*.txt"))[::2]:  # a Windows editor's byte-order mark
        path.write_text("\ufeff" + path.read_text(), encoding="utf-8")
    assert captions_of(kohya, tiny_sd_path) == expected
    assert set(captions_of(sd_folder, tiny_sd_path, "--instance_prompt", "a photo of the number seven")) == {
        "a photo of the number seven"}
    dropped = captions_of(sd_folder, tiny_sd_path, "--caption_dropout_rate", "0.5")
    assert 0 < dropped.count("") < 12 and all(c in ("", e) for c, e in zip(dropped, expected))
    assert captions_of(sd_folder, tiny_sd_path, "--caption_dropout_rate", "0.5", epoch=1) != dropped  # new draws


def test_one_caption_of_a_list_is_drawn(tmp_path, tiny_sd_path):
    import json

    from conftest import write_imagefolder

    folder = write_imagefolder(tmp_path / "lists", 12)
    rows = [json.loads(line) for line in open(f"{folder}/metadata.jsonl")]
    with open(f"{folder}/metadata.jsonl", "w") as f:
        for row in rows:
            f.write(json.dumps({**row, "text": [row["text"], "a photo of the number " + row["text"].split()[-1]]}) + "\n")
    captions = captions_of(folder, tiny_sd_path)
    assert all(c in (row["text"], "a photo of the number " + row["text"].split()[-1]) for c, row in zip(captions, rows))
    assert len({c.split()[1] for c in captions}) == 2  # both kinds drawn


def test_a_missing_caption_is_the_empty_prompt(tmp_path, tiny_sd_path):
    import json

    from conftest import write_imagefolder

    folder = write_imagefolder(tmp_path / "gaps", 12)
    rows = [json.loads(line) for line in open(f"{folder}/metadata.jsonl")]
    with open(f"{folder}/metadata.jsonl", "w") as f:
        for i, row in enumerate(rows):
            f.write(json.dumps({**row, "text": None if i % 3 == 0 else row["text"]}) + "\n")
    captions = captions_of(folder, tiny_sd_path)
    assert captions == ["" if i % 3 == 0 else row["text"] for i, row in enumerate(rows)]


def test_cached_latents_train(common, tmp_path):
    from diffusers import StableDiffusionPipeline

    out = tmp_path / "cached"
    train_in_process(SCRIPT, common + ["--output_dir", out, "--cache_latents", "--center_crop", "--max_train_steps", "2"])
    StableDiffusionPipeline.from_pretrained(out)


def test_the_diffusers_readme_command_runs(tiny_sd_path, sd_folder, tmp_path, capsys):
    """examples/text_to_image/README.md's command, flags as written, for 2 steps. Adapted: the model is the tiny
    SD and the dataset a local imagefolder (offline); `accelerate launch --mixed_precision="fp16"` is left out
    (fp16 needs a GPU: this CPU runs fp32)."""
    from diffusers import StableDiffusionPipeline

    out = tmp_path / "sd-naruto-model"
    train_in_process(SCRIPT, [
        f"--pretrained_model_name_or_path={tiny_sd_path}", f"--dataset_name={sd_folder}", "--use_ema",
        "--resolution=512", "--center_crop", "--random_flip", "--train_batch_size=1", "--gradient_accumulation_steps=4",
        "--gradient_checkpointing", "--max_train_steps=15000", "--learning_rate=1e-05", "--max_grad_norm=1",
        "--lr_scheduler=constant", "--lr_warmup_steps=0", f"--output_dir={out}", "--max_train_steps", "2"])
    StableDiffusionPipeline.from_pretrained(out)
    assert list((out / "logs" / "text2image-fine-tune").iterdir())  # TensorBoard's events, in --logging_dir


@pytest.mark.parametrize("flag, why", [
    (["--hub_token", "hf_x"], "--hub_token is left out: a token in a command lands in shell history; "
                              "run `hf auth login`"),
    (["--dream_training"], "--dream_training is left out: "),
    (["--non_ema_revision", "main"], "--non_ema_revision is left out: "),
])
def test_a_refused_official_flag_ends_in_one_line(flag, why, capsys):
    with pytest.raises(SystemExit):
        import_script("train_text_to_image").parse_args(["--pretrained_model_name_or_path", "x", "--train_data_dir", "y",
                                                         *flag])
    error = capsys.readouterr().err.splitlines()[-1]  # after argparse's usage line
    assert error.split(": error: ", 1)[1].startswith(why)


def test_ignored_official_flags_train(common, tmp_path, monkeypatch):
    """Ignored flags (their help says why) train; --foreach_ema reaches EMAModel (its foreach update), and
    --dream_detail_preservation means nothing without --dream_training, in the official script too."""
    script, built = import_script("train_text_to_image"), []

    class RecordedEMA(script.EMAModel):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            built.append(self.foreach)

    monkeypatch.setattr(script, "EMAModel", RecordedEMA)
    ignored = ["--enable_xformers_memory_efficient_attention", "--offload_ema"]
    train_in_process(SCRIPT, common + ["--output_dir", tmp_path, "--max_train_steps", "1", *ignored, "--foreach_ema",
                                       "--dream_detail_preservation", "0.5"])
    assert built == [True] and (tmp_path / "unet").is_dir()


def test_max_train_samples_makes_an_epoch_shorter_and_scale_lr_multiplies(common, tmp_path):
    """5 of the 12 images at batch 2: an epoch of 3 steps, not 6; the rate 1e-3 x the total batch 2."""
    at = common.index("--max_train_steps")
    args = common[:at] + common[at + 2:] + ["--output_dir", tmp_path, "--max_train_samples", "5", "--num_train_epochs",
                                            "1", "--scale_lr", "--train_batch_size", "2", "--checkpointing_steps", "1"]
    train_in_process(SCRIPT, args)
    assert checkpoints(tmp_path) == ["checkpoint-1", "checkpoint-2", "checkpoint-3"]
    scheduler = torch.load(tmp_path / "checkpoint-3" / "scheduler.bin", weights_only=False)
    assert scheduler["base_lrs"] == [pytest.approx(2e-3)]


@pytest.mark.parametrize("case, expected", [
    ("not_a_pipeline", "error: --pretrained_model_name_or_path {empty}: "),
    ("no_such_dir", "error: --train_data_dir /no/such/dir: "),
    ("no_captions", "error: no column 'caption'; give --instance_prompt or caption files: FileNotFoundError: "),
    ("corrupt_image", "error: image "),
    ("fp16_on_cpu", "error: --mixed_precision fp16 needs a GPU"),
    ("missing_checkpoint", "error: --resume_from_checkpoint "),
    ("zero3", "error: ZeRO-3 needs `--zero3_save_16bit_model true`, no --use_ema, no held-out loss"),
])
def test_bad_input_is_one_clear_error(case, expected, tiny_sd_path, sd_folder, corrupt_folder, empty_folder, tmp_path,
                                      run_in_process, monkeypatch):
    args = ["--pretrained_model_name_or_path", tiny_sd_path, "--train_data_dir", sd_folder, "--resolution", "64",
            "--output_dir", tmp_path, "--report_to", "none", "--train_batch_size", "6"]
    changes = {"not_a_pipeline": ["--pretrained_model_name_or_path", empty_folder],
               "no_such_dir": ["--train_data_dir", "/no/such/dir"], "no_captions": ["--caption_column", "caption"],
               "corrupt_image": ["--train_data_dir", corrupt_folder], "fp16_on_cpu": ["--mixed_precision", "fp16"],
               "missing_checkpoint": ["--resume_from_checkpoint", "checkpoint-9"], "zero3": []}
    if case == "zero3":  # what `accelerate launch --use_deepspeed --zero_stage 3` tells the script
        require_deepspeed()
        monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
        monkeypatch.setenv("ACCELERATE_DEEPSPEED_ZERO_STAGE", "3")
    error = run_in_process(SCRIPT, args + changes[case])
    assert error.startswith(expected.format(empty=empty_folder)) and "\n" not in error
    assert not list(tmp_path.iterdir())  # nothing written


def test_caching_needs_a_center_crop(capsys):
    with pytest.raises(SystemExit):
        import_script("train_text_to_image").parse_args(
            ["--pretrained_model_name_or_path", "x", "--train_data_dir", "y", "--cache_latents"])
    assert "--cache_latents needs --center_crop" in capsys.readouterr().err


def test_deepspeed_zero3_trains_validates_resumes_and_saves_a_pipeline(common, tiny_sd_path, tmp_path):
    """Under ZeRO-3 each process holds a part of the UNet. The frozen VAE and CLIP load whole, outside
    DeepSpeed's partitioning; both processes run validation; the final save gathers the UNet into a pipeline
    users load; a run resumed from a checkpoint ends with the same weights."""
    from diffusers import StableDiffusionPipeline

    args = [a for a in common if a != "--use_ema"] + ["--train_batch_size", "2", "--max_train_steps", "4",
                                                      "--validation_prompts", PROMPTS[0], "--validation_epochs", "1"]
    out = tmp_path / "zero3"
    run_script(SCRIPT, args + ["--output_dir", out], num_processes=2, launch_args=zero(3))
    assert sorted(p.name for p in (out / "samples").iterdir()) == ["step-3.png", "step-4.png"]  # epochs of 3
    trained, base = weights(out / "unet"), weights(f"{tiny_sd_path}/unet")
    assert trained.keys() == base.keys() and all(not torch.equal(trained[k], base[k]) for k in ["conv_in.weight"])
    resumed = resume_copy(out, "checkpoint-2")
    run_script(SCRIPT, args + ["--output_dir", resumed, "--resume_from_checkpoint", "latest"], num_processes=2,
               launch_args=zero(3))
    assert_same_weights(weights(resumed / "unet"), trained)
    images = StableDiffusionPipeline.from_pretrained(resumed)(PROMPTS[0], num_inference_steps=2, output_type="np").images
    assert images.shape == (1, 64, 64, 3)
