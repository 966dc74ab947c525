"""benchmarks/gpu_table.py, its models (_models.py) and its step timer (_timed.py): the FLOPs
counted on meta copies, the timer's steps and profile, the plan (order, budget, commands), and
--tiny tables run on the CPU."""

import ast
import itertools
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
import _models
import gpu_table

GPU_TABLE = REPO / "benchmarks" / "gpu_table.py"
PAPER_DIT_XL_2_GFLOPS = 118.6  # DiT paper, table 4: multiply-adds of one forward at 256 px


def forward_flops(model, *inputs):
    return _models.count_flops(lambda: model(*inputs))


def test_dit_xl_2_forward_is_the_papers_count_and_a_step_three_forwards():
    """FLOPs count a multiply-add as 2: the forward is twice the paper's figure. A training step
    (forward and backward, no frozen encoder on cached latents) is 3 forwards and grows with the
    batch."""
    model = _models.meta_dit("DiT-XL/2", 256)
    forward = forward_flops(model, *_models.dit_inputs(model, 1))
    assert abs(forward / 2 / (PAPER_DIT_XL_2_GFLOPS * 1e9) - 1) < 0.01
    step = _models.dit_step_flops("DiT-XL/2", 1, 256)
    assert abs(step / forward - 3) < 0.01
    assert _models.dit_step_flops("DiT-XL/2", 4, 256) == pytest.approx(4 * step, rel=1e-3)


@pytest.fixture(scope="module")
def sd15_configs(tmp_path_factory):
    """The configs alone of the SD 1.5-shaped pipeline the GPU table trains (no weights)."""
    from diffusers import AutoencoderKL, UNet2DConditionModel
    from transformers import CLIPTextConfig

    path = tmp_path_factory.mktemp("sd15_configs")
    with torch.device("meta"):
        UNet2DConditionModel(**_models.SD15_UNET).save_config(path / "unet")
        AutoencoderKL(**_models.SD15_VAE).save_config(path / "vae")
    CLIPTextConfig(**_models.CLIP_VIT_L14).save_pretrained(path / "text_encoder")
    return str(path)


def test_sd_step_flops_lora_checkpointing_and_cached_latents(sd15_configs):
    """At 512 px: the full fine-tune's UNet costs 3 forwards; LoRA's less (no weight gradients for
    the frozen base) but more than the forward (activation gradients through it); gradient
    checkpointing adds up to one forward (the recomputed blocks); cached latents drop exactly the
    VAE encoder; the frozen encoders' forwards are part of the step; FLOPs grow with the batch."""
    unet = _models.meta_unet(sd15_configs)
    forward = forward_flops(unet, *_models.unet_inputs(unet, 1, 512))

    def step(lora=False, checkpointing=False, cached=False, batch=1):
        return _models.sd_step_flops(sd15_configs, lora, batch, 512, checkpointing, cached)

    full, parts = step()
    assert parts["unet"] == pytest.approx(3 * forward, rel=0.01)
    assert full == parts["unet"] + parts["text_encoder"] + parts["vae_encoder"]
    assert min(parts.values()) > 0
    _, lora_parts = step(lora=True)
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


def test_the_step_timer_records_each_optimizer_step_once_and_profiles_one(tmp_path):
    """One time per step of torch's AdamW through accelerate's wrapper (which is an Optimizer too,
    but not hooked) and of bitsandbytes' AdamW8bit; the file is written when the script exits with
    an error too, and the exit code is the script's. With TIMED_PROFILE=2 the second step's
    operations are summed (on a CPU: aten operations, no launches), the ten heaviest first."""
    script, out, code = tmp_path / "toy.py", tmp_path / "steps.json", 3
    script.write_text(TOY.format(code=code))
    run = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "_timed.py"), str(script), "3", "2", str(code)],
        env={**os.environ, **HF_ENV, "TIMED_JSON": str(out), "TIMED_PROFILE": "2"},
        capture_output=True,
        text=True,
        check=False,
    )
    assert run.returncode == code, run.stderr
    timed = json.loads(out.read_text())
    assert len(timed["step_times"]) == 5
    assert timed["step_times"] == sorted(timed["step_times"])
    assert timed["error"] == f"SystemExit: {code}"
    assert timed["device"] == "cpu" and timed["max_memory_allocated"] is None
    profile = timed["profile"]
    names = [name for name, _, _ in profile["top"]]
    assert profile["launches"] is None and 0 < len(names) <= 10
    assert "aten::addmm" in names or "aten::mm" in names  # the Linear's forward
    times = [ms for _, _, ms in profile["top"]]
    assert times == sorted(times, reverse=True) and sum(times) <= profile["busy_ms"] + 1e-6
    assert profile["kernels"] >= sum(n for _, n, _ in profile["top"])


