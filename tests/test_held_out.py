"""The held-out loss (--validation_split, --validate_every_n_steps) and the model card, in the four diffusion
scripts: the same value for the same weights, on 1 and 2 processes; the untrained baseline at step 0; no held-out
picture in a training batch, before and after a resume; the same split with buckets and the latent cache; the
quarters of the schedule that make up the whole; bad input in one line; a card that names the base model
(text-to-image and LoRA: unconditional and DiT write none)."""

import shutil
import sys

import pytest
from conftest import import_script, resume_copy, run_script, train_in_process
from test_edges import card_code

UNCOND, DIT, T2I, LORA = "train_unconditional.py", "train_dit.py", "train_text_to_image.py", "train_lora.py"


def scalars(out):
    """Every scalar the run logged to TensorBoard: {tag: {step: value}}."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    found = {}
    for events in (out / "logs").rglob("events.out.tfevents.*"):
        accumulator = EventAccumulator(str(events))
        accumulator.Reload()
        for tag in accumulator.Tags()["scalars"]:
            found.setdefault(tag, {}).update({e.step: e.value for e in accumulator.Scalars(tag)})
    return found


@pytest.fixture(scope="module")
def uncond_args(digits_folder, tiny_unet_config):
    """12 digits, a quarter held out (3), batches of 3: 3 steps an epoch; min-SNR and v-prediction, so that the
    held-out loss takes the loop's target and weighting."""
    return ["--train_data_dir", digits_folder, "--model_config_name_or_path", tiny_unet_config, "--resolution", "32",
            "--random_flip", "--snr_gamma", "5", "--prediction_type", "v_prediction", "--train_batch_size", "3",
            "--max_train_steps", "6", "--checkpointing_steps", "3", "--validation_split", "0.25",
            "--validate_every_n_steps", "2", "--save_images_epochs", "9", "--ddpm_num_inference_steps", "2",
            "--eval_batch_size", "1", "--learning_rate", "1e-3", "--lr_warmup_steps", "0"]  # fmt: skip


def test_the_same_weights_give_the_same_held_out_loss_on_one_and_two_processes(uncond_args, tmp_path):
    """A learning rate of 0 keeps the seeded initial weights: every held-out loss of both runs, at steps 0 (where
    the run starts), 2, 4 and 6 (the last), is the same number; the quarters of the schedule, weighted by their pictures, make it up."""
    args = uncond_args + ["--learning_rate", "0", "--use_ema", "--logger", "tensorboard"]
    # One thread a process, as torchrun sets for two: a CPU kernel's sums may differ in the last bit between
    # thread counts, whatever the script does.
    run_script(UNCOND, args + ["--output_dir", tmp_path / "one"], env={"OMP_NUM_THREADS": "1"})
    run_script(UNCOND, args + ["--output_dir", tmp_path / "two"], num_processes=2)
    one, two = scalars(tmp_path / "one"), scalars(tmp_path / "two")
    assert sorted(one["val_loss"]) == [0, 2, 4, 6]
    assert one["val_loss"] == two["val_loss"] and len(set(one["val_loss"].values())) == 1
    # 3 pictures at t = 166, 500 and 833: one in each of quarters 0, 2 and 3, none in quarter 1.
    assert "val_loss_t1" not in one and all(one[f"val_loss_t{q}"] == two[f"val_loss_t{q}"] for q in (0, 2, 3))
    whole = sum(one[f"val_loss_t{q}"][6] for q in (0, 2, 3)) / 3
    assert whole == pytest.approx(one["val_loss"][6], rel=1e-6)
    assert one["val_loss_t0"][6] != one["val_loss_t3"][6]


def record_rows(monkeypatch, script):
    """The rows that reach each training batch, and the held-out set's rows at each held-out loss."""
    module = import_script(script.removesuffix(".py"))
    trained, held, paths, validating = [], [], [], [False]
    preprocess, log_held_out_loss = module.preprocess, module.log_held_out_loss

    def recording_preprocess(examples, *args, **kwargs):
        if not validating[0]:
            trained.extend(examples["row"])
        return preprocess(examples, *args, **kwargs)

    def recording_log(accelerator, held_out, *args, **kwargs):
        held.append(sorted(held_out.with_format(None)["row"]))
        if "image" in held_out.column_names:  # not with cached latents
            paths.append(sorted(image["path"] for image in held_out.with_format(None)["image"]))
        validating[0] = True
        try:
            return log_held_out_loss(accelerator, held_out, *args, **kwargs)
        finally:
            validating[0] = False

    monkeypatch.setattr(module, "preprocess", recording_preprocess)
    monkeypatch.setattr(module, "log_held_out_loss", recording_log)
    record_rows.paths = paths
    return trained, held


def test_no_held_out_picture_ever_trains_and_the_split_survives_a_resume(uncond_args, tmp_path, monkeypatch):
    out = tmp_path / "out"
    args = uncond_args + ["--logger", "none"]
    with monkeypatch.context() as patch:
        trained, held = record_rows(patch, UNCOND)
        train_in_process(UNCOND, args + ["--output_dir", out])
    split = held[0]
    assert len(split) == 3 and all(rows == split for rows in held) and len(held) == 4  # steps 0, 2, 4, 6
    assert set(trained) == set(range(12)) - set(split)  # the other nine, every epoch
    resumed = resume_copy(out, "checkpoint-3")
    with monkeypatch.context() as patch:
        trained, held = record_rows(patch, UNCOND)
        train_in_process(UNCOND, args + ["--output_dir", resumed, "--resume_from_checkpoint", "latest"])
    assert held and all(rows == split for rows in held) and not set(trained) & set(split)
    # Resumed at the last step: nothing left to train, the saved weights' loss measured where the run starts.
    at_end = resume_copy(out, "checkpoint-6", tmp_path / "at-end")
    with monkeypatch.context() as patch:
        trained, held = record_rows(patch, UNCOND)
        train_in_process(UNCOND, args + ["--output_dir", at_end, "--resume_from_checkpoint", "latest"])
    assert held == [split] and not trained and (at_end / "unet").exists()
    assert not (at_end / "README.md").exists()  # no card for a model trained from scratch


