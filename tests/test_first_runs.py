"""A newcomer's first runs: an earlier run is never replaced by accident (refused, or started again with
--overwrite_output_dir, which keeps a user's files), `latest` goes on or starts, every file of the training folder
is read or named, and folder errors come before the models load."""

import shutil
from pathlib import Path

import pytest
from conftest import checkpoints, import_script, run_script, train_in_process, zero  # noqa: I001
from test_edges import folders, script_args, signal_handlers  # noqa: F401 (fixtures)

SCRIPTS = ["train_unconditional.py", "train_dit.py", "train_text_to_image.py", "train_lora.py"]


def files(folder):
    """Every file under folder with its bytes."""
    return {p: p.read_bytes() for p in Path(folder).rglob("*") if p.is_file()}


@pytest.mark.parametrize("script", ["train_unconditional.py", "train_lora.py"])
def test_a_second_run_into_a_finished_folder_is_refused_and_every_file_keeps_its_bytes(script, folders, tmp_path,
                                                                                       run_in_process,
                                                                                       signal_handlers):
    """The same command twice: the second stops before the models load, naming both ways on. A LoRA's final
    file alone (its checkpoints removed) is an earlier run too."""
    out = tmp_path / "out"
    args = script_args(script, folders, out) + ["--max_train_steps", "2", "--checkpointing_steps", "1"]
    train_in_process(script, args)
    if script == "train_lora.py":
        for name in checkpoints(out):
            shutil.rmtree(out / name)
    before = files(out)
    expected = (f"error: --output_dir {out} holds an earlier run: go on with --resume_from_checkpoint latest, or "
                "start again with --overwrite_output_dir")
    assert run_in_process(script, args) == expected
    assert files(out) == before


def test_overwrite_output_dir_starts_again_on_two_processes_under_zero2_and_keeps_a_users_file(folders, tmp_path):
    """An earlier run's checkpoints (a half-written one too), samples and logs go; the user's notes stay; the new
    run trains with --checkpoints_total_limit, and its final weights replace the earlier ones."""
    from conftest import weights

    out = tmp_path / "out"
    args = script_args("train_unconditional.py", folders, out) + ["--logger", "tensorboard", "--checkpointing_steps",
                                                                  "2", "--save_images_epochs", "1"]
    train_in_process("train_unconditional.py", args + ["--max_train_steps", "6"])
    (out / "tmp-checkpoint-8").mkdir()  # a save that a crash cut short
    (out / "notes.txt").write_text("my notes")
    earlier_logs = {p.name for p in (out / "logs").rglob("events.out.tfevents.*")}
    earlier_weights = weights(out / "unet")
    assert checkpoints(out) == ["checkpoint-2", "checkpoint-4", "checkpoint-6"] and earlier_logs
    run_script("train_unconditional.py", args + ["--max_train_steps", "4", "--overwrite_output_dir",
                                                 "--checkpoints_total_limit", "1"],
               num_processes=2, launch_args=zero(2))
    assert checkpoints(out) == ["checkpoint-4"] and not (out / "tmp-checkpoint-8").exists()
    assert (out / "notes.txt").read_text() == "my notes"
    # Epochs of 3 steps on two processes; the earlier run's step-6.png is gone.
    assert sorted(p.name for p in (out / "samples").iterdir()) == ["step-3.png", "step-4.png"]
    logs = {p.name for p in (out / "logs").rglob("events.out.tfevents.*")}
    assert logs and not logs & earlier_logs
    assert weights(out / "unet").keys() == earlier_weights.keys()
    assert any(not (weights(out / "unet")[k] == v).all() for k, v in earlier_weights.items())


def test_overwrite_output_dir_given_as_a_relative_path(folders, tmp_path, monkeypatch, signal_handlers):
    """`--output_dir out`, as the README writes it: the earlier logs and a half-written checkpoint go too."""
    monkeypatch.chdir(tmp_path)
    args = script_args("train_unconditional.py", folders, Path("out")) + ["--logger", "tensorboard",
                                                                          "--max_train_steps", "2"]
    train_in_process("train_unconditional.py", args)
    earlier_logs = {p.name for p in Path("out/logs").rglob("events.out.tfevents.*")}
    Path("out/tmp-checkpoint-9").mkdir()
    train_in_process("train_unconditional.py", args + ["--overwrite_output_dir"])
    logs = {p.name for p in Path("out/logs").rglob("events.out.tfevents.*")}
    assert earlier_logs and logs and not logs & earlier_logs and not Path("out/tmp-checkpoint-9").exists()


def test_latest_starts_where_there_is_no_checkpoint_and_goes_on_where_there_is(folders, tmp_path, caplog,
                                                                              signal_handlers):
    """A requeued job that died before its first checkpoint starts afresh; the next goes on; --overwrite_output_dir
    with --resume_from_checkpoint is refused by argparse in one line."""
    from conftest import import_script

    caplog.set_level("INFO")
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("my notes")
    args = script_args("train_unconditional.py", folders, out) + ["--checkpointing_steps", "2",
                                                                  "--resume_from_checkpoint", "latest"]
    train_in_process("train_unconditional.py", args + ["--max_train_steps", "2"])
    assert checkpoints(out) == ["checkpoint-2"] and "Resumed from" not in caplog.text
    train_in_process("train_unconditional.py", args + ["--max_train_steps", "4"])
    assert checkpoints(out) == ["checkpoint-2", "checkpoint-4"] and f"Resumed from {out}/checkpoint-2" in caplog.text
    with pytest.raises(SystemExit) as stop:
        import_script("train_unconditional").parse_args(list(map(str, args + ["--overwrite_output_dir"])))
    assert stop.value.code == 2


