"""train_unconditional.py: the checkpoint contract, exact resume, equivalent runs, EMA, output, bad input."""
import shutil

import numpy as np
import pytest
import torch
from conftest import (CORRUPT_FILE, EQUIVALENT, REPO, STABLE_ADAM, assert_same_weights, checkpoints, run_script,
                      snapshot, unet_weights)
from PIL import Image

SCRIPT = "train_unconditional.py"


@pytest.fixture(scope="module")
def common(label_folder, tiny_unet_config_path):
    """6 images at 32 px; random crop and flip; 3 steps per epoch at batch 2; cosine schedule with warmup."""
    return ["--train_data_dir", label_folder, "--model_config_name_or_path", tiny_unet_config_path,
            "--resolution", "32", "--random_flip", "--use_ema", "--seed", "0", "--learning_rate", "1e-3",
            "--lr_warmup_steps", "2", "--max_train_steps", "8", "--checkpointing_steps", "4",
            "--ddpm_num_inference_steps", "2", "--eval_batch_size", "2", "--save_images_epochs", "100",
            "--save_model_epochs", "100", *STABLE_ADAM]


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
    opt, opt_ref = (torch.load(d / "checkpoint-8" / "optimizer.bin", weights_only=False) for d in (out, reference))
    for i, state in opt_ref["state"].items():
        for name in ["exp_avg", "exp_avg_sq"]:
            torch.testing.assert_close(opt["state"][i][name], state[name], rtol=1e-6, atol=1e-12)


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
    (out / "not-a-checkpoint").mkdir()
    return out


@pytest.mark.parametrize("case", ["empty", "no_such_dir", "column", "corrupt", "resume", "resolution"])
def test_bad_input_is_one_clear_error(case, victim, tiny_unet_config_path, label_folder, empty_folder,
                                      corrupt_image_folder):
    data = {"empty": empty_folder, "no_such_dir": str(victim / "nowhere"), "corrupt": corrupt_image_folder}
    extra, expected = {
        "empty": ([], "--train_data_dir"),
        "no_such_dir": ([], "is not a folder"),
        "column": (["--image_column", "img"], "--image_column 'img' is not in the dataset; its columns are ['image', 'label']"),
        "corrupt": ([], CORRUPT_FILE),
        "resume": (["--resume_from_checkpoint", "not-a-checkpoint"], "is not a checkpoint-N folder"),
        "resolution": (["--resolution", "33"], "--resolution 33 must be a multiple of 2"),
    }[case]
    before = snapshot(victim)
    log = run_script(SCRIPT, ["--train_data_dir", data.get(case, label_folder), "--model_config_name_or_path",
                              tiny_unet_config_path, "--resolution", "32", "--output_dir", victim, *extra],
                     expect_fail=True)
    assert expected in log
    assert "Steps:" not in log  # failed before training started
    assert snapshot(victim) == before


@pytest.mark.parametrize("argv, expected", [
    ([], "give a dataset: --dataset_name or --train_data_dir"),
    (["--train_data_dir", "x", "--lr_scheduler", "wavy"], "argument --lr_scheduler: invalid choice: 'wavy'"),
    (["--train_data_dir", "x", "--prediction_type", "v"], "argument --prediction_type: invalid choice: 'v'"),
    (["--train_data_dir", "x", "--ddpm_beta_schedule", "cubic"], "argument --ddpm_beta_schedule: invalid choice: 'cubic'"),
])
def test_bad_flags_are_rejected_by_the_parser(argv, expected, capsys, monkeypatch):
    monkeypatch.syspath_prepend(str(REPO))
    train_unconditional = __import__("train_unconditional")
    with pytest.raises(SystemExit) as exit:
        train_unconditional.parse_args(argv)
    assert exit.value.code == 2 and expected in capsys.readouterr().err


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
