"""train_lora.py: the files users load (diffusers, kohya), exact resume, equivalent runs, fp32 LoRA under bf16,
clipping, learning, the checkpoint contract, DeepSpeed, bad input."""
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import (EQUIVALENT, NO_EMA, STABLE_ADAM, assert_same_optimizer_state, assert_same_weights, caption, checkpoints,
                      copy_without_ema, load_digits_images, run_script, snapshot, write_imagefolder, zero)
from PIL import Image
from safetensors.torch import load_file

SCRIPT = "train_lora.py"
PROMPTS = ["a handwritten digit seven", "a handwritten digit one"]
LORA = "pytorch_lora_weights.safetensors"
KOHYA_KEY = re.compile(r"^lora_(unet|te)_[a-z0-9_]+\.(lora_down\.weight|lora_up\.weight|alpha)$")


@pytest.fixture(scope="module")
def kohya_folder(tmp_path_factory):
    """12 digit images, each with its caption in a .txt file beside it, and no metadata.jsonl (kohya's layout)."""
    path = Path(write_imagefolder(tmp_path_factory.mktemp("kohya"), 12, columns=()))
    for i, (_, label) in enumerate(load_digits_images(12)):
        (path / f"{i:04d}.txt").write_text(caption(label) + "\n")
    return str(path)


@pytest.fixture(scope="module")
def base(tiny_sd_path, kohya_folder):
    return ["--pretrained_model_name_or_path", tiny_sd_path, "--train_data_dir", kohya_folder, "--resolution", "64",
            "--report_to", "none", "--seed", "0", "--learning_rate", "1e-3", "--lr_warmup_steps", "0"]


@pytest.fixture(scope="module")
def common(base):
    """Every random draw exercised; LoRA on the UNet and the text encoder, alpha = 2·rank, EMA; 12 images at batch 2
    give 6 steps an epoch, so checkpoint-4 falls mid-epoch."""
    return base + ["--random_flip", "--use_ema", "--train_text_encoder", "--text_encoder_lr", "5e-4", "--rank", "4", "--lora_alpha", "8",
                   "--max_train_steps", "6", "--checkpointing_steps", "2", "--checkpoints_total_limit", "2",
                   "--noise_offset", "0.1", "--input_perturbation", "0.1", "--snr_gamma", "5", "--max_grad_norm", "0.1",
                   *STABLE_ADAM]


@pytest.fixture(scope="module")
def reference(tmp_path_factory, common):
    out = tmp_path_factory.mktemp("lora") / "ref"
    log = run_script(SCRIPT, common + ["--train_batch_size", "2", "--output_dir", out, "--validation_prompts", *PROMPTS,
                                       "--num_validation_images", "2", "--validation_steps", "4", "--report_to", "tensorboard"])
    return out, log


def pipeline(tiny_sd_path):
    from diffusers import StableDiffusionPipeline

    pipe = StableDiffusionPipeline.from_pretrained(tiny_sd_path)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def generate(pipe, **kwargs):
    images = pipe(PROMPTS, num_inference_steps=3, generator=torch.manual_seed(0), output_type="np", **kwargs).images
    assert images.shape == (2, 64, 64, 3) and np.isfinite(images).all()
    return images


def lora_weights(folder):
    return load_file(Path(folder) / LORA)


# ----------------------------------------------------------------------------- the files users load


def test_checkpoints_hold_the_lora_alone_and_rotate(reference, tiny_sd_path):
    out, log = reference
    assert checkpoints(out) == ["checkpoint-4", "checkpoint-6"]
    unet_bytes = next((Path(tiny_sd_path) / "unet").glob("*.safetensors")).stat().st_size
    for checkpoint in checkpoints(out):
        files = {p.name: p.stat().st_size for p in (out / checkpoint).iterdir()}
        assert {LORA, "lora_ema.pt", "optimizer.bin", "scheduler.bin", "random_states_0.pkl"} <= files.keys()
        assert max(files.values()) < unet_bytes / 4
    weights = lora_weights(out)
    assert any(k.startswith("unet.") for k in weights) and any(k.startswith("text_encoder.") for k in weights)
    n = sum(v.numel() for v in weights.values())
    assert f"Training {n:,} LoRA parameters (torch.float32)" in log


