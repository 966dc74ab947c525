"""The edges of a run, in the four diffusion scripts: it ends whatever its DataLoader workers do; a signal after
the final save changes nothing; the held-out loss of the step a run stops at is logged; a user's README.md
survives; nonsense numbers and folders end in one line before any training."""

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
    assert status == 75 and (out / "stopped").exists(), log[-3000:]
    step = checkpoints(out)[-1].split("-")[1]
    assert f"Stopped at step {step}: go on with --resume_from_checkpoint latest" in log


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
    """A quarter held out, the loss every 2 steps, checkpoints every 2; SIGTERM during step 3. The run logs the
    untrained weights' loss at step 0 and 2, and stops at the end of step 3, before validation; resumed, it logs
    3 (where it starts), 4, 6, 8 and 10: every step the uninterrupted run logs, and the one it stopped at."""
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
    assert stop.value.code == 75 and checkpoints(out) == ["checkpoint-2", "checkpoint-3"]
    assert sorted(scalars(out)["val_loss"]) == [0, 2]
    train_in_process("train_unconditional.py", args + ["--resume_from_checkpoint", "latest"])
    assert sorted(scalars(out)["val_loss"]) == [0, 2, 3, 4, 6, 8, 10]


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
    args = script_args("train_lora.py", folders, out) + ["--max_train_steps", "1"]
    train_in_process("train_lora.py", args)
    assert (out / "README.md").read_text() == "# My project\n\nNotes that are not a model card.\n"
    assert f"{out / 'README.md'} is not a model card of ours: kept" in caplog.text
    (out / "README.md").unlink()
    args.append("--overwrite_output_dir")  # the folder holds the first run
    train_in_process("train_lora.py", args)
    ours = (out / "README.md").read_text()
    monkeypatch.setattr(sys, "argv", ["train_lora.py", *map(str, args), "--seed", "1"])
    train_in_process("train_lora.py", args + ["--seed", "1"])
    assert (out / "README.md").read_text() != ours and "--seed 1" in (out / "README.md").read_text()


def test_a_prompt_cannot_break_out_of_the_card_and_the_card_records_the_command(folders, tmp_path, monkeypatch,
                                                                               signal_handlers):
    """A validation prompt that holds a code fence and a heading stays inside the card's code; the card records
    the command as typed; its loading lines run as pasted."""
    out = tmp_path / "out"
    prompt = "a digit ```\n# Injected heading"
    args = script_args("train_text_to_image.py", folders, out)
    args += ["--max_train_steps", "1", "--validation_prompts", prompt, "--num_inference_steps", "1"]
    monkeypatch.setattr(sys, "argv", ["train_text_to_image.py", *map(str, args)])
    train_in_process("train_text_to_image.py", args)
    card = (out / "README.md").read_text()
    assert "# Injected heading" in card and "\n# Injected" not in card
    assert "--max_train_steps 1" in card and "base_model" not in card.split("---")[1]  # a folder, not a Hub model
    monkeypatch.chdir(tmp_path)
    exec(card_code(card), {})
    assert (tmp_path / "sample.png").exists()


BAD_NUMBERS = [
    (["--validation_split", "nan"], "argument --validation_split: invalid fraction value: 'nan'"),
    (["--validation_split", "inf"], "argument --validation_split: invalid fraction value: 'inf'"),
    (["--validation_split", "1.5"], "argument --validation_split: invalid fraction value: '1.5'"),
    (["--validation_split", "0.2", "--validate_every_n_steps", "0"],
     "argument --validate_every_n_steps: invalid count value: '0'"),
    (["--validation_split", "0.2", "--validate_every_n_steps", "-1"],
     "argument --validate_every_n_steps: invalid count value: '-1'"),
    (["--validate_every_n_steps", "5"], "--validate_every_n_steps needs --validation_split"),
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


@pytest.mark.parametrize("output_dir", ["out", "out/run"])
def test_an_output_dir_that_is_or_lies_in_a_file_ends_in_one_line(output_dir, folders, tmp_path, run_in_process,
                                                                  signal_handlers):
    """Before the models load (a model that does not exist is never reached)."""
    (tmp_path / "out").write_text("a file of the user's")
    args = script_args("train_unconditional.py", folders, tmp_path / output_dir)
    args[args.index("--model_config_name_or_path") + 1] = tmp_path / "no-model"
    error = run_in_process("train_unconditional.py", args)
    assert error == f"error: --output_dir {tmp_path / output_dir}: a file is in the way"
    assert (tmp_path / "out").read_text() == "a file of the user's"


def test_a_held_out_picture_that_cannot_be_read_stops_the_run_before_it_trains(folders, tmp_path, run_in_process,
                                                                            signal_handlers):
    """Named by the held-out pass at the start, before the first step; an earlier run's file `stopped`, which a
    scheduler reads, stays."""
    from conftest import import_script

    pictures = tmp_path / "pictures"
    shutil.copytree(folders["pictures"], pictures)
    out = tmp_path / "out"
    out.mkdir()
    (out / "stopped").write_text("Stopped at step 6")
    args = script_args("train_unconditional.py", dict(folders, pictures=pictures), out) + ["--validation_split", "0.25"]
    script = import_script("train_unconditional")
    held_out = Path(script.load_datasets(script.parse_args(list(map(str, args))))["validation"][0]["image"]["path"])
    held_out.write_bytes(held_out.read_bytes()[:200])  # cut short, as a copy interrupted
    error = run_in_process("train_unconditional.py", args)
    assert error.startswith(f"error: image {held_out}: OSError") and "\n" not in error
    assert sorted(p.name for p in out.iterdir()) == ["stopped"]
    assert (out / "stopped").read_text() == "Stopped at step 6"
