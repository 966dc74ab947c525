"""train_text_to_image.py: the checkpoint contract, exact resume, min-SNR, v-prediction, frozen parts, output, bad input."""
import json
import re
import shlex
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import (CORRUPT_FILE, EQUIVALENT, NO_EMA, REPO, STABLE_ADAM, assert_resumes_exactly, assert_same_optimizer_state,
                      assert_same_weights, checkpoints, copy_without_ema, run_script, snapshot, unet_weights, write_imagefolder,
                      zero)
from PIL import Image
from safetensors.torch import load_file

SCRIPT = "train_text_to_image.py"
PROMPTS = ["a handwritten digit seven", "a handwritten digit one"]


def generate(folder):
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(folder)
    images = pipe(PROMPTS[0], num_inference_steps=2, height=64, width=64, generator=torch.manual_seed(0),
                  output_type="np").images
    assert images.shape == (1, 64, 64, 3) and np.isfinite(images).all()
    return pipe


@pytest.fixture(scope="module")
def base(tiny_sd_path, caption_folder):
    return ["--pretrained_model_name_or_path", tiny_sd_path, "--train_data_dir", caption_folder, "--resolution", "64",
            "--report_to", "none"]


@pytest.fixture(scope="module")
def common(base):
    """20 captioned images at 64 px, batch 2: checkpoint-3 falls mid-epoch. Every random draw is exercised."""
    return base + ["--random_flip", "--use_ema", "--seed", "0", "--learning_rate", "1e-3", "--lr_warmup_steps", "2",
                   "--max_train_steps", "6", "--checkpointing_steps", "3", "--prediction_type", "v_prediction",
                   "--snr_gamma", "5", "--noise_offset", "0.1", "--input_perturbation", "0.1", "--max_grad_norm", "0.1",
                   *STABLE_ADAM]


@pytest.fixture(scope="module")
def reference(tmp_path_factory, common):
    out = tmp_path_factory.mktemp("t2i") / "ref"
    run_script(SCRIPT, common + ["--train_batch_size", "2", "--output_dir", out, "--report_to", "tensorboard",
                                 "--validation_prompts", *PROMPTS, "--validation_epochs", "1"])
    return out


def test_resume_is_exact(reference, common, tmp_path):
    out = tmp_path / "resumed"
    out.mkdir()
    shutil.copytree(reference / "checkpoint-3", out / "checkpoint-3")
    log = run_script(SCRIPT, common + ["--train_batch_size", "2", "--output_dir", out, "--resume_from_checkpoint", "latest"])
    assert f"Resuming from {out / 'checkpoint-3'}" in log
    for sub in ["unet", "unet_ema"]:
        assert_same_weights(unet_weights(out / "checkpoint-6" / sub), unet_weights(reference / "checkpoint-6" / sub))
    assert_same_optimizer_state(out / "checkpoint-6", reference / "checkpoint-6")


def test_two_processes_match_one_with_the_same_global_batch(reference, common, tmp_path):
    out = tmp_path / "ddp"
    run_script(SCRIPT, common + ["--train_batch_size", "1", "--output_dir", out], num_processes=2)
    assert checkpoints(out) == ["checkpoint-3", "checkpoint-6"]
    assert_same_weights(unet_weights(out / "unet"), unet_weights(reference / "unet"), **EQUIVALENT)


def test_only_the_unet_trains_and_the_output_is_a_full_pipeline(reference, tiny_sd_path):
    base, out = Path(tiny_sd_path), reference
    trained, original = unet_weights(out / "unet"), unet_weights(base / "unet")
    assert any(not torch.equal(trained[k], original[k]) for k in original)
    assert_same_weights(trained, unet_weights(reference / "checkpoint-6" / "unet_ema"), rtol=0)  # EMA weights saved
    # the optimizer holds exactly the UNet's parameters: the VAE and text encoder were never trained
    optimizer = torch.load(out / "checkpoint-6" / "optimizer.bin", weights_only=False)
    assert len(optimizer["param_groups"][0]["params"]) == len(original)
    for part in ["vae", "text_encoder"]:
        saved = next((out / part).glob("*.safetensors"))
        assert_same_weights(load_file(saved), load_file(base / part / saved.name), rtol=0, atol=0)
    assert json.loads((out / "scheduler" / "scheduler_config.json").read_text())["prediction_type"] == "v_prediction"
    generate(out)
    card = (out / "README.md").read_text()
    assert tiny_sd_path in card and "samples/step-6.png" in card