def test_the_saved_file_renders_what_the_live_adapter_rendered(reference):
    """After training, the script unloads the live adapter, loads its own saved file into the same modules and
    renders the prompts again. alpha = 2·rank: the file's metadata must carry alpha, or the strength halves."""
    out, _ = reference
    live, from_file = (np.asarray(Image.open(out / "samples" / name), dtype=float) for name in ["step-6.png", "final.png"])
    assert np.abs(live - from_file).max() <= 1  # 8-bit PNGs
    # each row: 2 images at LoRA scale 0, then 2 at scale 1; the LoRA must visibly change them
    tile = 64 + 2
    base_half, lora_half = live[:, 2 : 2 * tile], live[:, 2 * tile + 2 : 4 * tile]
    assert live.shape[:2] == (2 * tile + 2, 4 * tile + 2) and np.abs(base_half - lora_half).mean() > 1


def test_diffusers_file_kohya_file_and_fused_weights_give_the_same_images(reference, tiny_sd_path):
    out, _ = reference
    pipe = pipeline(tiny_sd_path)
    untouched = generate(pipe)
    pipe.load_lora_weights(out)
    with_lora = generate(pipe)
    assert np.abs(with_lora - untouched).max() > 1e-3
    pipe.fuse_lora()  # the LoRA merged into W: the same function
    np.testing.assert_allclose(generate(pipe), with_lora, atol=2e-3)

    kohya = load_file(out / f"{out.name}.safetensors")
    assert all(KOHYA_KEY.match(k) for k in kohya), [k for k in kohya if not KOHYA_KEY.match(k)][:3]
    assert any(k.startswith("lora_te_") for k in kohya) and not any(k.startswith("lora_te1_") for k in kohya)
    alphas = [v for k, v in kohya.items() if k.endswith(".alpha")]
    assert len(alphas) == len(kohya) // 3 and all(float(a) == 8.0 for a in alphas)  # the trained alpha, 2·rank
    pipe = pipeline(tiny_sd_path)
    pipe.load_lora_weights(out, weight_name=f"{out.name}.safetensors")
    np.testing.assert_allclose(generate(pipe), with_lora, atol=2e-3)


def test_output_dir_dot_names_the_kohya_file_after_the_folder(tiny_sd_path, tmp_path, monkeypatch):
    """`--output_dir .` (a common way to run in the folder itself): the ComfyUI/A1111 file is `<folder>.safetensors`."""
    from diffusers import UNet2DConditionModel
    from peft import LoraConfig

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parent.parent))
    from train_lora import parse_args, save_kohya

    unet = UNet2DConditionModel.from_pretrained(tiny_sd_path, subfolder="unet")
    unet.add_adapter(LoraConfig(r=4, lora_alpha=2, target_modules=["to_q"]))
    (tmp_path / "my-style").mkdir()
    monkeypatch.chdir(tmp_path / "my-style")
    save_kohya(parse_args(["--pretrained_model_name_or_path", "x", "--train_data_dir", "x", "--output_dir", ".", "--lora_alpha", "2"]),
               unet, None)
    assert [p.name for p in Path().iterdir()] == ["my-style.safetensors"]
    kohya = load_file("my-style.safetensors")
    assert kohya and all(KOHYA_KEY.match(k) for k in kohya) and {float(v) for k, v in kohya.items() if k.endswith(".alpha")} == {2.0}


def test_lora_dropout_trains_but_never_samples(base, tiny_sd_path, tmp_path):
    """Dropout is for training. The live validation samples in eval mode, so the last step's grid equals the one
    rendered from the saved file; the file loads into diffusers with no dropout (it would load the UNet's active)."""
    out = tmp_path / "dropout"
    run_script(SCRIPT, base + ["--output_dir", out, "--lora_dropout", "0.5", "--train_text_encoder", "--learning_rate", "1e-2",
                               "--train_batch_size", "2", "--max_train_steps", "2", "--validation_steps", "2",
                               "--validation_prompts", PROMPTS[0], "--num_validation_images", "1"])
    live, from_file = (np.asarray(Image.open(out / "samples" / name), dtype=float) for name in ["step-2.png", "final.png"])
    assert np.abs(live - from_file).max() <= 1  # 8-bit PNGs
    pipe = pipeline(tiny_sd_path)
    pipe.load_lora_weights(out)
    modules = [*pipe.unet.modules(), *pipe.text_encoder.modules()]
    assert sum("lora_A" in name for m in modules for name, _ in m.named_children()) > 0  # the adapters are there
    assert not any(isinstance(m, torch.nn.Dropout) and m.p > 0 and m.training for m in modules)


