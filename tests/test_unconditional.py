"""train_unconditional.py: the checkpoint contract, exact resume, equivalent runs, EMA, output, FLOPs, bad input."""
import re
import shutil
from argparse import Namespace
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import (CORRUPT_FILE, EQUIVALENT, NO_EMA, REPO, STABLE_ADAM, assert_resumes_exactly, assert_same_optimizer_state,
                      assert_same_weights, checkpoints, copy_without_ema, run_script, seed_logged, snapshot, truncate,
                      unet_weights, write_imagefolder, zero)
from PIL import Image

SCRIPT = "train_unconditional.py"


@pytest.fixture(scope="module")
def common(label_folder, tiny_unet_config_path):
    """6 images at 32 px; random crop and flip; 3 steps per epoch at batch 2; cosine schedule with warmup."""
    return ["--train_data_dir", label_folder, "--model_config_name_or_path", tiny_unet_config_path,
            "--resolution", "32", "--random_flip", "--use_ema", "--seed", "0", "--learning_rate", "1e-3",
            "--lr_warmup_steps", "2", "--max_train_steps", "8", "--checkpointing_steps", "4",
            "--ddpm_num_inference_steps", "2", "--eval_batch_size", "2", "--save_images_epochs", "100",
            "--save_model_epochs", "100", "--max_grad_norm", "0.1", *STABLE_ADAM]  # grad norms are ~1: clipping acts


@pytest.fixture(scope="module")
def reference(tmp_path_factory, common):
    """One uninterrupted run: checkpoint-4 falls one batch into the second epoch."""
    out = tmp_path_factory.mktemp("uncond") / "ref"
    run_script(SCRIPT, common + ["--train_batch_size", "2", "--output_dir", out])
    return out


def test_resume_is_exact_and_ignores_partial_checkpoints(reference, common, tmp_path):
    out = tmp_path / "resumed"
    out.mkdir()
    shutil.copytree(reference / "checkpoint-4", out / "checkpoint-4")
    # a save that crashed halfway leaves only its temporary folder, which `latest` must not pick
    (out / "tmp-checkpoint-8" / "unet").mkdir(parents=True)
    log = run_script(SCRIPT, common + ["--train_batch_size", "2", "--output_dir", out, "--resume_from_checkpoint", "latest"])
    assert f"Resuming from {out / 'checkpoint-4'}" in log
    assert checkpoints(out) == ["checkpoint-4", "checkpoint-8"] and not (out / "tmp-checkpoint-8").exists()
    for sub in ["unet", "unet_ema"]:
        assert_same_weights(unet_weights(out / "checkpoint-8" / sub), unet_weights(reference / "checkpoint-8" / sub))
    assert_same_weights(unet_weights(out / "unet"), unet_weights(reference / "unet"))
    assert_same_optimizer_state(out / "checkpoint-8", reference / "checkpoint-8")


def test_ema_is_saved_and_differs_from_raw_weights(reference):
    raw, ema = unet_weights(reference / "checkpoint-8" / "unet"), unet_weights(reference / "checkpoint-8" / "unet_ema")
    assert any(not torch.equal(raw[k], ema[k]) for k in raw)
    assert_same_weights(unet_weights(reference / "unet"), ema, rtol=0)  # the final pipeline holds the EMA weights


def test_final_pipeline_loads_and_samples_and_validation_grids_exist(reference):
    from diffusers import DDPMPipeline

    pipe = DDPMPipeline.from_pretrained(reference)
    images = pipe(batch_size=1, num_inference_steps=2, generator=torch.manual_seed(0), output_type="np").images
    assert images.shape == (1, 32, 32, 3) and np.isfinite(images).all()
    # validation at the first epoch (step 3) and at the end (step 8): 2 samples side by side
    for step in [3, 8]:
        grid = Image.open(reference / "samples" / f"step-{step}.png")
        assert grid.width > 2 * 32 and grid.height >= 32
    assert list((reference / "logs").rglob("events.out.tfevents.*"))