def test_every_file_of_the_folder_is_read_or_named(folders, tmp_path, caplog, signal_handlers):
    """Phone photos: .HEIC and .avif files, which datasets does not read, are named with the way out; the
    pictures train with their caption files, which are not named, nor the metadata, nor a hidden file."""
    caplog.set_level("INFO")
    pictures = tmp_path / "photos"
    shutil.copytree(folders["pictures"], pictures)
    for i in range(12):
        (pictures / f"{i:04d}.txt").write_text(f"a photo of digit {i}")
    for name in ["IMG_0001.HEIC", "IMG_0002.heic", "IMG_0003.avif", ".DS_Store", ".thumbnails/IMG_0001.HEIC"]:
        (pictures / name).parent.mkdir(exist_ok=True)
        (pictures / name).write_bytes(b"not read")
    (pictures / "metadata.jsonl").unlink()  # the captions come from the .txt files
    args = script_args("train_lora.py", dict(folders, pictures=pictures), tmp_path / "out")
    train_in_process("train_lora.py", args + ["--max_train_steps", "1"])
    assert "3 files not read {'.avif': 1, '.heic': 2}: convert pictures to JPEG or PNG" in caplog.text
    assert "12 images, 1 steps" in caplog.text
    (pictures / "metadata.jsonl").write_text("")
    for picture in pictures.glob("*.png"):
        picture.unlink()
    args[args.index("--output_dir") + 1] = tmp_path / "new"
    script = import_script("train_lora")
    with pytest.raises(SystemExit) as stop:
        script.check_folders(script.parse_args(list(map(str, args))), "pytorch_lora_weights.safetensors", True)
    # Hidden files and the metadata are not named; the captions are, with no picture to caption.
    expected = f"error: --train_data_dir {pictures}: no pictures in it, only {{'.avif': 1, '.heic': 2, '.txt': 12}}"
    assert str(stop.value.code) == expected
    # A zip archive of pictures, which datasets unpacks, counts as pictures.
    zipped = tmp_path / "zipped"
    zipped.mkdir()
    (zipped / "pictures.zip").write_bytes(b"a zip")
    args[args.index("--train_data_dir") + 1] = zipped
    script.check_folders(script.parse_args(list(map(str, args))), "pytorch_lora_weights.safetensors", True)


@pytest.mark.parametrize("script", SCRIPTS)
def test_a_missing_folder_fails_before_any_model_loads(script, folders, tmp_path, run_in_process, signal_handlers):
    """The model named does not exist either: the error is about the folder, so nothing was loaded before it."""
    args = script_args(script, dict(folders, pictures=tmp_path / "no-such"), tmp_path / "out")
    for flag in ("--model_config_name_or_path", "--pretrained_model_name_or_path"):
        if flag in args:
            args[args.index(flag) + 1] = tmp_path / "no-model"
    assert run_in_process(script, args) == f"error: --train_data_dir {tmp_path / 'no-such'}: no such folder"
    assert not (tmp_path / "out").exists()


def test_the_readmes_background_commands_stop_with_a_checkpoint(tiny_sd_path, kohya_folder, tmp_path):
    """README, "In the background": its commands as written, in a non-interactive bash, but for the arguments
    (a tiny model, CPU processes): one process under `nohup python`, two under `setsid ... accelerate launch`;
    each `kill` line leaves the file `stopped` and a checkpoint, and every process ends."""
    import os
    import re
    import subprocess
    import sys

    from conftest import HF_ENV, REPO, _accelerate_config, _free_port

    readme = (REPO / "README.md").read_text()
    block = re.search(r"### In the background\n.*?```bash\n(.*?)```", readme, re.S).group(1)
    one, several = block.split("\n\n")
    args = ["--pretrained_model_name_or_path", tiny_sd_path, "--train_data_dir", kohya_folder, "--resolution", "64",
            "--max_train_steps", "400", "--checkpointing_steps", "200", "--report_to", "none"]
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", _accelerate_config(),
              "--multi_gpu", "--num_processes", "2", "--main_process_port", str(_free_port())]
    for name, commands in [("one", one), ("several", several)]:
        out = tmp_path / name
        out.mkdir()
        full = " ".join(map(str, [REPO / "train_lora.py", *args, "--output_dir", out]))
        script = commands.replace(".venv/bin/python train_lora.py ...", f"{sys.executable} {full}")
        script = script.replace(".venv/bin/accelerate launch --multi_gpu train_lora.py ...", " ".join([*launch, full]))
        assert "..." not in script, script
        # Before each kill: the training has started. After it: every process of the run has ended.
        script = re.sub(r"^(kill .*)$", r"until grep -q 'steps of' train.log; do sleep 0.2; done; sleep 1; \1",
                        script, flags=re.M)
        script += f"\nwhile pgrep -f 'output_dir {out}' > /dev/null; do sleep 0.5; done\n"
        env = {**os.environ, **HF_ENV, "ACCELERATE_USE_CPU": "1"}
        (tmp_path / f"{name}.sh").write_text(script)
        done = subprocess.run(["bash", tmp_path / f"{name}.sh"], cwd=out, env=env, capture_output=True, text=True,
                              timeout=600)
        log = (out / "train.log").read_text()
        assert done.returncode == 0, done.stderr[-2000:] + log[-3000:]
        assert (out / "stopped").exists() and checkpoints(out), log[-3000:]
        assert not (out / "pytorch_lora_weights.safetensors").exists()  # stopped, not trained to the end