def test_the_dry_run_prints_the_plan_in_order_within_the_budget_and_starts_nothing(tmp_path):
    """Rows in the order given (SCRIPT * as ours, then the reference), each with its estimate and
    command; a row whose estimate would end past --budget_s is skipped and a later, shorter one
    still planned; nothing is built or written."""
    reference = tmp_path / "reference"
    reference.mkdir()
    for name in gpu_table.REFERENCE.values():
        (reference / name).write_text("raise SystemExit('not to be run')\n")
    rows = ["lora:ours:b4:cache+reduce-overhead", "sd:*:b1:gc", "lora:ours:b4:cache+compile"]
    rows += ["lora:*:b4:profile"]
    work_dir, out = tmp_path / "w", tmp_path / "table.md"
    command = [sys.executable, GPU_TABLE, "--dry_run", "--rows", *rows, "--budget_s", "310"]
    command += ["--work_dir", work_dir, "--out", out, "--reference_dir", reference]
    run = subprocess.run(
        [str(c) for c in command], capture_output=True, text=True, timeout=120, check=False
    )
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert lines[0] == "building the pipeline: ~20 s"  # not built yet: 20 s
    plan = [line.split(": ", 2) for line in lines[1:-1]]
    # 20 + 185 = 205, + 35 + 35 = 275; the compile (185) would end at 460; profile ours at 310
    assert [(row, when) for row, when, _ in plan] == [
        ("lora:ours:b4:cache+reduce-overhead", "~185 s, ends at ~205 s"),
        ("sd:ours:b1:gc", "~35 s, ends at ~240 s"),
        ("sd:reference:b1:gc", "~35 s, ends at ~275 s"),
        ("lora:ours:b4:cache+compile", "skipped"),
        ("lora:ours:b4:profile", "~35 s, ends at ~310 s"),
        ("lora:reference:b4:profile", "skipped"),
    ]
    assert lines[-1] == "estimate: ~310 s (--budget_s 310), from the H100 run of 2026-11-26"
    commands = {row: text for row, _, text in plan}
    graphs = "ACCELERATE_DYNAMO_BACKEND=INDUCTOR ACCELERATE_DYNAMO_MODE=reduce-overhead "
    graphs += "TORCH_LOGS=cudagraphs "
    assert commands["lora:ours:b4:cache+reduce-overhead"].startswith(graphs + str(REPO))
    assert "--cache_latents" in commands["lora:ours:b4:cache+reduce-overhead"]
    assert commands["sd:reference:b1:gc"].startswith(str(reference / "train_text_to_image.py"))
    assert "--gradient_checkpointing" in commands["sd:ours:b1:gc"]
    assert commands["lora:ours:b4:profile"].startswith("TIMED_PROFILE=20 ")  # the last step
    assert not work_dir.exists() and not out.exists()
    with pytest.raises(SystemExit, match="not MODEL:SCRIPT:bBATCH:FLAGS"):
        gpu_table.parse_rows(gpu_table.parse_args(["--rows", "lora:ours:4:default"]))


COMPILED = """
import torch
from accelerate import Accelerator

seen = {}
torch.compile = lambda model, **kwargs: seen.update(kwargs) or model
Accelerator(cpu=True).prepare(torch.nn.Linear(2, 2))
print(seen)
"""