def test_two_processes_match_one_with_the_same_global_batch(reference, common, tmp_path):
    out = tmp_path / "ddp"
    run_script(SCRIPT, common + ["--train_batch_size", "1", "--output_dir", out, "--checkpoints_total_limit", "1"],
               num_processes=2)
    assert checkpoints(out) == ["checkpoint-8"]  # rotation ran once, on the main process only
    assert {p.name for p in (out / "checkpoint-8").glob("random_states_*")} == {"random_states_0.pkl", "random_states_1.pkl"}
    assert_same_weights(unet_weights(out / "unet"), unet_weights(reference / "unet"), **EQUIVALENT)


def test_gradient_accumulation_matches_the_full_batch(reference, common, tmp_path):
    out = tmp_path / "accum"
    run_script(SCRIPT, common + ["--train_batch_size", "1", "--gradient_accumulation_steps", "2", "--output_dir", out])
    assert_same_weights(unet_weights(out / "unet"), unet_weights(reference / "unet"), **EQUIVALENT)


def test_checkpoint_contract(plain_image_folder, tiny_unet_config_path, tmp_path):
    out = tmp_path / "contract"
    args = ["--train_data_dir", plain_image_folder, "--model_config_name_or_path", tiny_unet_config_path,
            "--resolution", "32", "--train_batch_size", "1", "--output_dir", out, "--ddpm_num_inference_steps", "1",
            "--eval_batch_size", "1", "--report_to", "none"]
    run_script(SCRIPT, args + ["--num_epochs", "1", "--checkpointing_steps", "2"])
    assert checkpoints(out) == ["checkpoint-2", "checkpoint-4", "checkpoint-6"]
    assert (out / "checkpoint-2" / "unet" / "config.json").is_file()
    # a resumed run whose step limit is already reached still trains one step and saves on schedule
    log = run_script(SCRIPT, args + ["--max_train_steps", "4", "--resume_from_checkpoint", "checkpoint-4",
                                     "--checkpointing_steps", "5"])
    assert "Resuming from" in log and f"Saved state to {out / 'checkpoint-5'}" in log
    assert checkpoints(out) == ["checkpoint-2", "checkpoint-4", "checkpoint-5", "checkpoint-6"]
    # the limit also removes the excess left by the runs without one
    run_script(SCRIPT, args + ["--num_epochs", "2", "--resume_from_checkpoint", "checkpoint-6",
                               "--checkpoints_total_limit", "2", "--checkpointing_steps", "2"])
    assert checkpoints(out) == ["checkpoint-10", "checkpoint-12"]


@pytest.fixture(scope="module")
def victim(reference, tmp_path_factory):
    """An output_dir with a checkpoint that no bad command may touch."""
    out = tmp_path_factory.mktemp("victim")
    shutil.copytree(reference / "checkpoint-4", out / "checkpoint-4")
    shutil.copytree(reference / "checkpoint-4", out / "checkpoint-6")  # an interrupted copy: one file cut short
    truncate(out / "checkpoint-6" / "unet" / "diffusion_pytorch_model.safetensors")
    (out / "checkpoint-7").mkdir()  # written by some other tool
    (out / "not-a-checkpoint").mkdir()
    copy_without_ema(reference / "checkpoint-4", "unet_ema", out / "checkpoint-9")
    return out


@pytest.fixture(scope="module")
def truncated_jpeg_folder(tmp_path_factory):
    """A JPEG cut in half: Image.verify() passes it, decoding it fails."""
    path = Path(write_imagefolder(tmp_path_factory.mktemp("truncated"), 6, columns=("label",)))
    Image.open(path / "0002.png").save(path / "0002.jpg", quality=95)
    (path / "0002.png").unlink()
    meta = (path / "metadata.jsonl").read_text().replace("0002.png", "0002.jpg")
    (path / "metadata.jsonl").write_text(meta)
    truncate(path / "0002.jpg")
    return str(path)


@pytest.mark.parametrize("case", ["empty", "no_such_dir", "column", "corrupt", "truncated_jpeg", "resume", "resume_missing",
                                  "resume_damaged", "resume_foreign", "resume_seed", "resume_launch", "resolution", "resume_adding_ema"])
