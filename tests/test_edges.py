"""The edges of a run, in the four diffusion scripts: it ends whatever its DataLoader workers do; a rank whose
launcher is killed stops with a checkpoint; a signal after the final save changes nothing; the held-out loss of
the step a run stops at is logged; a user's README.md survives; a held-out set that shares a picture with the
training set is refused; nonsense numbers and folders end in one line before any training."""

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import (HF_ENV, REPO, _accelerate_config, _free_port, checkpoints, digit_images, run_signalled,
                      train_in_process, write_imagefolder)

SCRIPTS = ["train_unconditional.py", "train_dit.py", "train_text_to_image.py", "train_lora.py"]

# The script under a wrapper that keeps every DataLoader iterator alive, as a traceback that outlives the error
# does: their workers are still there when the process exits, and they ignore SIGTERM, which is all that
# multiprocessing's exit sends them. FAIL_AT_START sends SIGTERM to the process group just after that many
# DataLoader workers have started.
WRAPPER = f"""
import multiprocessing.process, os, signal, sys
import torch.utils.data
sys.path.insert(0, {str(REPO)!r})
script = __import__(sys.argv.pop(1))
kept, iterate = [], torch.utils.data.DataLoader.__iter__
torch.utils.data.DataLoader.__iter__ = lambda self: kept.append(iterate(self)) or kept[-1]
start, started = multiprocessing.process.BaseProcess.start, [0]
def signal_at_start(self):
    start(self)
    started[0] += 1
    if started[0] == int(os.environ.get("SIGNAL_AT_START", 0)):
        os.killpg(os.getpgrp(), signal.SIGTERM)
multiprocessing.process.BaseProcess.start = signal_at_start
script.main(script.parse_args())
"""