def test_model_card_and_tracker(reference, tiny_sd_path):
    out, _ = reference
    card = (out / "README.md").read_text()
    assert tiny_sd_path in card and "Rank 4, alpha 8" in card and "samples/step-6.png" in card
    assert f"pipe.load_lora_weights(\"{out}\")" in card and f"{out.name}.safetensors" in card
    assert list((out / "logs").rglob("events.out.tfevents.*"))
    assert sorted(p.name for p in (out / "samples").iterdir()) == ["final.png", "step-4.png", "step-6.png"]  # --validation_steps 4


def test_an_untrained_adapter_changes_nothing(base, tiny_sd_path, tmp_path):
    out = tmp_path / "untrained"
    run_script(SCRIPT, base + ["--output_dir", out, "--max_train_steps", "1", "--learning_rate", "0", "--train_text_encoder"])
    weights = lora_weights(out)
    ups = [k for k in weights if k.endswith("up.weight")]  # B: unet.….lora.up, text_encoder.….lora_linear_layer.up
    assert any(k.startswith("text_encoder.") for k in ups) and all(not weights[k].any() for k in ups)  # B = 0
    assert all(v.any() for k, v in weights.items() if k.endswith("down.weight"))  # A random
    pipe = pipeline(tiny_sd_path)
    untouched = generate(pipe)
    pipe.load_lora_weights(out)
    np.testing.assert_allclose(generate(pipe), untouched, atol=1e-6)


# ----------------------------------------------------------------------------- training


def test_resume_is_exact(reference, common, tmp_path):
    out = tmp_path / "resumed"
    shutil.copytree(reference[0] / "checkpoint-4", out / "checkpoint-4")
    log = run_script(SCRIPT, common + ["--train_batch_size", "2", "--output_dir", out, "--resume_from_checkpoint", "latest"])
    assert f"Resuming from {out / 'checkpoint-4'}" in log
    assert_same_weights(lora_weights(out), lora_weights(reference[0]))
    assert_same_weights(lora_weights(out / "checkpoint-6"), lora_weights(reference[0] / "checkpoint-6"))
    ema, ema_ref = (torch.load(d / "checkpoint-6" / "lora_ema.pt") for d in (out, reference[0]))
    for a, b in zip(ema["shadow_params"], ema_ref["shadow_params"], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-12)
    opt, opt_ref = assert_same_optimizer_state(out / "checkpoint-6", reference[0] / "checkpoint-6")
    assert [g["lr"] for g in opt["param_groups"]] == [g["lr"] for g in opt_ref["param_groups"]] == [1e-3, 5e-4]  # UNet, text encoder


def test_gradient_checkpointing_trains_the_same_lora_and_counts_the_recomputed_forward(reference, common, tmp_path):
    """The UNet's and the text encoder's blocks recomputed in the backward: the LoRA of both moves as without, and the
    logged FLOPs of a micro-batch grow by less than one forward (LoRA's backward skips the frozen weights' gradients)."""
    out = tmp_path / "checkpointed"
    log = run_script(SCRIPT, common + ["--train_batch_size", "2", "--output_dir", out, "--max_train_steps", "4", "--gradient_checkpointing"])
    weights = lora_weights(out / "checkpoint-4")
    assert any(v.any() for k, v in weights.items() if k.startswith("text_encoder.") and k.endswith("up.weight"))  # its B moved
    assert_same_weights(weights, lora_weights(reference[0] / "checkpoint-4"), **EQUIVALENT)
    line = r"One micro-batch of 2 images: text encoder and UNet forward and backward (\S+) FLOPs"
    plain, recomputed = (float(re.search(line, text).group(1)) for text in (reference[1], log))
    assert plain < recomputed < 1.5 * plain