def test_bad_input_is_one_clear_error(case, victim, tiny_unet_config_path, label_folder, empty_folder, run_in_process,
                                      corrupt_image_folder, truncated_jpeg_folder):
    data = {"empty": empty_folder, "no_such_dir": str(victim / "nowhere"), "corrupt": corrupt_image_folder,
            "truncated_jpeg": truncated_jpeg_folder}
    extra, expected = {
        "empty": ([], "--train_data_dir"),
        "no_such_dir": ([], "is not a folder"),
        "column": (["--image_column", "img"], "--image_column 'img' is not in the dataset; its columns are ['image', 'label']"),
        "corrupt": ([], CORRUPT_FILE),
        "truncated_jpeg": ([], "image " + str(Path(truncated_jpeg_folder) / "0002.jpg") + " cannot be read"),
        "resume": (["--resume_from_checkpoint", "not-a-checkpoint"], "is not a checkpoint-N folder"),
        "resume_missing": (["--resume_from_checkpoint", "checkpoint-5"], "checkpoint-5 does not exist"),
        "resume_damaged": (["--resume_from_checkpoint", "checkpoint-6"],
                           "checkpoint-6 is incomplete: unet/diffusion_pytorch_model.safetensors is missing or not the"),
        "resume_foreign": (["--resume_from_checkpoint", "checkpoint-7"], "checkpoint-7 is not a checkpoint-N folder written by train_unconditional.py"),
        "resume_seed": (["--resume_from_checkpoint", "checkpoint-4", "--seed", "1"], "--seed 1 differs from the seed 0 of"),
        "resume_launch": (["--resume_from_checkpoint", "checkpoint-4", "--train_batch_size", "3"], "resume with the same images per step"),
        "resolution": (["--resolution", "33"], "--resolution 33 must be a multiple of 2"),
        "resume_adding_ema": (["--resume_from_checkpoint", "checkpoint-9", "--train_batch_size", "2", "--use_ema"],
                              f"checkpoint-9 {NO_EMA}"),
    }[case]
    before = snapshot(victim)
    log = run_in_process(SCRIPT, ["--train_data_dir", data.get(case, label_folder), "--model_config_name_or_path",
                                  tiny_unet_config_path, "--resolution", "32", "--output_dir", victim, *extra])
    assert expected in log
    assert "Steps:" not in log  # failed before training started
    assert snapshot(victim) == before


@pytest.mark.parametrize("argv, expected", [
    ([], "give a dataset: --dataset_name or --train_data_dir"),
    (["--train_data_dir", "x", "--lr_scheduler", "wavy"], "argument --lr_scheduler: invalid choice: 'wavy'"),
    (["--train_data_dir", "x", "--prediction_type", "v"], "argument --prediction_type: invalid choice: 'v'"),
    (["--train_data_dir", "x", "--ddpm_beta_schedule", "cubic"], "argument --ddpm_beta_schedule: invalid choice: 'cubic'"),
    (["--train_data_dir", "x", "--report_to", "wandb", "--hub_token", "t"], "--hub_token with --report_to wandb would"),
])
def test_bad_flags_are_rejected_by_the_parser(argv, expected, capsys, monkeypatch):
    monkeypatch.syspath_prepend(str(REPO))
    train_unconditional = __import__("train_unconditional")
    with pytest.raises(SystemExit) as exit:
        train_unconditional.parse_args(argv)
    assert exit.value.code == 2 and expected in capsys.readouterr().err


def test_the_examples_other_spellings_parse(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO))
    from train_unconditional import parse_args

    args = parse_args(["--train_data_dir", "x", "--local-rank=1", "--report_to", "mlflow", "--hub_private_repo"])
    assert args.local_rank == 1 and args.report_to == "mlflow" and args.hub_private_repo
    assert parse_args(["--train_data_dir", "x", "--local_rank", "0"]).local_rank == 0


