"""benchmarks/gpu_table.py and its step timer benchmarks/_timed.py: the FLOPs counted on meta
copies, the timer's step count, and a --tiny table of one LoRA pair on the CPU (about a minute)."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys

import pytest
import torch
from conftest import HF_ENV, REPO

sys.path.insert(0, str(REPO / "benchmarks"))
import gpu_table  # noqa: E402

GPU_TABLE = REPO / "benchmarks" / "gpu_table.py"
PAPER_DIT_XL_2_GFLOPS = 118.6  # DiT paper, table 4: multiply-adds of one forward at 256 px


def forward_flops(model, *inputs):
    return gpu_table.count_flops(lambda: model(*inputs))


def test_dit_xl_2_forward_is_the_papers_count_and_a_step_three_forwards():
    """FLOPs count a multiply-add as 2: the forward is twice the paper's figure. A training step
    (forward and backward, no frozen encoder on cached latents) is 3 forwards and grows with the
    batch."""
    model = gpu_table.meta_dit("DiT-XL/2", 256)
    forward = forward_flops(model, *gpu_table.dit_inputs(model, 1))
    assert abs(forward / 2 / (PAPER_DIT_XL_2_GFLOPS * 1e9) - 1) < 0.01
    step = gpu_table.dit_step_flops("DiT-XL/2", 1, 256)
    assert abs(step / forward - 3) < 0.01
    assert gpu_table.dit_step_flops("DiT-XL/2", 4, 256) == pytest.approx(4 * step, rel=1e-3)


def test_the_dit_batch_search_doubles_up_to_its_limit():
    """On a CPU nothing runs out of memory: the search stops at its limit (a GPU stops earlier).
    One thread: a CPU shared with other jobs makes OpenMP threads wait for each other (10x)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert gpu_table.probe_dit_batch("DiT-S/2", 32, 4, device="cpu") == (4, None)
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def sd15_configs(tmp_path_factory):
    """The configs alone of the SD 1.5-shaped pipeline the GPU table trains (no weights)."""
    from diffusers import AutoencoderKL, UNet2DConditionModel
    from transformers import CLIPTextConfig

    path = tmp_path_factory.mktemp("sd15_configs")
    with torch.device("meta"):
        UNet2DConditionModel(**gpu_table.SD15_UNET).save_config(path / "unet")
        AutoencoderKL(**gpu_table.SD15_VAE).save_config(path / "vae")
    CLIPTextConfig(**gpu_table.CLIP_VIT_L14).save_pretrained(path / "text_encoder")
    return str(path)


def test_sd_step_flops_lora_checkpointing_and_cached_latents(sd15_configs):
    """At 512 px: the full fine-tune's UNet costs 3 forwards; LoRA's less (no weight gradients for
    the frozen base) but more than the forward (activation gradients through it); gradient
    checkpointing adds up to one forward (the recomputed blocks); cached latents drop exactly the
    VAE encoder; the frozen encoders' forwards are part of the step; FLOPs grow with the batch."""
    unet = gpu_table.meta_unet(sd15_configs)
    forward = forward_flops(unet, *gpu_table.unet_inputs(unet, 1, 512))

    def step(lora=False, checkpointing=False, cached=False, batch=1):
        return gpu_table.sd_step_flops(sd15_configs, lora, batch, 512, checkpointing, cached)

    full, parts = step()
    assert parts["unet"] == pytest.approx(3 * forward, rel=0.01)
    assert full == parts["unet"] + parts["text_encoder"] + parts["vae_encoder"]
    assert min(parts.values()) > 0
    lora, lora_parts = step(lora=True)
    assert forward < lora_parts["unet"] < parts["unet"]
    assert lora_parts["text_encoder"] == parts["text_encoder"]
    for lora_or_not in (False, True):
        plain, checkpointed = step(lora_or_not)[0], step(lora_or_not, checkpointing=True)[0]
        assert plain + 0.5 * forward < checkpointed <= plain + forward
    cached, cached_parts = step(cached=True)
    assert "vae_encoder" not in cached_parts and cached == full - parts["vae_encoder"]
    assert step(batch=4)[0] == pytest.approx(4 * full, rel=1e-3)