def test_validation_writes_a_grid_per_epoch(reference):
    # 20 images at batch 2: epoch 0 ends at step 10, after the limit of 6, so one grid, at the end
    grid = Image.open(reference / "samples" / "step-6.png")
    assert grid.size == (2 * 64 + 3 * 2, 64 + 2 * 2)  # two prompts side by side, 2 px padding
    assert list((reference / "logs").rglob("events.out.tfevents.*"))


def test_min_snr_weights_match_a_hand_computation(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO))
    from argparse import Namespace

    from diffusers import DDPMScheduler
    from train_text_to_image import snr_loss_weights

    scheduler = DDPMScheduler(beta_schedule="scaled_linear", beta_start=0.00085, beta_end=0.012)
    t = torch.tensor([0, 10, 500, 999])
    betas = torch.linspace(0.00085**0.5, 0.012**0.5, 1000, dtype=torch.float64) ** 2
    alpha_bar = torch.cumprod(1 - betas, 0)[t]
    snr = alpha_bar / (1 - alpha_bar)
    for prediction_type, expected in [("epsilon", snr.clamp(max=5) / snr), ("v_prediction", snr.clamp(max=5) / (snr + 1))]:
        scheduler.register_to_config(prediction_type=prediction_type)
        weights = snr_loss_weights(scheduler, t, Namespace(snr_gamma=5.0))
        torch.testing.assert_close(weights.double(), expected, rtol=1e-3, atol=0)  # float32 near t = 0
        assert prediction_type == "v_prediction" or weights[-1] == 1  # ε at high noise: SNR < γ, weight 1
        assert weights[0] < 0.01  # nearly clean: SNR ≈ 1000 is capped at γ = 5
    assert torch.equal(snr_loss_weights(scheduler, t, Namespace(snr_gamma=None)), torch.ones(4))


def test_checkpoint_contract_with_ema(base, tmp_path):
    out = tmp_path / "ema"
    run_script(SCRIPT, base + ["--train_batch_size", "1", "--output_dir", out, "--use_ema", "--max_train_steps", "6",
                               "--checkpointing_steps", "2", "--checkpoints_total_limit", "2"])
    assert checkpoints(out) == ["checkpoint-4", "checkpoint-6"]
    from diffusers import UNet2DConditionModel

    for sub in ["unet", "unet_ema"]:
        UNet2DConditionModel.from_pretrained(out / "checkpoint-6" / sub)
    generate(out)


def test_bf16_with_offloaded_ema_saves_the_frozen_parts_as_they_were(base, tiny_sd_path, tmp_path):
    out = tmp_path / "bf16"
    # --max_train_samples 4 at batch 2 makes an epoch of 2 steps, whatever the 20 rows of the folder
    log = run_script(SCRIPT, base + ["--train_batch_size", "2", "--output_dir", out, "--max_train_samples", "4",
                                     "--num_train_epochs", "1", "--checkpointing_steps", "1", "--seed", "0",
                                     "--mixed_precision", "bf16", "--use_ema", "--offload_ema", "--foreach_ema"])
    assert "4 images, 1 epochs, 2 steps" in log and checkpoints(out) == ["checkpoint-1", "checkpoint-2"]
    for part in ["vae", "text_encoder"]:  # trained beside bf16 copies, saved from the base model's fp32 files
        saved = next((out / part).glob("*.safetensors"))
        assert_same_weights(load_file(saved), load_file(Path(tiny_sd_path) / part / saved.name), rtol=0, atol=0)
    assert all(w.dtype == torch.float32 for w in unet_weights(out / "unet").values())
    generate(out)


@pytest.fixture(scope="module")
def list_caption_folder(tmp_path_factory):
    """Captions as lists of strings, one picked at random per step."""
    path = Path(write_imagefolder(tmp_path_factory.mktemp("lists"), 20))
    rows = [json.loads(line) for line in (path / "metadata.jsonl").read_text().splitlines()]
    (path / "metadata.jsonl").write_text("".join(json.dumps({**r, "text": [r["text"], "a digit"]}) + "\n" for r in rows))
    return str(path)