def test_sample_prediction_is_weighted_by_snr_capped_at_gamma(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO))
    from argparse import Namespace

    from diffusers import DDPMScheduler
    from train_unconditional import snr_loss_weights

    scheduler, t = DDPMScheduler(), torch.tensor([0, 300, 999])  # linear betas 1e-4 .. 0.02
    alpha_bar = torch.cumprod(1 - torch.linspace(1e-4, 0.02, 1000, dtype=torch.float64), 0)[t]
    snr = alpha_bar / (1 - alpha_bar)
    weights = snr_loss_weights(scheduler, t, Namespace(prediction_type="sample", snr_gamma=5.0)).double()
    torch.testing.assert_close(weights, snr.clamp(max=5), rtol=1e-3, atol=0)
    weights = snr_loss_weights(scheduler, t, Namespace(prediction_type="epsilon", snr_gamma=5.0)).double()
    torch.testing.assert_close(weights, snr.clamp(max=5) / snr, rtol=1e-3, atol=0)
    assert torch.equal(snr_loss_weights(scheduler, t, Namespace(prediction_type="epsilon", snr_gamma=None)), torch.ones(3))


# ----------------------------------------------------------------------------- real launches


def test_resume_under_another_split_of_the_same_batch(reference, common, tmp_path):
    """checkpoint-4 of 1 process x batch 2, resumed on 2 processes x batch 1: the same images per step."""
    out = tmp_path / "split"
    shutil.copytree(reference / "checkpoint-4", out / "checkpoint-4")
    run_script(SCRIPT, common + ["--train_batch_size", "1", "--output_dir", out, "--resume_from_checkpoint", "latest"],
               num_processes=2)
    assert_same_weights(unet_weights(out / "unet"), unet_weights(reference / "unet"), **EQUIVALENT)


def test_unseeded_run_logs_its_seed_and_resumes_exactly(common, tmp_path):
    unseeded = [a for i, a in enumerate(common) if "--seed" not in common[max(i - 1, 0):i + 1]]
    first = tmp_path / "unseeded"
    seed = seed_logged(run_script(SCRIPT, unseeded + ["--train_batch_size", "2", "--output_dir", first,
                                                      "--validation_steps", "2"]))
    assert [p.name for p in sorted((first / "samples").iterdir())] == ["step-2.png", "step-3.png", "step-4.png",
                                                                       "step-6.png", "step-8.png"]
    stopped = tmp_path / "stopped"  # as if the run had stopped after checkpoint-4
    shutil.copytree(first / "checkpoint-4", stopped / "checkpoint-4")
    log = run_script(SCRIPT, unseeded + ["--train_batch_size", "2", "--output_dir", stopped, "--resume_from_checkpoint", "latest"])
    assert seed_logged(log) == seed  # the stored seed, not a new draw
    seeded = tmp_path / "seeded"
    run_script(SCRIPT, unseeded + ["--train_batch_size", "2", "--output_dir", seeded, "--seed", seed])
    for out in [first, stopped]:
        for sub in ["unet", "unet_ema"]:
            assert_same_weights(unet_weights(out / "checkpoint-8" / sub), unet_weights(seeded / "checkpoint-8" / sub))


def test_deepspeed_zero2_matches_one_process_clips_and_resumes(reference, common, tmp_path):
    out = tmp_path / "zero2"
    log = run_script(SCRIPT, common + ["--train_batch_size", "1", "--output_dir", out], num_processes=2, launch_args=zero(2))
    assert "DeepSpeed clips gradients at norm 0.1" in log  # --max_grad_norm reached DeepSpeed's own clipping
    assert checkpoints(out) == ["checkpoint-4", "checkpoint-8"]
    # the same schedule, clipping and EMA as one process with the same global batch
    assert_same_weights(unet_weights(out / "checkpoint-8" / "unet_ema"), unet_weights(reference / "checkpoint-8" / "unet_ema"), **EQUIVALENT)
    assert_same_weights(unet_weights(out / "unet"), unet_weights(reference / "unet"), **EQUIVALENT)
    assert_resumes_exactly(SCRIPT, common + ["--train_batch_size", "1"], out, "checkpoint-4", num_processes=2, launch_args=zero(2))