TOY = """
import sys

import bitsandbytes as bnb
import torch
from accelerate import Accelerator

assert __name__ == "__main__" and sys.argv[1:] == ["3", "2", "{code}"], sys.argv
model = torch.nn.Linear(64, 64)
# accelerate's wrapper around AdamW, then bitsandbytes' 8-bit AdamW (state in 8 bits from 4096
# values on)
optimizers = [(Accelerator(cpu=True).prepare(torch.optim.AdamW(model.parameters())), 3),
              (bnb.optim.AdamW8bit(model.parameters()), 2)]
for optimizer, steps in optimizers:
    for _ in range(steps):
        model(torch.randn(2, 64)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
sys.exit({code})
"""


def test_the_step_timer_records_each_optimizer_step_once(tmp_path):
    """One time per step of torch's AdamW through accelerate's wrapper (which is an Optimizer too,
    but not hooked) and of bitsandbytes' AdamW8bit; the file is written when the script exits with
    an error too, and the exit code is the script's. (A normal end: the --tiny table below.)"""
    script, out, code = tmp_path / "toy.py", tmp_path / "steps.json", 3
    script.write_text(TOY.format(code=code))
    run = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "_timed.py"), str(script), "3", "2", str(code)],
        env={**os.environ, **HF_ENV, "TIMED_JSON": str(out)},
        capture_output=True,
        text=True,
    )
    assert run.returncode == code, run.stderr
    timed = json.loads(out.read_text())
    assert len(timed["step_times"]) == 5
    assert timed["step_times"] == sorted(timed["step_times"])
    assert timed["error"] == f"SystemExit: {code}"
    assert timed["device"] == "cpu" and timed["max_memory_allocated"] is None


def reference_lora_script():
    """The Diffusers example if this checkout sits next to it, else our script as a stand-in (the
    table's mechanics are what is tested; the stand-in takes the same flags)."""
    found = next(
        (d for d in gpu_table.REFERENCE_DIRS if (d / gpu_table.REFERENCE["lora"]).exists()), None
    )
    return found / gpu_table.REFERENCE["lora"] if found else REPO / "train_lora.py"


def table_rows(text):
    """The table's rows as dicts keyed by column name."""
    lines = [line for line in text.splitlines() if line.startswith("| ")]
    header = [cell.strip() for cell in lines[0].strip("|").split("|")]
    assert header == gpu_table.COLUMNS
    return [
        dict(zip(header, (c.strip() for c in line.strip("|").split("|")))) for line in lines[1:]
    ]


def test_tiny_table_of_a_lora_pair_and_a_failing_row(tiny_sd_path, tmp_path):
    """--tiny on the CPU: our LoRA script and the reference at batch 1 for 4 steps, each a row with
    its figures, and the ratio of their img/s; a reference that runs out of memory is a row that
    says so, and the table is still written. Each row's figures exist only if the timer recorded
    exactly --steps optimizer steps."""
    reference = tmp_path / "reference"
    reference.mkdir()
    shutil.copy(reference_lora_script(), reference / gpu_table.REFERENCE["lora"])
    (reference / gpu_table.REFERENCE["sd"]).write_text(
        'raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")\n'
    )
    out = tmp_path / "table.md"
    rows = ["lora:*:b1:default", "sd:reference:b1:default"]  # a pair, and a row that will fail
    options = {"--steps": 4, "--out": out, "--pipeline": tiny_sd_path, "--reference_dir": reference}
    command = [sys.executable, GPU_TABLE, "--tiny", "--rows", *rows, "--work_dir", tmp_path / "w"]
    command += [str(x) for pair in options.items() for x in pair]
    run = subprocess.run(
        command, env={**os.environ, **HF_ENV}, capture_output=True, text=True, timeout=600
    )
    assert run.returncode == 0, run.stderr[-4000:]
    text = out.read_text()
    assert text in run.stdout
    assert "CPU (--tiny" in text and f"torch {torch.__version__}" in text
    rows = {(r["script"], r["model"], r["flags"]): r for r in table_rows(text)}
    assert rows.keys() == {
        ("ours", "tiny SD LoRA r4", "default"),
        ("reference", "tiny SD LoRA r4", "default"),
        ("reference", "tiny SD UNet", "default"),
    }
    ours, theirs = (
        rows["ours", "tiny SD LoRA r4", "default"],
        rows["reference", "tiny SD LoRA r4", "default"],
    )
    # the same FLOPs a step for both: LoRA's UNet forward and backward, text encoder, VAE encoder
    flops = gpu_table.sd_step_flops(tiny_sd_path, True, 1, 64, False, False)[0]
    for row in ours, theirs:
        assert row["batch"] == "1" and float(row["it/s"]) > 0 and row["img/s"] == row["it/s"]
        tflops = float(row["TFLOP/s"]) * 1e12
        # to the rounding of TFLOP/s (3 digits) and it/s (2 decimals)
        assert tflops == pytest.approx(flops * float(row["it/s"]), rel=0.005, abs=0.005 * flops)
        assert row["MFU"] == "—" and row["peak GiB"] == "—"  # no peak or GPU memory on a CPU
    ratio = re.fullmatch(r"(\d+\.\d\d)x", ours["ours/ref"])
    # the ratio of the img/s, as far as the rounding to 2 decimals of all three figures lets us see
    (a, b), half = (float(ours["img/s"]), float(theirs["img/s"])), 0.005
    assert (
        ratio
        and (a - half) / (b + half) - half <= float(ratio[1]) <= (a + half) / (b - half) + half
    )
    assert theirs["ours/ref"] == ""
    assert rows["reference", "tiny SD UNet", "default"]["it/s"] == "OOM"