def test_two_processes_match_one_with_the_same_global_batch(reference, common, tmp_path):
    out = tmp_path / "ddp"
    run_script(SCRIPT, common + ["--train_batch_size", "1", "--output_dir", out], num_processes=2)
    assert checkpoints(out) == ["checkpoint-4", "checkpoint-6"]
    assert_same_weights(lora_weights(out), lora_weights(reference[0]), **EQUIVALENT)


def test_clipping_clips(reference, common, tmp_path):
    """Adam's first step is ~lr·sign(g) whatever the scale of g, unless g is clipped far below its epsilon: with
    --max_grad_norm 1e-7 and epsilon 1e-4 the LoRA barely moves, where the reference run (norm 0.1) moved it."""
    out = tmp_path / "clipped"
    run_script(SCRIPT, common + ["--train_batch_size", "2", "--output_dir", out, "--max_train_steps", "4", "--max_grad_norm", "1e-7"])
    clipped, moved = lora_weights(out / "checkpoint-4"), lora_weights(reference[0] / "checkpoint-4")
    ups = [k for k in moved if k.endswith("up.weight")]  # B starts at 0: its value is all it has moved
    assert sum(clipped[k].abs().sum() for k in ups) < 0.01 * sum(moved[k].abs().sum() for k in ups)


def test_bf16_trains_fp32_lora_on_bf16_weights_and_keeps_the_contract(base, tiny_sd_path, tmp_path):
    """The Diffusers contract: 4 steps save checkpoint-2 and -4; a rerun to 8 steps with a limit of 2 keeps -6 and -8;
    after each run the output loads. The LoRA stays float32 under bf16, after the resume too."""
    out = tmp_path / "bf16"
    args = base + ["--train_batch_size", "2", "--output_dir", out, "--checkpointing_steps", "2", "--mixed_precision", "bf16"]
    for steps, expected in [("4", ["checkpoint-2", "checkpoint-4"]), ("8", ["checkpoint-6", "checkpoint-8"])]:
        resume = ["--resume_from_checkpoint", "checkpoint-4", "--checkpoints_total_limit", "2"] if steps == "8" else []
        log = run_script(SCRIPT, args + ["--max_train_steps", steps, *resume])
        assert "LoRA parameters (torch.float32); the frozen weights are torch.bfloat16" in log
        assert checkpoints(out) == expected
        assert {v.dtype for v in lora_weights(out / expected[-1]).values()} == {torch.float32}
        pipe = pipeline(tiny_sd_path)
        pipe.load_lora_weights(out)
        generate(pipe)


def test_lora_lowers_the_denoising_loss_on_its_training_images(tiny_sd_path, kohya_folder, tmp_path):
    """A learning check that works on a random tiny model: at fixed noise and timesteps, the denoising loss on the
    training images with the LoRA is below the base model's. Trained with one --instance_prompt."""
    out = tmp_path / "learn"
    prompt = "a photo of sks digit"
    log = run_script(SCRIPT, ["--pretrained_model_name_or_path", tiny_sd_path, "--train_data_dir", kohya_folder, "--resolution", "64",
                              "--output_dir", out, "--instance_prompt", prompt, "--center_crop", "--train_batch_size", "4",
                              "--max_train_steps", "40", "--learning_rate", "1e-2", "--lr_warmup_steps", "0", "--rank", "8",
                              "--seed", "0", "--report_to", "none"])
    assert f'Every image is captioned "{prompt}" (--instance_prompt)' in log
    pipe = pipeline(tiny_sd_path)
    images = torch.stack([torch.from_numpy(np.asarray(Image.open(p).convert("RGB"), dtype=np.float32) / 127.5 - 1).permute(2, 0, 1)
                          for p in sorted(Path(kohya_folder).glob("*.png"))])
    images, generator = images.repeat(4, 1, 1, 1), torch.manual_seed(1)  # each image at 4 noise levels
    with torch.no_grad():
        latents = pipe.vae.encode(images).latent_dist.mean * pipe.vae.config.scaling_factor
        noise = torch.randn(latents.shape, generator=generator)
        timesteps = torch.randint(0, 1000, (len(latents),), generator=generator)
        noisy = pipe.scheduler.add_noise(latents, noise, timesteps)

        def loss():
            text = pipe.text_encoder(pipe.tokenizer([prompt] * len(latents), padding="max_length", max_length=77,
                                                    return_tensors="pt").input_ids)[0]
            return torch.nn.functional.mse_loss(pipe.unet(noisy, timesteps, text).sample, noise).item()

        before = loss()
        pipe.load_lora_weights(out)
        after = loss()
    print(f"\ndenoising loss on the training images: base {before:.4f}, with the LoRA {after:.4f}")
    assert after < 0.98 * before