def test_deepspeed_zero3_trains_validates_resumes_and_saves_whole(reference, common, tmp_path):
    from diffusers import DDPMPipeline

    no_ema = [a for a in common if a != "--use_ema"]  # refused under ZeRO-3 (tested below)
    out = tmp_path / "zero3"
    run_script(SCRIPT, no_ema + ["--train_batch_size", "1", "--output_dir", out], num_processes=2, launch_args=zero(3))
    # the gathered final weights equal the raw weights of the one-process run (its pipeline holds the EMA)
    assert_same_weights(unet_weights(out / "unet"), unet_weights(reference / "checkpoint-8" / "unet"), **EQUIVALENT)
    assert (out / "samples" / "step-3.png").is_file()  # validation ran with the model in shards, on both processes
    pipe = DDPMPipeline.from_pretrained(out)
    assert np.isfinite(pipe(batch_size=1, num_inference_steps=2, output_type="np").images).all()
    assert_resumes_exactly(SCRIPT, no_ema + ["--train_batch_size", "1"], out, "checkpoint-4", num_processes=2, launch_args=zero(3))


def test_deepspeed_bf16_feeds_the_model_its_own_dtype(label_folder, tiny_unet_config_path, tmp_path):
    """DeepSpeed casts the UNet to bf16 and adds no autocast: fp32 inputs would fail in its first layer."""
    out = tmp_path / "bf16"
    run_script(SCRIPT, ["--train_data_dir", label_folder, "--model_config_name_or_path", tiny_unet_config_path,
                        "--resolution", "32", "--output_dir", out, "--train_batch_size", "1", "--max_train_steps", "2",
                        "--ddpm_num_inference_steps", "2", "--eval_batch_size", "2", "--report_to", "none"],
               num_processes=2, launch_args=[*zero(2), "--mixed_precision", "bf16"])
    assert (out / "samples" / "step-2.png").is_file()
    assert {w.dtype for w in unet_weights(out / "unet").values()} == {torch.bfloat16}  # DeepSpeed's module, as trained


@pytest.mark.parametrize("launch, extra, expected", [
    (zero(3), ["--use_ema"], "--use_ema needs whole weights on each process"),
    (zero(2)[:-1] + ["3"], [], "with `accelerate launch --zero3_save_16bit_model true`"),
])
def test_zero3_refuses_what_it_cannot_do(launch, extra, expected, label_folder, tiny_unet_config_path, tmp_path):
    log = run_script(SCRIPT, ["--train_data_dir", label_folder, "--model_config_name_or_path", tiny_unet_config_path,
                              "--resolution", "32", "--output_dir", tmp_path / "out", *extra],
                     num_processes=2, launch_args=launch, expect_fail=True)
    assert expected in log and "Steps:" not in log


@pytest.mark.parametrize("regional", [False, True])
def test_compiled_model_resumes_and_saves_plain_weights(regional, reference, common, tmp_path):
    out = tmp_path / "compiled"
    shutil.copytree(reference / "checkpoint-4", out / "checkpoint-4")
    launch = ["--dynamo_backend", "eager"] + (["--dynamo_use_regional_compilation"] if regional else [])
    log = run_script(SCRIPT, common + ["--train_batch_size", "2", "--output_dir", out, "--resume_from_checkpoint", "latest"],
                     launch_args=launch)
    assert "The model is compiled with torch.compile (eager)" in log
    # same keys (no `_orig_mod.` anywhere) and same values as the uncompiled run
    for sub in ["checkpoint-8/unet", "checkpoint-8/unet_ema", "unet"]:
        assert_same_weights(unet_weights(out / sub), unet_weights(reference / sub))


def test_spawned_dataloader_workers_pickle_the_transform(reference, common, tmp_path):
    site = tmp_path / "site"  # every Python process of the run starts its workers with spawn, as on macOS
    site.mkdir()
    (site / "sitecustomize.py").write_text("import multiprocessing\nmultiprocessing.set_start_method('spawn', force=True)\n")
    out = tmp_path / "workers"
    run_script(SCRIPT, common + ["--train_batch_size", "2", "--output_dir", out, "--dataloader_num_workers", "1"],
               env={"PYTHONPATH": str(site)})
    assert_same_weights(unet_weights(out / "checkpoint-8" / "unet"), unet_weights(reference / "checkpoint-8" / "unet"))