def test_the_reduce_overhead_row_reaches_torch_compile_through_accelerate(tmp_path):
    """The row changes no script: its environment is what `accelerate launch --dynamo_backend
    inductor --dynamo_mode reduce-overhead` sets, and Accelerator.prepare passes it on."""
    args = gpu_table.parse_args(["--work_dir", str(tmp_path)])
    row = gpu_table.Row("lora", "ours", 4, "cache+reduce-overhead")
    env = gpu_table.run_env(args, extra=gpu_table.row_env(args, row))
    run = subprocess.run(
        [sys.executable, "-c", COMPILED], env=env, capture_output=True, text=True, check=False
    )
    assert run.returncode == 0, run.stderr
    assert ast.literal_eval(run.stdout.splitlines()[-1]) == {
        "backend": "inductor",
        "mode": "reduce-overhead",
    }


def test_dit_rows_time_the_step_with_dataloader_workers(tmp_path):
    """The DiT rows load data as a real launch does, in 4 worker processes; --tiny in the main
    process."""
    row = gpu_table.Row("dit-b2", "ours", 512, "default")
    for argv, workers in [([], "4"), (["--tiny"], "0")]:
        args = gpu_table.parse_args([*argv, "--work_dir", str(tmp_path)])
        command = gpu_table.script_command(args, row, "PIPELINE", "DATA", "OUT")
        assert command[command.index("--dataloader_num_workers") + 1] == workers


def reference_lora_script():
    """The Diffusers example if this checkout sits next to it, else our script as a stand-in (the
    table's mechanics are what is tested; the stand-in takes the same flags)."""
    found = next(
        (d for d in gpu_table.REFERENCE_DIRS if (d / gpu_table.REFERENCE["lora"]).exists()), None
    )
    return found / gpu_table.REFERENCE["lora"] if found else REPO / "train_lora.py"


def table_rows(text):
    """The table's rows as dicts keyed by column name."""
    lines = text.splitlines()
    start = lines.index("| " + " | ".join(gpu_table.COLUMNS) + " |")
    lines = list(itertools.takewhile(lambda line: line.startswith("|"), lines[start + 2 :]))
    cells = [[cell.strip() for cell in line.strip("|").split("|")] for line in lines]
    return [dict(zip(gpu_table.COLUMNS, row, strict=True)) for row in cells]


def run_table(tmp_path, tiny_sd_path, reference, rows, *options):
    out = tmp_path / "table.md"
    command = [sys.executable, GPU_TABLE, "--tiny", "--rows", *rows, "--out", out]
    command += ["--pipeline", tiny_sd_path, "--reference_dir", reference]
    command += ["--work_dir", tmp_path / "w", *options]
    run = subprocess.run(
        [str(c) for c in command],
        env={**os.environ, **HF_ENV},
        capture_output=True,
        text=True,
        check=False,
        timeout=600,
    )
    started = [
        line.split(": ")[0] for line in run.stderr.splitlines() if line.endswith(": running")
    ]
    return run, out, started