# ----------------------------------------------------------------------------- real launches


def test_deepspeed_zero2_stores_no_frozen_weights_and_resumes(base, tiny_sd_path, tmp_path):
    out, resumed = tmp_path / "zero2", tmp_path / "zero2-resumed"
    args = base + ["--train_batch_size", "1", "--max_train_steps", "4", "--checkpointing_steps", "2", *STABLE_ADAM]
    run_script(SCRIPT, args + ["--output_dir", out], num_processes=2, launch_args=zero(2))
    unet_bytes = next((Path(tiny_sd_path) / "unet").glob("*.safetensors")).stat().st_size
    assert max(p.stat().st_size for p in (out / "checkpoint-2").rglob("*") if p.is_file()) < unet_bytes / 4
    shutil.copytree(out / "checkpoint-2", resumed / "checkpoint-2")
    run_script(SCRIPT, args + ["--output_dir", resumed, "--resume_from_checkpoint", "latest"], num_processes=2, launch_args=zero(2))
    assert_same_weights(lora_weights(resumed), lora_weights(out))


def test_deepspeed_refuses_text_encoder_training_and_zero3(base, tmp_path):
    victim = tmp_path / "victim"
    victim.mkdir()
    for stage, extra, expected in [(2, ["--train_text_encoder"], "--train_text_encoder does not work under DeepSpeed"),
                                   (3, [], "train_lora.py keeps the frozen model whole on each process")]:
        log = run_script(SCRIPT, base + ["--output_dir", victim, *extra], num_processes=2, launch_args=zero(stage), expect_fail=True)
        assert expected in log and "Steps:" not in log and not any(victim.iterdir())


def test_cached_text_embeddings_train_the_lora_of_an_uncached_run(base, tmp_path):
    """The text encoder runs once per caption, before training, beside random crops and flips of the images (read as
    before: the cache files hold the embeddings alone); the LoRA ends as in a run that encodes every step (up to float
    reordering). Both caches together: tested for text-to-image, whose helpers are these word for word."""
    args = base + ["--random_flip", "--train_batch_size", "2", "--max_train_steps", "4", "--checkpointing_steps", "100", *STABLE_ADAM]
    plain = run_script(SCRIPT, args + ["--output_dir", tmp_path / "plain"])
    cached = run_script(SCRIPT, args + ["--output_dir", tmp_path / "cached", "--cache_text_embeddings"])
    assert "Cached the encodings of 12 images" in cached
    frozen = [float(re.search(r"frozen VAE and text encoder (\S+)$", log, re.MULTILINE).group(1)) for log in (plain, cached)]
    assert 0 < frozen[1] < frozen[0]  # the VAE still runs in the loop, the text encoder no longer
    assert_same_weights(lora_weights(tmp_path / "cached"), lora_weights(tmp_path / "plain"), **EQUIVALENT)


# ----------------------------------------------------------------------------- bad input


@pytest.fixture(scope="module")
def t2i_checkpoint(tmp_path_factory, tiny_sd_path, kohya_folder):
    """A checkpoint written by train_text_to_image.py: a full UNet, not a LoRA."""
    out = tmp_path_factory.mktemp("t2i") / "out"
    run_script("train_text_to_image.py", ["--pretrained_model_name_or_path", tiny_sd_path, "--train_data_dir", kohya_folder,
                                          "--resolution", "64", "--max_train_steps", "1", "--checkpointing_steps", "1",
                                          "--report_to", "none", "--output_dir", out])
    return out