def test_checkpoint_contract_without_ema_and_list_captions(base, list_caption_folder, tmp_path):
    out = tmp_path / "plain"
    args = base + ["--train_data_dir", list_caption_folder, "--train_batch_size", "1", "--output_dir", out,
                   "--checkpointing_steps", "2"]
    run_script(SCRIPT, args + ["--max_train_steps", "4"])
    assert checkpoints(out) == ["checkpoint-2", "checkpoint-4"]
    assert not (out / "checkpoint-4" / "unet_ema").exists()
    run_script(SCRIPT, args + ["--max_train_steps", "8", "--resume_from_checkpoint", "checkpoint-4",
                               "--checkpoints_total_limit", "2"])
    assert checkpoints(out) == ["checkpoint-6", "checkpoint-8"]
    generate(out)


@pytest.mark.parametrize("flip", [False, True], ids=["no_flip", "flip"])
def test_cached_encodings_train_the_weights_of_an_uncached_run(flip, base, list_caption_folder, tmp_path):
    """--cache_latents --cache_text_embeddings: the VAE and text encoder run once per image before training (and not
    in the loop: 0 FLOPs there), and the same seed ends with the weights of a run that encodes every step: the same
    posterior noise, flip and caption draws. Captions are lists, each one cached; a subset of the images
    (--max_train_samples), which the join writes out once. Equal up to float reordering (the
    encoders see other batches), hence EQUIVALENT; a cache read in the wrong orientation moved them ~20% of the update."""
    args = base + ["--train_data_dir", list_caption_folder, "--max_train_samples", "16", "--center_crop", *(["--random_flip"] if flip else []),
                   "--seed", "0", "--train_batch_size", "2", "--max_train_steps", "4", "--learning_rate", "1e-3", "--checkpointing_steps", "100",
                   *STABLE_ADAM]
    cache, encodings = ["--cache_latents", "--cache_text_embeddings", "--cache_dir", tmp_path / "cache"], tmp_path / "cache" / "encodings"
    run_script(SCRIPT, args + ["--output_dir", tmp_path / "plain"])
    log = run_script(SCRIPT, args + cache + ["--output_dir", tmp_path / "cached"])
    assert "Encoding the training images once" in log and "Cached the encodings of 16 images" in log  # a subset: joined once
    assert re.search(r"frozen VAE and text encoder 0$", log, re.MULTILINE)
    plain, cached = unet_weights(tmp_path / "plain" / "unet"), unet_weights(tmp_path / "cached" / "unet")
    assert_same_weights(cached, plain, **EQUIVALENT)
    assert [p.name[-13:] for p in encodings.glob("*.arrow")] == ["-0-of-1.arrow"]
    from datasets import Dataset

    stored = Dataset.from_file(str(next(encodings.glob("*.arrow"))))
    assert sorted(stored.column_names) == ["latent_moments", "text_embeddings"]  # no copy of the data's own columns
    if flip:  # two processes: each encodes its half, then both read both halves
        run_script(SCRIPT, args + cache + ["--output_dir", tmp_path / "ddp", "--train_batch_size", "1"], num_processes=2)
        assert_same_weights(unet_weights(tmp_path / "ddp" / "unet"), plain, **EQUIVALENT)
        assert sorted(p.name[-13:] for p in encodings.glob("*-of-2.arrow")) == ["-0-of-2.arrow", "-1-of-2.arrow"]
    else:  # a second run on the same data, models and flags reads the cache back
        log = run_script(SCRIPT, args + cache + ["--output_dir", tmp_path / "again"])
        assert "Encoding the training images once" not in log
        assert_same_weights(unet_weights(tmp_path / "again" / "unet"), cached, rtol=0, atol=0)