def test_tiny_table_in_the_order_given_within_the_budget(tiny_sd_path, tmp_path):
    """--tiny on the CPU: the rows run in the order given; a row whose estimate (a compile, 185 s)
    does not fit in --budget_s is not started and says so, and a later row still runs. Our LoRA
    and the reference at batch 1, each with its figures (only if the timer recorded exactly
    --steps steps), the ratio of their img/s, and the profile of each one's last step below the
    table; a reference that runs out of memory is a row that says so."""
    reference = tmp_path / "reference"
    reference.mkdir()
    shutil.copy(reference_lora_script(), reference / gpu_table.REFERENCE["lora"])
    (reference / gpu_table.REFERENCE["sd"]).write_text(
        'raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")\n'
    )
    rows = ["lora:*:b1:profile", "lora:ours:b1:cache+compile", "sd:reference:b1:default"]
    run, out, started = run_table(
        tmp_path, tiny_sd_path, reference, rows, "--steps", "4", "--budget_s", "150"
    )
    assert run.returncode == 0, run.stderr[-4000:]
    assert started == [
        "lora:ours:b1:profile",
        "lora:reference:b1:profile",
        "sd:reference:b1:default",
    ]
    text = out.read_text()
    assert text in run.stdout
    assert "CPU (--tiny" in text and f"torch {torch.__version__}" in text
    rows = {(r["script"], r["model"], r["flags"]): r for r in table_rows(text)}
    assert list(rows) == [
        ("ours", "tiny SD LoRA r4", "+profile"),
        ("reference", "tiny SD LoRA r4", "+profile"),
        ("ours", "tiny SD LoRA r4", "+cached latents +compile"),
        ("reference", "tiny SD UNet", "default"),
    ]
    skipped = rows["ours", "tiny SD LoRA r4", "+cached latents +compile"]["it/s"]
    assert re.fullmatch(r"skipped: ~185 s, \d+ s of --budget_s left", skipped)
    ours, theirs = (
        rows["ours", "tiny SD LoRA r4", "+profile"],
        rows["reference", "tiny SD LoRA r4", "+profile"],
    )
    # the same FLOPs a step for both: LoRA's UNet forward and backward, text encoder, VAE encoder
    flops = _models.sd_step_flops(tiny_sd_path, True, 1, 64, False, False)[0]
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
    profiles = re.findall(
        r"Profile of (\S+): its last step took [\d.]+ ms under the profiler; (\d+) ops,", text
    )
    assert [(row, int(ops) > 100) for row, ops in profiles] == [
        ("lora:ours:b1:profile", True),
        ("lora:reference:b1:profile", True),
    ]
    assert text.count("| `aten::") == 20  # the ten heaviest operations of each


def test_a_table_cut_short_keeps_the_rows_it_measured(tiny_sd_path, tmp_path):
    """A device call can end mid-table: the table is written after every row, so the rows
    already measured survive the table's own process being killed."""
    reference = tmp_path / "reference"
    reference.mkdir()
    for name in gpu_table.REFERENCE.values():  # the table's process killed by the second row
        (reference / name).write_text("import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\n")
    run, out, _ = run_table(
        tmp_path, tiny_sd_path, reference, ["lora:*:b1:default"], "--steps", "3"
    )
    assert run.returncode == -signal.SIGKILL
    rows = {r["script"]: r for r in table_rows(out.read_text())}
    assert float(rows["ours"]["it/s"]) > 0 and rows["reference"]["it/s"] == "not run"


# A stand-in for the reference: it trains a Linear for --max_train_steps steps the first time it
# runs, and fails the second.
ONCE = """
import sys
from pathlib import Path

import torch

ran = Path(__file__).with_suffix(".ran")
if ran.exists():
    raise RuntimeError("the second run fails")
ran.touch()
model = torch.nn.Linear(2, 2)
optimizer = torch.optim.AdamW(model.parameters())
for _ in range(int(sys.argv[sys.argv.index("--max_train_steps") + 1])):
    model(torch.ones(1, 2)).sum().backward()
    optimizer.step()
"""


def test_repeat_runs_every_row_in_turn_and_keeps_runs_before_a_failure(tiny_sd_path, tmp_path):
    """--repeat 2: each row runs twice, the rows in turn (ours, the reference, ours, ...), and the
    table says its figures are the median of the runs; a row whose second run fails keeps the
    figures of its first, and a note says which run failed."""
    reference = tmp_path / "reference"
    reference.mkdir()
    (reference / gpu_table.REFERENCE["lora"]).write_text(ONCE)
    (reference / gpu_table.REFERENCE["sd"]).write_text(ONCE)
    run, out, started = run_table(
        tmp_path, tiny_sd_path, reference, ["lora:*:b1:default"], "--steps", "3", "--repeat", "2"
    )
    assert run.returncode == 0, run.stderr[-4000:]
    assert started == ["lora:ours:b1:default", "lora:reference:b1:default"] * 2
    text = out.read_text()
    assert "every row ran 2 times, in turn" in text
    assert "lora:reference:b1:default: run 2 failed: RuntimeError: the second run fails" in text
    rows = {r["script"]: r for r in table_rows(text)}
    assert float(rows["ours"]["it/s"]) > 0 and float(rows["reference"]["it/s"]) > 0