@pytest.mark.parametrize("case", ["rank", "target", "no_captions", "missing_caption", "hub_style_without_captions", "t2i_checkpoint",
                                  "not_a_pipeline", "resume_other_rank", "resume_other_targets", "resume_other_text_encoder",
                                  "resume_adding_ema"])
def test_bad_input_is_one_clear_error(case, base, tmp_path, plain_image_folder, kohya_folder, request, run_in_process):
    folder = tmp_path / "missing_caption"
    if case == "missing_caption":  # one caption file missing in an otherwise kohya-style folder
        shutil.copytree(kohya_folder, folder)
        (folder / "0005.txt").unlink()
    victim = request.getfixturevalue("t2i_checkpoint") if case == "t2i_checkpoint" else tmp_path / "victim"
    if case.startswith("resume_other"):  # the reference run's checkpoint: rank 4 on the default targets, text encoder, EMA
        shutil.copytree(request.getfixturevalue("reference")[0] / "checkpoint-6", victim / "checkpoint-6")
    if case == "resume_adding_ema":
        copy_without_ema(request.getfixturevalue("reference")[0] / "checkpoint-6", "lora_ema.pt", victim / "checkpoint-9")
    resume = ["--resume_from_checkpoint", "latest", "--train_batch_size", "2", "--train_text_encoder"]  # as the reference run
    misfit = "does not fit this run's adapters: resume with its --rank and --lora_target_modules"
    extra, expected = {
        "rank": (["--rank", "0"], "--rank must be a positive integer, not 0"),
        "target": (["--lora_target_modules", "to_q, to_kk"],
                   "--lora_target_modules 'to_kk' matches no layer of the UNet; some that exist: "),
        "no_captions": (["--train_data_dir", plain_image_folder],
                        "has no caption: add a metadata.jsonl with a 'text' column, a caption file beside each image"),
        "missing_caption": (["--train_data_dir", folder], f"image {folder / '0005.png'} has no caption"),
        "t2i_checkpoint": (["--resume_from_checkpoint", "checkpoint-1"], "is not a checkpoint-N folder written by train_lora.py"),
        "not_a_pipeline": (["--pretrained_model_name_or_path", kohya_folder], "is not a Stable Diffusion pipeline: no model_index.json"),
        "hub_style_without_captions": (["--dataset_name", "imagefolder", "--train_data_dir", plain_image_folder],
                                       "--caption_column 'text' is not in the dataset; its columns are ['image'] (or give --instance_prompt)"),
        "resume_other_rank": ([*resume, "--rank", "8"], misfit),
        "resume_other_targets": ([*resume, "--lora_target_modules", "to_q,to_k,to_v,to_out.0,proj_in"], misfit),
        "resume_other_text_encoder": (resume[:-1], "does not fit this run's adapters: resume with its --train_text_encoder"),
        "resume_adding_ema": ([*resume, "--use_ema"], f"checkpoint-9 {NO_EMA}"),
    }[case]
    before = snapshot(Path(victim)) if Path(victim).exists() else None
    log = run_in_process(SCRIPT, base + ["--output_dir", victim, *extra])
    assert expected in log
    assert "Steps:" not in log
    assert (snapshot(Path(victim)) if Path(victim).exists() else None) == before


def test_flag_defaults_and_parser_errors(monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parent.parent))
    from train_lora import parse_args

    required = ["--pretrained_model_name_or_path", "x", "--train_data_dir", "x"]
    assert parse_args(required + ["--validation_prompt", "a"]).validation_prompts == ["a"]  # the example's flag
    assert parse_args(required + ["--validation_prompts", "a", "b"]).validation_prompts == ["a", "b"]
    args = parse_args(required + ["--rank", "8"])
    assert (args.lora_alpha, args.text_encoder_lr) == (8, args.learning_rate)  # the defaults follow --rank and the LR
    for flags, error in [(["--cache_text_embeddings", "--train_text_encoder"], "--cache_text_embeddings cannot be used with --train_text_encoder"),
                         (["--lora_alpha", "0"], "--lora_alpha must be positive, not 0"),
                         (["--lora_dropout", "1"], "--lora_dropout must be in [0, 1), not 1")]:
        with pytest.raises(SystemExit):
            parse_args(required + flags)
        assert error in capsys.readouterr().err