def test_held_out_passes_leave_the_training_untouched(uncond_args, tmp_path):
    """A held-out loss at every step or at none: the same final weights, bit for bit (no random draw of the loop
    is taken, and dropout is off only while it runs)."""
    from conftest import assert_same_weights, weights

    for every in ("1", "1000"):
        train_in_process(UNCOND, uncond_args + ["--logger", "none", "--validate_every_n_steps", every,
                                                "--output_dir", tmp_path / every])
    assert_same_weights(weights(tmp_path / "1" / "unet"), weights(tmp_path / "1000" / "unet"))


def test_max_train_samples_draws_from_the_pictures_that_train(tiny_sd_path, sd_folder, tmp_path, monkeypatch):
    args = ["--pretrained_model_name_or_path", tiny_sd_path, "--train_data_dir", sd_folder, "--resolution", "64",
            "--train_batch_size", "2", "--max_train_steps", "4", "--validation_split", "0.25", "--report_to", "none",
            "--max_train_samples", "4", "--output_dir", tmp_path / "out"]  # fmt: skip
    with monkeypatch.context() as patch:
        trained, held = record_rows(patch, T2I)
        train_in_process(T2I, args)
    assert len(held[0]) == 3 and len(set(trained)) == 4 and not set(trained) & set(held[0])  # 4 of the other 9


def test_the_split_is_the_same_with_buckets_and_the_latent_cache(tiny_sd_path, sd_folder, tmp_path, monkeypatch):
    args = ["--pretrained_model_name_or_path", tiny_sd_path, "--train_data_dir", sd_folder, "--resolution", "64",
            "--train_batch_size", "2", "--max_train_steps", "2", "--validation_split", "0.25", "--report_to", "none",
            "--center_crop"]  # fmt: skip
    splits = []
    for extra in ([], ["--aspect_ratio_buckets", "64,64;64,128", "--cache_latents"]):
        with monkeypatch.context() as patch:
            trained, held = record_rows(patch, T2I)
            train_in_process(T2I, args + extra + ["--output_dir", tmp_path / f"out{len(splits)}"])
        assert held and not set(trained) & set(held[0])
        splits.append(held[0])
    assert splits[0] == splits[1] and len(splits[0]) == 3


@pytest.mark.parametrize("script", [DIT, T2I, LORA])
def test_each_latent_script_logs_a_held_out_loss_and_writes_a_card_naming_its_base(script, tiny_sd_path, sd_folder,
                                                                                     tiny_dit_config, tmp_path,
                                                                                     monkeypatch):
    out = tmp_path / "out"
    if script == DIT:
        args = ["--train_data_dir", sd_folder, "--model_config_name_or_path", tiny_dit_config, "--resolution", "32",
                "--label_column", "label", "--prediction_type", "flow_prediction", "--num_inference_steps", "2",
                "--logger", "tensorboard"]  # fmt: skip
    else:
        args = ["--pretrained_model_name_or_path", tiny_sd_path, "--train_data_dir", sd_folder, "--resolution",
                "64", "--use_ema", "--report_to", "tensorboard"]  # fmt: skip
    args += ["--train_batch_size", "3", "--max_train_steps", "2", "--validation_split", "0.25",
             "--output_dir", out]  # fmt: skip
    monkeypatch.setattr(sys, "argv", [script, *map(str, args)])  # the command the card records
    train_in_process(script, args)
    logged = scalars(out)
    assert sorted(logged["val_loss"]) == [0, 2]  # the untrained baseline, the end
    if script == DIT:
        assert not (out / "README.md").exists()
        return
    card = (out / "README.md").read_text()
    assert f"{logged['val_loss'][2]:.4f}" in card and f"{script} " in card and "--validation_split 0.25" in card
    # The loading lines run as pasted; a local base model is named in the text, not in the Hub's header.
    monkeypatch.chdir(tmp_path)
    exec(card_code(card), {})
    assert (tmp_path / "sample.png").exists()
    assert "base_model" not in card.split("---")[1] and f"Fine-tuned from {tiny_sd_path}" in card


@pytest.mark.parametrize("case, expected", [
    ("all", "error: --validation_split: ValueError: With n_samples=12, test_size=0.99 and train_size=None, the "
            "resulting train set will be empty."),
    ("no_pictures", "error: --train_data_dir {held}: no pictures in it"),
])  # fmt: skip
def test_a_split_that_leaves_nothing_or_a_folder_without_pictures_is_one_line(case, expected, uncond_args,
                                                                              run_in_process, tmp_path):
    args = [a for a in uncond_args if a not in ("--validation_split", "0.25")] + ["--output_dir", tmp_path / "out"]
    if case == "no_pictures":
        (tmp_path / "held").mkdir()
        (tmp_path / "held" / "notes.txt").write_text("no picture here")
        args[args.index("--train_data_dir") + 1] = tmp_path / "held"
        args += ["--validation_split", "0.25"]
    else:
        args += ["--validation_split", "0.99"]
    error = run_in_process(UNCOND, args)
    assert error.startswith(expected.format(held=tmp_path / "held")) and "\n" not in error
    assert not (tmp_path / "out").exists()
    shutil.rmtree(tmp_path / "held", ignore_errors=True)