def test_a_broken_image_met_while_caching_is_one_clear_error(base, corrupt_image_folder, tmp_path, run_in_process, monkeypatch):
    """Above FULL_IMAGE_CHECK nothing is decoded up front; --cache_latents decodes every image before training, and
    stops at a broken one by name, before anything is written to output_dir."""
    monkeypatch.syspath_prepend(str(REPO))
    import train_text_to_image

    monkeypatch.setattr(train_text_to_image, "FULL_IMAGE_CHECK", 0)  # as for a huge dataset
    log = run_in_process(SCRIPT, base + ["--train_data_dir", corrupt_image_folder, "--center_crop", "--cache_latents",
                                         "--cache_dir", tmp_path / "cache", "--output_dir", tmp_path / "out"])
    assert f"error: image {Path(corrupt_image_folder) / CORRUPT_FILE} cannot be read" in log
    assert "Steps:" not in log and not (tmp_path / "out").exists()


@pytest.fixture(scope="module")
def victim(tmp_path_factory, reference):
    """An output_dir with earlier work that no bad command may touch."""
    out = tmp_path_factory.mktemp("victim")
    shutil.copytree(reference / "checkpoint-3", out / "checkpoint-3")
    (out / "checkpoint-2" / "unet").mkdir(parents=True)  # written by another tool
    (out / "checkpoint-2" / "optimizer.bin").write_bytes(b"earlier work")
    (out / "not-a-checkpoint").mkdir()
    copy_without_ema(reference / "checkpoint-3", "unet_ema", out / "checkpoint-9")
    return out


@pytest.fixture(scope="module")
def sample_predicting_sd(tiny_sd_path, tmp_path_factory):
    path = tmp_path_factory.mktemp("sample_sd") / "sd"
    shutil.copytree(tiny_sd_path, path)
    config = path / "scheduler" / "scheduler_config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "prediction_type": "sample"}))
    return str(path)


@pytest.fixture(scope="module")
def number_caption_folder(tmp_path_factory):
    path = Path(write_imagefolder(tmp_path_factory.mktemp("numbers"), 3, columns=("label",)))
    rows = [json.loads(line) for line in (path / "metadata.jsonl").read_text().splitlines()]
    (path / "metadata.jsonl").write_text("".join(json.dumps({**r, "text": r["label"]}) + "\n" for r in rows))
    return str(path)


@pytest.mark.parametrize("case", ["not_a_pipeline", "no_such_model", "no_image_column", "no_caption_column", "caption_type", "corrupt",
                                  "resolution", "resume", "resume_missing", "resume_foreign", "sample_prediction", "fp16_on_cpu",
                                  "resume_adding_ema"])
def test_bad_input_is_one_clear_error(case, victim, base, tmp_path, caption_folder, nocaption_folder, run_in_process,
                                      corrupt_image_folder, number_caption_folder, sample_predicting_sd):
    extra, expected = {
        "not_a_pipeline": (["--pretrained_model_name_or_path", caption_folder], "is not a Stable Diffusion pipeline: no model_index.json"),
        "no_such_model": (["--pretrained_model_name_or_path", str(tmp_path / "nowhere")], "nowhere is not a folder"),
        "no_image_column": (["--image_column", "img"], "--image_column 'img' is not in the dataset; its columns are ['image', 'text', 'label']"),
        "no_caption_column": (["--train_data_dir", nocaption_folder], "has no caption: add a metadata.jsonl with a 'text' column, a caption file beside each image"),
        "caption_type": (["--train_data_dir", number_caption_folder], "--caption_column 'text' row 0 is 0: give a string or a list of strings"),
        "corrupt": (["--train_data_dir", corrupt_image_folder], CORRUPT_FILE),
        "resolution": (["--resolution", "60"], "--resolution 60 must be a multiple of 8, the VAE's downsampling factor"),
        "resume": (["--resume_from_checkpoint", "not-a-checkpoint"], "is not a checkpoint-N folder"),
        "resume_missing": (["--resume_from_checkpoint", "checkpoint-4"], "checkpoint-4 does not exist"),
        "resume_foreign": (["--resume_from_checkpoint", "checkpoint-2"], "checkpoint-2 is not a checkpoint-N folder written by train_text_to_image.py"),
        "sample_prediction": (["--pretrained_model_name_or_path", sample_predicting_sd],
                              "the base scheduler predicts 'sample': give --prediction_type epsilon or v_prediction"),
        "fp16_on_cpu": (["--mixed_precision", "fp16"], "--mixed_precision fp16 needs a GPU; on a CPU use bf16 or no"),
        "resume_adding_ema": (["--resume_from_checkpoint", "checkpoint-9", "--train_batch_size", "2", "--use_ema"],
                              f"checkpoint-9 {NO_EMA}"),
    }[case]
    before = snapshot(victim)
    log = run_in_process(SCRIPT, base + ["--output_dir", victim, *extra])
    assert expected in log
    assert "Steps:" not in log
    assert snapshot(victim) == before