def test_dit_rows_time_the_step_with_dataloader_workers(tmp_path):
    """The DiT rows load data as a real launch does, in 4 worker processes (--dit_workers);
    --tiny in the main process."""
    row = gpu_table.Row("dit-b2", "ours", 512, "default")
    for argv, workers in [([], "4"), (["--tiny"], "0"), (["--dit_workers", "2"], "2")]:
        args = gpu_table.parse_args([*argv, "--work_dir", str(tmp_path)])
        command = gpu_table.script_command(args, row, "PIPELINE", "DATA", "OUT")
        assert command[command.index("--dataloader_num_workers") + 1] == workers


def test_a_table_cut_short_keeps_the_rows_it_measured(tiny_sd_path, tmp_path):
    """A device call can end mid-table: the table is written after every row, so the rows
    already measured survive the table's own process being killed."""
    reference = tmp_path / "reference"
    reference.mkdir()
    for name in gpu_table.REFERENCE.values():  # the table's process killed by the second row
        (reference / name).write_text("import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\n")
    out = tmp_path / "table.md"
    command = [sys.executable, GPU_TABLE, "--tiny", "--rows", "lora:*:b1:default", "--steps", "3"]
    command += ["--out", out, "--pipeline", tiny_sd_path, "--reference_dir", reference]
    command += ["--work_dir", tmp_path / "w"]
    run = subprocess.run(
        [str(c) for c in command], env={**os.environ, **HF_ENV}, capture_output=True, timeout=600
    )
    assert run.returncode == -signal.SIGKILL
    rows = {r["script"]: r for r in table_rows(out.read_text())}
    assert float(rows["ours"]["it/s"]) > 0 and rows["reference"]["it/s"] == "not run"


def test_repeat_runs_every_row_in_turn_and_says_so(tiny_sd_path, tmp_path):
    """--repeat 2: each row runs twice, the rows in turn (ours, then the reference, then ours...),
    and the table says its figures are the median of the runs."""
    reference = tmp_path / "reference"
    reference.mkdir()
    shutil.copy(reference_lora_script(), reference / gpu_table.REFERENCE["lora"])
    out = tmp_path / "table.md"
    options = {"--steps": 3, "--repeat": 2, "--out": out, "--pipeline": tiny_sd_path, "--reference_dir": reference}
    command = [sys.executable, GPU_TABLE, "--tiny", "--rows", "lora:*:b1:default", "--work_dir", tmp_path / "w"]
    command += [str(x) for pair in options.items() for x in pair]
    run = subprocess.run(command, env={**os.environ, **HF_ENV}, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    started = [line.split(":")[1] for line in run.stderr.splitlines() if line.endswith(": running")]
    assert started == ["ours", "reference", "ours", "reference"]
    assert "every row ran 2 times, in turn" in out.read_text()