def launch(tmp_path, script, args, num_processes=1, env=None):
    """The script under WRAPPER: plain `python` for one process (a group of its own), `accelerate launch` for
    two. Returns the Popen; the output goes to tmp_path/log, which no full pipe can block."""
    wrapper = tmp_path / "wrapper.py"
    wrapper.write_text(WRAPPER)
    command = [sys.executable, wrapper, script.removesuffix(".py"), *map(str, args)]
    if num_processes > 1:
        command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", _accelerate_config(),
                   "--multi_gpu", "--num_processes", "2", "--main_process_port", str(_free_port()), wrapper,
                   script.removesuffix(".py"), *map(str, args)]  # fmt: skip
    run_env = {**os.environ, **HF_ENV, "ACCELERATE_USE_CPU": "1", **(env or {})}
    with open(tmp_path / "log", "w") as log:
        proc = subprocess.Popen(command, cwd=REPO, env=run_env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    proc.log = tmp_path / "log"
    return proc


def finish(proc, seconds):
    """The exit status and output of a run that must end within `seconds`; a run that does not is killed (its
    whole group) and fails the test."""
    try:
        proc.wait(seconds)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        kill_strays(proc.log.parent)
        pytest.fail(f"still running after {seconds} s:\n{proc.log.read_text()[-3000:]}")
    return proc.returncode, proc.log.read_text()


def strays(folder):
    """The processes whose command line names `folder`: ranks that torchrun started in sessions of their own."""
    found = []
    for process in Path("/proc").glob("[0-9]*"):
        try:
            if str(folder) in (process / "cmdline").read_bytes().decode(errors="ignore"):
                found.append(int(process.name))
        except OSError:  # gone meanwhile
            pass
    return found


def kill_strays(folder):
    for pid in strays(folder):
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


def script_args(script, folders, out):
    """A short run of each script on a folder of 12 pictures with caption files and labels."""
    if script in ("train_unconditional.py", "train_dit.py"):
        model = "unet" if script == "train_unconditional.py" else "dit"
        steps = "--ddpm_num_inference_steps" if script == "train_unconditional.py" else "--num_inference_steps"
        args = ["--train_data_dir", folders["pictures"], "--model_config_name_or_path", folders[model],
                "--resolution", "32", "--logger", "none", "--eval_batch_size", "1", "--save_images_epochs", "9",
                steps, "1"]
    else:
        args = ["--pretrained_model_name_or_path", folders["sd"], "--train_data_dir", folders["pictures"],
                "--resolution", "64", "--report_to", "none"]
    return args + ["--train_batch_size", "2", "--max_train_steps", "12", "--output_dir", out]


@pytest.fixture(scope="module")
def folders(tmp_path_factory, tiny_unet_config, tiny_dit_config, tiny_sd_path):
    pictures = Path(write_imagefolder(tmp_path_factory.mktemp("pictures"), 12, columns=("text", "label"),
                                      size=(72, 80)))
    return {"pictures": pictures, "unet": tiny_unet_config, "dit": tiny_dit_config, "sd": tiny_sd_path}


@pytest.fixture(scope="module")
def truncated(tmp_path_factory, folders):
    """The pictures with 0003 a JPEG cut in half, as a copy interrupted."""
    folder = tmp_path_factory.mktemp("truncated")
    shutil.copytree(folders["pictures"], folder, dirs_exist_ok=True)
    image, _ = digit_images(4, (72, 80))[3]
    (folder / "0003.png").unlink()
    image.save(folder / "0003.jpg")
    data = (folder / "0003.jpg").read_bytes()
    (folder / "0003.jpg").write_bytes(data[: len(data) // 2])
    metadata = (folder / "metadata.jsonl").read_text().replace("0003.png", "0003.jpg")
    (folder / "metadata.jsonl").write_text(metadata)
    return folder


def test_a_truncated_picture_with_two_workers_ends_the_run_and_names_the_picture(folders, truncated, tmp_path):
    """All four scripts, on one process and on two, at once: each run ends within 3 minutes (the two-process
    ones once torchrun has stopped the other rank), not 0, with the picture named."""
    runs = {}
    for script in SCRIPTS:
        for processes in (1, 2):
            out = tmp_path / f"{script}-{processes}"
            folder = dict(folders, pictures=truncated)
            args = script_args(script, folder, out) + ["--dataloader_num_workers", "2"]
            (tmp_path / out.name).mkdir()
            runs[script, processes] = launch(tmp_path / out.name, script, args, processes)
    for (script, processes), proc in runs.items():
        status, log = finish(proc, 180)
        assert status != 0 and f"{truncated}/0003.jpg" in log, (script, processes, log[-3000:])


def test_a_signal_while_the_workers_start_ends_the_run_with_a_checkpoint(folders, tmp_path):
    """SIGTERM to the process group just after the second epoch's first worker starts (workers 1 and 2 are the
    first epoch's): the run saves, exits 75 and ends, though a worker that ignores SIGTERM outlives it."""
    out = tmp_path / "out"
    args = script_args("train_unconditional.py", folders, out) + ["--dataloader_num_workers", "2",
                                                                  "--checkpointing_steps", "4"]
    status, log = finish(launch(tmp_path, "train_unconditional.py", args, env={"SIGNAL_AT_START": "3"}), 120)
    assert status == 75, log[-3000:]
    stopped = (out / "stopped").read_text()
    assert checkpoints(out)[-1] == f"checkpoint-{stopped.split()[-1]}"


def test_a_rank_whose_launcher_is_killed_stops_with_a_checkpoint(folders, tmp_path):
    """kill -9 to the `accelerate launch` process of a two-process run, once checkpoint-2 is on disk: the ranks
    (each in a session of its own, so the kill does not reach them) stop at their next read of the loss, with
    a checkpoint and the file `stopped`, instead of training to the end."""
    out = tmp_path / "out"
    args = script_args("train_unconditional.py", folders, out) + ["--checkpointing_steps", "2",
                                                                  "--max_train_steps", "200"]
    proc = launch(tmp_path, "train_unconditional.py", args, num_processes=2)
    deadline = time.monotonic() + 120
    while not (out / "checkpoint-2").exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert proc.poll() is None, proc.log.read_text()[-3000:]
    proc.kill()
    proc.wait()
    while not (out / "stopped").exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(3)  # the ranks exit once their checkpoint is renamed into place
    stopped = (out / "stopped").read_text()
    step = int(stopped.split()[-1])
    # Not trained to the end: no final save, whose model card the stop never writes.
    assert checkpoints(out)[-1] == f"checkpoint-{step}" and step < 200 and not (out / "README.md").exists()
    ranks = strays(out)
    kill_strays(out)
    assert not ranks


def test_a_signal_after_the_final_save_changes_nothing(folders, tmp_path):
    """SIGTERM just after the final save (in end_training) and again at interpreter exit: the run exits 0 and
    leaves no file `stopped` that would requeue a finished run."""
    out = tmp_path / "out"
    wrapper = tmp_path / "late.py"
    wrapper.write_text(
        "import atexit, os, signal, sys\n"
        f"sys.path.insert(0, {str(REPO)!r})\n"
        "import accelerate, train_unconditional as script\n"
        "atexit.register(os.kill, os.getpid(), signal.SIGTERM)\n"
        "end = accelerate.Accelerator.end_training\n"
        "def late(self):\n"
        "    os.kill(os.getpid(), signal.SIGTERM)\n"
        "    end(self)\n"
        "accelerate.Accelerator.end_training = late\n"
        "script.main(script.parse_args())\n"
    )
    args = script_args("train_unconditional.py", folders, out)
    status, log, _ = run_signalled(wrapper, args + ["--max_train_steps", "2"], None, launcher=False)
    assert status == 0, log[-3000:]
    assert (out / "unet").exists() and not (out / "stopped").exists()


# ----------------------------------------------------------------------------- in this process


@pytest.fixture
def signal_handlers():
    """The process's own SIGTERM and SIGINT handlers, put back after a run in this process installed its own."""
    saved = {signum: signal.getsignal(signum) for signum in (signal.SIGTERM, signal.SIGINT)}
    yield
    for signum, handler in saved.items():
        signal.signal(signum, handler)


def test_the_held_out_loss_due_at_the_step_a_run_stops_at_is_logged(folders, tmp_path, monkeypatch, signal_handlers):
    """A quarter held out, the loss every 2 steps, checkpoints every 2; SIGTERM during step 3. The run stops at
    step 4 after that step's held-out loss; resumed, it logs 6, 8 and 10: every step the uninterrupted run
    logs, each once."""
    from accelerate.scheduler import AcceleratedScheduler
    from test_held_out import scalars

    out = tmp_path / "out"
    args = script_args("train_unconditional.py", folders, out)
    args += ["--logger", "tensorboard", "--validation_split", "0.25", "--validate_every_n_steps", "2",
             "--checkpointing_steps", "2", "--max_train_steps", "10", "--ddpm_num_inference_steps", "1"]
    calls, step = [0], AcceleratedScheduler.step

    def signalled(self, *a, **k):
        calls[0] += 1
        if calls[0] == 3:
            os.kill(os.getpid(), signal.SIGTERM)
        return step(self, *a, **k)

    with monkeypatch.context() as patch:
        patch.setattr(AcceleratedScheduler, "step", signalled)
        with pytest.raises(SystemExit) as stop:
            train_in_process("train_unconditional.py", args)
    assert stop.value.code == 75 and checkpoints(out) == ["checkpoint-2", "checkpoint-4"]
    assert sorted(scalars(out)["val_loss"]) == [2, 4]
    train_in_process("train_unconditional.py", args + ["--resume_from_checkpoint", "latest"])
    assert sorted(scalars(out)["val_loss"]) == [2, 4, 6, 8, 10]


def card_code(card):
    """The loading lines of a model card: its first indented block, as a user pastes it."""
    block = card.split("\n\n    ", 1)[1].split("\n## ")[0]
    return "\n".join(line.removeprefix("    ") for line in ("    " + block).splitlines())


def test_a_readme_of_the_users_is_kept_and_a_card_of_ours_replaced(folders, tmp_path, caplog, monkeypatch,
                                                                    signal_handlers):
    caplog.set_level("INFO")
    out = tmp_path / "project"
    out.mkdir()
    (out / "README.md").write_text("# My project\n\nNotes that are not a model card.\n")
    args = script_args("train_unconditional.py", folders, out) + ["--max_train_steps", "1",
                                                                  "--ddpm_num_inference_steps", "1"]
    train_in_process("train_unconditional.py", args)
    assert (out / "README.md").read_text() == "# My project\n\nNotes that are not a model card.\n"
    assert f"{out / 'README.md'} is not a model card of ours: kept" in caplog.text
    (out / "README.md").unlink()
    train_in_process("train_unconditional.py", args)
    ours = (out / "README.md").read_text()
    monkeypatch.setattr(sys, "argv", ["train_unconditional.py", *map(str, args), "--seed", "1"])
    train_in_process("train_unconditional.py", args + ["--seed", "1"])
    assert (out / "README.md").read_text() != ours and "--seed 1" in (out / "README.md").read_text()


def test_a_prompt_cannot_break_out_of_the_card_and_the_card_records_the_launch(folders, tmp_path, monkeypatch,
                                                                              signal_handlers):
    """A validation prompt that holds a code fence and a heading stays inside the card's code; the card says how
    many processes ran, and in what precision; its loading lines run as pasted."""
    out = tmp_path / "out"
    prompt = "a digit ```\n# Injected heading"
    args = script_args("train_text_to_image.py", folders, out)
    args += ["--max_train_steps", "1", "--validation_prompts", prompt, "--num_inference_steps", "1"]
    monkeypatch.setattr(sys, "argv", ["train_text_to_image.py", *map(str, args)])
    train_in_process("train_text_to_image.py", args)
    card = (out / "README.md").read_text()
    assert "# Injected heading" in card and "\n# Injected" not in card
    assert "Num processes: 1" in card and "Mixed precision type: no" in card
    monkeypatch.chdir(tmp_path)
    exec(card_code(card), {})
    assert (tmp_path / "sample.png").exists()


@pytest.mark.parametrize("case", ["same_folder", "inside", "hard_link"])
def test_a_held_out_set_that_shares_a_picture_with_the_training_set_is_refused(case, folders, tmp_path,
                                                                             run_in_process, signal_handlers):
    """--dataset_name names a local folder, which --validation_data_dir names too; or the held-out folder lies
    inside the training one, whose imagefolder takes every picture below it; or it holds a training picture
    under another name (a hard link: the same file)."""
    pictures = folders["pictures"]
    if case == "inside":
        pictures = tmp_path / "pictures"
        shutil.copytree(folders["pictures"], pictures)
        write_imagefolder(pictures / "held", 3)
    args = script_args("train_unconditional.py", dict(folders, pictures=pictures), tmp_path / "out")
    if case == "same_folder":
        args = [a if a != "--train_data_dir" else "--dataset_name" for a in args]
    held = pictures if case == "same_folder" else pictures / "held"
    if case == "hard_link":
        held = Path(write_imagefolder(tmp_path / "held", 3))
        (held / "0000.png").unlink()
        os.link(pictures / "0005.png", held / "0000.png")
    error = run_in_process("train_unconditional.py", args + ["--validation_data_dir", held])
    assert error.startswith("error: --validation_data_dir: ") and "also trains" in error and "\n" not in error
    assert not (tmp_path / "out").exists()


BAD_NUMBERS = [
    (["--validation_split", "nan"], "argument --validation_split: invalid fraction value: 'nan'"),
    (["--validation_split", "inf"], "argument --validation_split: invalid fraction value: 'inf'"),
    (["--validation_split", "1.5"], "argument --validation_split: invalid fraction value: '1.5'"),
    (["--validation_split", "0.2", "--validate_every_n_steps", "0"],
     "argument --validate_every_n_steps: invalid count value: '0'"),
    (["--validation_split", "0.2", "--validate_every_n_steps", "-1"],
     "argument --validate_every_n_steps: invalid count value: '-1'"),
    (["--validate_every_n_steps", "5"], "--validate_every_n_steps needs --validation_split or --validation_data_dir"),
    (["--checkpointing_steps", "0"], "argument --checkpointing_steps: invalid count value: '0'"),
    (["--train_batch_size", "0"], "argument --train_batch_size: invalid count value: '0'"),
    (["--max_train_steps", "-3"], "argument --max_train_steps: invalid count value: '-3'"),
    (["--dataloader_num_workers", "-1"], "argument --dataloader_num_workers: invalid count_or_0 value: '-1'"),
    (["--learning_rate", "nan"], "argument --learning_rate: invalid at_least_0 value: 'nan'"),
    (["--adam_beta1", "1.5"], "argument --adam_beta1: invalid fraction value: '1.5'"),
    (["--max_grad_norm", "-1"], "argument --max_grad_norm: invalid at_least_0 value: '-1'"),
]


@pytest.mark.parametrize("script", SCRIPTS)
@pytest.mark.parametrize("flags, expected", BAD_NUMBERS, ids=lambda v: " ".join(v) if isinstance(v, list) else None)
def test_a_number_that_makes_no_sense_ends_in_one_line(script, flags, expected, capsys):
    from conftest import import_script

    required = ["--model_config_name_or_path", "x"] if script == "train_dit.py" else []
    if script in ("train_text_to_image.py", "train_lora.py"):
        required = ["--pretrained_model_name_or_path", "x"]
    with pytest.raises(SystemExit) as stop:
        import_script(script.removesuffix(".py")).parse_args(["--train_data_dir", "x", *required, *flags])
    assert stop.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error == f"{script}: error: {expected}" or error.endswith(f": error: {expected}"), error


@pytest.mark.parametrize("case", ["missing", "empty", "a_file"])
def test_a_held_out_folder_without_pictures_ends_in_one_line(case, folders, tmp_path, run_in_process,
                                                             signal_handlers):
    held = {"missing": tmp_path / "no-such", "empty": tmp_path / "empty", "a_file": tmp_path / "file.png"}[case]
    if case == "empty":
        held.mkdir()
    if case == "a_file":
        held.write_bytes(b"")
    args = script_args("train_unconditional.py", folders, tmp_path / "out") + ["--validation_data_dir", held]
    error = run_in_process("train_unconditional.py", args)
    assert error == f"error: --validation_data_dir {held}: no pictures in it"
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("output_dir", ["out", "out/run"])
def test_an_output_dir_that_is_or_lies_in_a_file_ends_in_one_line(output_dir, tmp_path, capsys):
    from conftest import import_script

    (tmp_path / "out").write_text("a file of the user's")
    with pytest.raises(SystemExit):
        import_script("train_unconditional").parse_args(["--train_data_dir", "x", "--output_dir",
                                                         str(tmp_path / output_dir)])
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error.endswith(f"error: --output_dir {tmp_path / output_dir}: a file is in the way")
    assert (tmp_path / "out").read_text() == "a file of the user's"


def test_a_held_out_picture_that_cannot_be_read_stops_the_run_before_it_trains(folders, truncated, tmp_path,
                                                                            run_in_process, signal_handlers):
    """Named before the first step, not at the first held-out pass; an earlier run's file `stopped`, which a
    scheduler reads, stays."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "stopped").write_text("Stopped at step 6")
    args = script_args("train_unconditional.py", folders, out) + ["--validation_data_dir", truncated]
    error = run_in_process("train_unconditional.py", args)
    assert error.startswith(f"error: image {truncated / '0003.jpg'}: OSError") and "\n" not in error
    assert sorted(p.name for p in out.iterdir()) == ["stopped"]
    assert (out / "stopped").read_text() == "Stopped at step 6"


def test_a_resume_that_would_hold_out_pictures_its_checkpoint_trained_on_is_refused(folders, tmp_path,
                                                                                    run_in_process,
                                                                                    signal_handlers):
    """Another --validation_split or --seed holds out other rows, some trained on: the held-out loss would lie.
    The same flags go on; so does a resume that holds out fewer pictures or none."""
    out = tmp_path / "out"
    args = script_args("train_unconditional.py", folders, out) + ["--checkpointing_steps", "2"]
    train_in_process("train_unconditional.py", args + ["--max_train_steps", "2", "--validation_split", "0.25"])
    resume = args + ["--max_train_steps", "4", "--resume_from_checkpoint", "latest"]
    expected = "error: --validation_split, --seed: the checkpoint trained on held-out pictures"
    assert run_in_process("train_unconditional.py", resume + ["--validation_split", "0.5"]) == expected
    assert run_in_process("train_unconditional.py", resume + ["--validation_split", "0.25", "--seed", "1"]) == expected
    train_in_process("train_unconditional.py", resume + ["--validation_split", "0.25"])
    assert checkpoints(out) == ["checkpoint-2", "checkpoint-4"]
    # checkpoint-6 trained on every picture: no split can hold one out of it.
    train_in_process("train_unconditional.py", args + ["--max_train_steps", "6", "--resume_from_checkpoint", "latest"])
    resume[resume.index("4")] = "8"
    assert run_in_process("train_unconditional.py", resume + ["--validation_split", "0.25"]) == expected
    # A checkpoint of an earlier version of the script, which kept no rows, is taken at its word.
    (out / "checkpoint-6" / "held_out_rows.pt").unlink()
    train_in_process("train_unconditional.py", resume + ["--validation_split", "0.25"])
    assert checkpoints(out) == ["checkpoint-2", "checkpoint-4", "checkpoint-6", "checkpoint-8"]


def test_held_out_pictures_stored_in_a_dataset_and_labelled_by_class_folders(folders, tmp_path, monkeypatch,
                                                                             signal_handlers):
    """A dataset whose pictures are stored as bytes (as on the Hub), under names that the held-out folder's
    pictures also have, trains with that folder held out; a held-out folder of class folders labels each picture
    by its folder's name, exactly, as the training set numbers that name, and a class it lacks ends in one line."""
    import datasets
    from conftest import import_script

    files = sorted(Path(folders["pictures"]).glob("*.png"))
    stored = datasets.Dataset.from_dict({"image": [{"bytes": f.read_bytes(), "path": f.name} for f in files]})
    stored.cast_column("image", datasets.Image()).to_parquet(tmp_path / "stored" / "train.parquet")
    held = Path(write_imagefolder(tmp_path / "held", 2, columns=()))
    monkeypatch.chdir(held)  # where 0000.png and 0001.png name held-out files
    args = script_args("train_unconditional.py", folders, tmp_path / "out")
    args = [a if a != "--train_data_dir" else "--dataset_name" for a in args]
    args[args.index(folders["pictures"])] = tmp_path / "stored"
    train_in_process("train_unconditional.py", args + ["--max_train_steps", "2", "--validation_data_dir", "."])
    assert "Held-out loss of these weights" in (tmp_path / "out" / "README.md").read_text()
    for name in ("Cat", "cat", "dog"):
        write_imagefolder(tmp_path / "classes" / name, 2, columns=())
    for name in ("dog", "Cat"):
        write_imagefolder(tmp_path / "held_classes" / name, 1, columns=())
    dit = import_script("train_dit")
    flags = ["--train_data_dir", str(tmp_path / "classes"), "--model_config_name_or_path", "x"]
    # A class the training set lacks, also one whose name reads as a label's number.
    for lacking in ("bird", "0"):
        write_imagefolder(tmp_path / "held_classes" / lacking, 1, columns=())
        with pytest.raises(SystemExit, match=f"^error: --validation_data_dir: .*'{lacking}' is not in list$"):
            dit.load_datasets(dit.parse_args(flags + ["--validation_data_dir", str(tmp_path / "held_classes")]))
        shutil.rmtree(tmp_path / "held_classes" / lacking)
    args = dit.parse_args(flags + ["--validation_data_dir", str(tmp_path / "held_classes")])
    held_out = dit.load_datasets(args, "image", "label")["validation"]
    labels = {Path(x["path"]).parent.name: label for x, label in zip(held_out["image"], held_out["label"])}
    assert labels == {"Cat": 0, "dog": 2}
    # Training labels that are numbers, not class folders: a held-out folder's class names cannot be matched.
    numbered = dit.parse_args(["--train_data_dir", str(folders["pictures"]), "--model_config_name_or_path", "x",
                               "--validation_data_dir", str(tmp_path / "held_classes")])
    with pytest.raises(SystemExit, match="^error: --validation_data_dir: .*'Cat' is not in list$"):
        dit.load_datasets(numbered, "image", "label")
    # A single class folder: datasets gives it no label column, so it is refused as another format.
    shutil.rmtree(tmp_path / "held_classes" / "Cat")
    with pytest.raises(SystemExit, match="^error: --validation_data_dir: .* must be identical"):
        dit.load_datasets(args, "image", "label")