@pytest.mark.parametrize("argv, expected", [
    (["--train_data_dir", "x"], "give the base model: --pretrained_model_name_or_path"),
    (["--pretrained_model_name_or_path", "x"], "give a dataset: --dataset_name or --train_data_dir"),
    (["--pretrained_model_name_or_path", "x", "--train_data_dir", "x", "--prediction_type", "sample"],
     "argument --prediction_type: invalid choice: 'sample'"),
    (["--pretrained_model_name_or_path", "x", "--train_data_dir", "x", "--report_to", "wandb", "--hub_token", "t"],
     "--hub_token with --report_to wandb would"),
    (["--pretrained_model_name_or_path", "x", "--train_data_dir", "x", "--cache_latents"], "--cache_latents needs --center_crop"),
])
def test_bad_flags_are_rejected_by_the_parser(argv, expected, capsys, monkeypatch):
    monkeypatch.syspath_prepend(str(REPO))
    from train_text_to_image import parse_args

    with pytest.raises(SystemExit) as exit:
        parse_args(argv)
    assert exit.value.code == 2 and expected in capsys.readouterr().err


# ----------------------------------------------------------------------------- real launches


def test_deepspeed_zero2_matches_one_process_and_resumes(reference, common, tmp_path):
    out = tmp_path / "zero2"
    log = run_script(SCRIPT, common + ["--train_batch_size", "1", "--output_dir", out], num_processes=2, launch_args=zero(2))
    assert "DeepSpeed clips gradients at norm 0.1" in log
    for sub in ["checkpoint-6/unet_ema", "unet"]:
        assert_same_weights(unet_weights(out / sub), unet_weights(reference / sub), **EQUIVALENT)
    generate(assert_resumes_exactly(SCRIPT, common + ["--train_batch_size", "1"], out, "checkpoint-3", num_processes=2,
                                    launch_args=zero(2)))


def test_deepspeed_zero3_trains_validates_resumes_and_saves_a_pipeline(reference, common, tmp_path):
    no_ema = [a for a in common if a != "--use_ema"]
    out = tmp_path / "zero3"
    run_script(SCRIPT, no_ema + ["--train_batch_size", "1", "--output_dir", out, "--validation_prompts", PROMPTS[0]],
               num_processes=2, launch_args=zero(3))
    assert_same_weights(unet_weights(out / "unet"), unet_weights(reference / "checkpoint-6" / "unet"), **EQUIVALENT)
    assert (out / "samples" / "step-6.png").is_file()  # validation with the UNet in shards, on both processes
    generate(assert_resumes_exactly(SCRIPT, no_ema + ["--train_batch_size", "1"], out, "checkpoint-3", num_processes=2,
                                    launch_args=zero(3)))


# ----------------------------------------------------------------------------- the Diffusers example's commands