def test_a_broken_image_found_while_training_names_the_file_and_the_checkpoint(truncated_jpeg_folder, tiny_unet_config_path, tmp_path):
    """Above FULL_IMAGE_CHECK images nothing is decoded up front: the transform finds the file as it loads."""
    launcher = tmp_path / "large_dataset.py"  # the script with the cutoff lowered to 0, as for a huge dataset
    launcher.write_text(f"import sys\nsys.path.insert(0, {str(REPO)!r})\nimport train_unconditional as script\n"
                        "script.FULL_IMAGE_CHECK = 0\nscript.main(script.parse_args())\n")
    out = tmp_path / "out"
    log = run_script(launcher, ["--train_data_dir", truncated_jpeg_folder, "--model_config_name_or_path", tiny_unet_config_path,
                                "--resolution", "32", "--output_dir", out, "--train_batch_size", "1", "--checkpointing_steps", "1",
                                "--seed", "1", "--report_to", "none"], expect_fail=True)  # seed 1: the file comes third
    assert "Steps:" in log and checkpoints(out)  # it trained until it met the broken file
    assert f"error: image {Path(truncated_jpeg_folder) / '0002.jpg'} cannot be read; fix or remove it and resume from {checkpoints(out)[-1]}" in log


def test_a_dataset_with_its_own_row_column_trains(tiny_unet_config_path, tmp_path):
    data = Path(write_imagefolder(tmp_path / "data", 4, columns=("label",)))
    rows = (data / "metadata.jsonl").read_text().splitlines()
    (data / "metadata.jsonl").write_text("".join(r[:-1] + f', "row": "r{i}"}}\n' for i, r in enumerate(rows)))
    run_script(SCRIPT, ["--train_data_dir", data, "--model_config_name_or_path", tiny_unet_config_path, "--resolution", "32",
                        "--output_dir", tmp_path / "out", "--max_train_steps", "1", "--ddpm_num_inference_steps", "1",
                        "--eval_batch_size", "1", "--report_to", "none"])


def test_a_one_channel_unet_trains_on_grey_images_and_validates_with_ddim(label_folder, tiny_unet_config_path, tmp_path):
    import json

    from diffusers import DDPMPipeline

    config = tmp_path / "grey"
    config.mkdir()
    (config / "config.json").write_text(json.dumps({**json.loads((Path(tiny_unet_config_path) / "config.json").read_text()),
                                                   "in_channels": 1, "out_channels": 1}))
    out = tmp_path / "out"
    run_script(SCRIPT, ["--train_data_dir", label_folder, "--model_config_name_or_path", config, "--resolution", "32",
                        "--output_dir", out, "--max_train_steps", "2", "--validation_sampler", "ddim",
                        "--validation_inference_steps", "2", "--eval_batch_size", "4", "--report_to", "none"])
    images = DDPMPipeline.from_pretrained(out)(batch_size=1, num_inference_steps=2, output_type="np").images
    assert images.shape == (1, 32, 32, 1)
    grid = Image.open(out / "samples" / "step-2.png")  # 2 x 2 samples, each enlarged to 64 px without blur
    assert grid.size == (2 * 64 + 3 * 2, 2 * 64 + 3 * 2)
    cell = np.asarray(grid.convert("L"))[2:66, 2:66]
    assert (cell[::2, ::2] == cell[1::2, 1::2]).all()  # nearest: each pixel became a 2 x 2 block


# ----------------------------------------------------------------------------- the Diffusers example's commands


def test_the_diffusers_readme_command_runs_unchanged(label_folder, tiny_unet_config_path, tmp_path):
    """The example README's flowers command, flag for flag (`=` spelling included); only the paths are ours, a tiny
    model and a step limit added. Its `--push_to_hub` fails clearly offline, before training (next test)."""
    readme = (f'--dataset_name={label_folder} --resolution=64 --center_crop --random_flip --output_dir={tmp_path / "ddpm-ema-flowers-64"} '
              "--train_batch_size=16 --num_epochs=100 --gradient_accumulation_steps=1 --use_ema --learning_rate=1e-4 "
              "--lr_warmup_steps=500 --mixed_precision=no").split()
    extra = ["--model_config_name_or_path", tiny_unet_config_path, "--max_train_steps", "2", "--ddpm_num_inference_steps", "1",
             "--eval_batch_size", "1", "--enable_xformers_memory_efficient_attention", "--overwrite_output_dir",
             "--logger", "tensorboard", "--local-rank=0"]
    log = run_script(SCRIPT, readme + extra)
    assert "xformers is not installed: PyTorch's scaled-dot-product attention, the default, is used" in log
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(next((tmp_path / "ddpm-ema-flowers-64" / "logs").iterdir()))).Reload()
    assert "loss" in events.Tags()["scalars"] and "test_samples" in events.Tags()["images"]  # the example's names