def test_the_diffusers_readme_command_runs_unchanged_and_dream_changes_training(tiny_sd_path, caption_folder, tmp_path):
    """The example README's command, flag for flag, with our paths, 64 px and 2 steps (fp16 needs a GPU: `no` here).
    `--dataset_name imagefolder --train_data_dir DIR` is how the example loads a local folder through `datasets`."""
    def readme(out):
        return (f"--pretrained_model_name_or_path={tiny_sd_path} --dataset_name=imagefolder --train_data_dir={caption_folder} "
                f"--use_ema --resolution=64 --center_crop --random_flip --train_batch_size=1 --gradient_accumulation_steps=4 "
                f"--gradient_checkpointing --max_train_steps=2 --learning_rate=1e-05 --max_grad_norm=1 "
                f"--enable_xformers_memory_efficient_attention --lr_scheduler=constant --lr_warmup_steps=0 --output_dir={out} "
                f"--seed=0 --snr_gamma=5.0 --image_interpolation_mode=nearest_exact --non_ema_revision=main --local_rank=0").split()

    log = run_script(SCRIPT, readme(tmp_path / "plain"))
    assert "xformers is not installed" in log
    run_script(SCRIPT, readme(tmp_path / "dream") + ["--dream_training", "--dream_detail_preservation=1.0"])
    plain, dream = unet_weights(tmp_path / "plain" / "unet"), unet_weights(tmp_path / "dream" / "unet")
    assert any(not torch.equal(plain[k], dream[k]) for k in plain)  # DREAM moved input and target
    # the model card's command reruns the training: the same weights again
    card = (tmp_path / "plain" / "README.md").read_text()
    command = shlex.split(card.split("```bash\n")[1].split("\n")[0])
    assert command[:3] == ["accelerate", "launch", "train_text_to_image.py"]
    rerun = [a if not a.startswith("--output_dir=") else f"--output_dir={tmp_path / 'rerun'}" for a in command[3:]]
    run_script(SCRIPT, rerun)
    assert_same_weights(unet_weights(tmp_path / "rerun" / "unet"), plain, rtol=0, atol=0)


def test_dream_with_v_prediction_is_refused(base, tmp_path, run_in_process):
    log = run_in_process(SCRIPT, base + ["--output_dir", tmp_path / "out", "--prediction_type", "v_prediction", "--dream_training"])
    assert "error: --dream_training needs epsilon prediction" in log and "Steps:" not in log


@pytest.mark.parametrize("script", ["train_text_to_image", "train_lora"])
def test_captions_come_from_the_instance_prompt_else_metadata_else_caption_files(script, caption_folder, tiny_sd_path, tmp_path,
                                                                                  monkeypatch):
    """The two scripts read data alike: one --instance_prompt for every image, else metadata.jsonl, else a .txt beside
    each image (kohya's layout)."""
    monkeypatch.syspath_prepend(str(REPO))
    from datasets import Image as ImageFeature
    from transformers import CLIPTokenizer

    from accelerate import PartialState

    module = __import__(script)
    PartialState()  # the scripts log through accelerate
    both, files_only = tmp_path / "both", tmp_path / "files_only"
    for folder in (both, files_only):
        shutil.copytree(caption_folder, folder)
        for i, png in enumerate(sorted(folder.glob("*.png"))):  # every other one with a byte-order mark, as Windows editors may save
            png.with_suffix(".caption").write_text(f"file caption {png.stem}\n", encoding="utf-8-sig" if i % 2 else "utf-8")
    (files_only / "metadata.jsonl").unlink()

    def captions(folder, *flags):
        args = module.parse_args(["--pretrained_model_name_or_path", tiny_sd_path, "--train_data_dir", str(folder),
                                  "--caption_extension", ".caption", "--seed", "0", *flags])
        dataset = module.load_train_dataset(args).cast_column("image", ImageFeature(decode=False))
        return args, module.add_captions(dataset, args)

    _, dataset = captions(both)
    expected = [json.loads(line)["text"] for line in (both / "metadata.jsonl").read_text().splitlines()]
    assert sorted(dataset["text"]) == sorted(expected)
    _, dataset = captions(files_only)
    assert dataset["text"] == [f"file caption {Path(item['path']).stem}" for item in dataset["image"]]

    args, dataset = captions(both, "--instance_prompt", "a photo of sks digit")
    dataset = dataset.add_column(module.ROW, np.arange(len(dataset)))
    tokenizer = CLIPTokenizer.from_pretrained(tiny_sd_path, subfolder="tokenizer")
    from torchvision import transforms

    to_tensor = transforms.Compose([transforms.Resize(64), transforms.CenterCrop(64), transforms.ToTensor()])
    batch = module.preprocess_train(dataset[:3], args, to_tensor, tokenizer, 1000, (4, 8, 8), (77, 32), torch.float32, epoch=0)
    prompt_ids = tokenizer("a photo of sks digit", max_length=77, padding="max_length", return_tensors="pt").input_ids[0]
    assert all(torch.equal(ids, prompt_ids) for ids in batch["input_ids"])