def test_flops_are_counted_at_the_first_step_and_utilisation_is_logged(label_folder, tiny_unet_config_path, tmp_path):
    """torch's FlopCounterMode counts one micro-batch's forward and backward at the first step; every step logs
    TFLOP/s and, against --peak_tflops, MFU. Gradient checkpointing runs each block's forward again: counted too."""
    from diffusers import UNet2DModel
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from torch.utils.flop_counter import FlopCounterMode

    args = ["--train_data_dir", label_folder, "--model_config_name_or_path", tiny_unet_config_path, "--resolution", "32",
            "--train_batch_size", "2", "--max_train_steps", "3", "--save_images_epochs", "100", "--save_model_epochs", "100",
            "--ddpm_num_inference_steps", "1", "--eval_batch_size", "1", "--logger", "tensorboard", "--peak_tflops", "0.5"]
    counted = []
    for extra in ([], ["--gradient_checkpointing"]):
        log = run_script(SCRIPT, args + extra + ["--output_dir", tmp_path / f"run{len(counted)}"])
        counted.append(float(re.search(r"One micro-batch of 2 images: UNet forward and backward (\S+) FLOPs", log).group(1)))
    model = UNet2DModel.from_config(UNet2DModel.load_config(tiny_unet_config_path))
    with FlopCounterMode(display=False) as counter:  # the forward alone, counted here on its own
        model(torch.randn(2, model.config.in_channels, 32, 32), torch.tensor([1, 2]))
    forward, (plain, checkpointed) = counter.get_total_flops(), counted
    assert 2 * forward < plain <= 3 * forward  # the backward costs about twice the forward
    assert plain < checkpointed < plain + forward
    events = EventAccumulator(str(next((tmp_path / "run0" / "logs").iterdir()))).Reload()
    tflops, mfu = ([event.value for event in events.Scalars(tag)] for tag in ("tflops", "mfu"))
    assert len(tflops) == 3 and min(tflops) > 0
    np.testing.assert_allclose(mfu, np.array(tflops) / 0.5, rtol=1e-6)


def test_push_to_hub_offline_fails_before_training(label_folder, tiny_unet_config_path, tmp_path, run_in_process):
    log = run_in_process(SCRIPT, ["--train_data_dir", label_folder, "--model_config_name_or_path", tiny_unet_config_path,
                                  "--resolution", "32", "--output_dir", tmp_path / "out", "--push_to_hub"])
    assert "error: --push_to_hub: could not create the hub repo: OfflineModeIsEnabled" in log and "Steps:" not in log


def test_sixteen_bit_images_keep_their_precision(monkeypatch, tmp_path):
    monkeypatch.syspath_prepend(str(REPO))
    from train_unconditional import image_for_model

    levels = (np.arange(64 * 64, dtype=np.uint16) * 16).reshape(64, 64)  # 4096 grey levels, more than 8 bits hold
    Image.fromarray(levels).save(tmp_path / "deep.png")
    image = Image.open(tmp_path / "deep.png")
    precise = np.asarray(image_for_model(image, Namespace(preserve_input_precision=True), 3))
    np.testing.assert_allclose(precise, levels / 65535, rtol=1e-6)
    assert len(np.unique(precise)) == 4096
    assert image_for_model(image, Namespace(preserve_input_precision=False), 3).mode == "RGB"  # the 8-bit default
    assert image_for_model(image, Namespace(preserve_input_precision=False), 1).mode == "L"  # for a one-channel UNet
