#!/usr/bin/env python
"""Speed, memory and FLOP utilisation of our training scripts and the Diffusers examples on a GPU.

    python benchmarks/gpu_table.py --dry_run                 # the plan: rows, commands, time
    python benchmarks/gpu_table.py --rows 'lora:*:b4:default' lora:ours:b4:cache+compile
    python benchmarks/gpu_table.py --budget_s 480            # starts no row it cannot finish
    python benchmarks/gpu_table.py --tiny --rows 'lora:*:b1:default' --steps 4   # on a CPU

A row is MODEL:SCRIPT:bBATCH:FLAGS. MODEL: sd (the full fine-tune), lora, dit-b2 or dit-xl2.
SCRIPT: ours, reference (the Diffusers example) or * (both, ours first; DiT: ours alone). FLAGS:
default, or names from FLAGS below joined by + (cache+compile). The rows run in the order given
(DEFAULT_ROWS without --rows), and the table is written as each row ends: a run cut short keeps
what it measured. A row's time is estimated from the H100 run of 2026-11-26 (ESTIMATE_S); with
--budget_s a row starts only if the time spent plus its estimate fits, its timeout cut to what is
left. What is trained, and how its FLOPs are counted: benchmarks/_models.py. --tiny: the tests'
tiny pipeline, 64 px, fp32, DiT-S/2; the figures say nothing about a GPU.

Each script runs in its own process under benchmarks/_timed.py, which records the end of every
optimizer step and the peak GPU memory, the same way for ours and the examples:
    it/s      1 / the median step after --warmup steps; a step is the time between the ends of
              two optimizer steps: data loading, encoders, forward, backward, update.
    img/s     it/s x batch.            peak GiB  torch.cuda.max_memory_allocated() over the run.
    TFLOP/s   a step's FLOPs / the median step.    MFU  TFLOP/s / the GPU's dense bf16 peak.
    ours/ref  our img/s over the reference's at the same flags, else at its default (so marked).
A profile row also records its last step under torch.profiler (_timed.py's TIMED_PROFILE): the
kernels, the host's launches, their time and the ten heaviest, written below the table.

The same flags for ours and the reference (--dry_run prints them): 64 photos, 512 px (DiT: 256 px
on cached latents), bf16, no checkpoint, no validation, no --report_to (the reference refuses
"none"), --dataloader_num_workers 0 (DiT: 4; --tiny 0).
"""

import argparse
import importlib
import itertools
import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from functools import partial
from pathlib import Path

import _models
from _models import photo_folder, pipeline_folder

REPO = Path(__file__).resolve().parent.parent

TIMED = REPO / "benchmarks" / "_timed.py"
OURS = {"sd": "train_text_to_image.py", "lora": "train_lora.py", "dit": "train_dit.py"}
REFERENCE = {"sd": "train_text_to_image.py", "lora": "train_text_to_image_lora.py"}
# Where the unmodified Diffusers examples are looked for, unless --reference_dir says.
REFERENCE_DIRS = [REPO / d / "reference/diffusers_examples" for d in ("shared", "../shared")]
# Dense bf16 peaks from the datasheets, TFLOP/s; the first key in the device's name wins.
PEAK_TFLOPS = {"H100 NVL": 835, "H100 PCIe": 756, "H100": 989, "H200 NVL": 835, "H200": 989}
PEAK_TFLOPS |= {"B200": 2250, "A100": 312, "A10G": 70, "L40S": 362, "L4": 121}
NEVER = 1_000_000  # a step or epoch interval that never comes: no checkpoint, no sample
# accelerate's TorchDynamoPlugin reads these (`accelerate launch --dynamo_backend inductor
# --dynamo_mode reduce-overhead` sets them) and Accelerator.prepare passes them to torch.compile;
# mode reduce-overhead replays the compiled graphs as CUDA graphs (TORCH_LOGS: the row's log says
# which graphs inductor left out of them, and why).
COMPILE = {"ACCELERATE_DYNAMO_BACKEND": "INDUCTOR"}
GRAPHS = {**COMPILE, "ACCELERATE_DYNAMO_MODE": "reduce-overhead", "TORCH_LOGS": "cudagraphs"}
# Each flag: its name in the table, the script's flags, the environment.
FLAGS = {
    "default": ("default", [], {}),
    "gc": ("+grad ckpt", ["--gradient_checkpointing"], {}),
    "8bit": ("+8-bit Adam", ["--use_8bit_adam"], {}),
    "cache": ("+cached latents", ["--cache_latents"], {}),
    "compile": ("+compile", [], COMPILE),
    "reduce-overhead": ("+compile reduce-overhead", [], GRAPHS),
    "profile": ("+profile", [], {}),
}
# Seconds, from the H100 run of 2026-11-26: a row (launch, 20 steps, exit: its eager tables took
# 33 to 39 s a row), the first compile of the SD 1.5 UNet's forward and backward (the compiled
# table: 174 s a row), a compiled DiT-B/2 row (its table: 2.3 min), building SD 1.5.
ESTIMATE_S = {"row": 35, "compile": 150, "dit": 140, "build": 20}
# The whole table, the most wanted rows first.
DEFAULT_ROWS = ["lora:*:b4:default", "lora:ours:b4:cache", "lora:ours:b4:cache+reduce-overhead"]
DEFAULT_ROWS += ["lora:*:b4:profile", "lora:*:b16:default", "lora:ours:b1:gc", "sd:*:b4:default"]
DEFAULT_ROWS += ["lora:ours:b4:cache+compile", "dit-b2:ours:b512:compile", "sd:*:b4:8bit"]
DEFAULT_ROWS += ["sd:*:b4:gc", "sd:ours:b4:cache", "dit-xl2:ours:b128:default"]
COLUMNS = ["script", "model", "batch", "flags", "it/s", "img/s", "peak GiB", "TFLOP/s", "MFU"]
COLUMNS += ["ours/ref"]


@dataclass
class Row:
    model: str  # "sd", "lora", "dit-b2" or "dit-xl2"
    script: str  # "ours" or "reference"
    batch: int
    flags: str  # "default" or FLAGS keys joined by "+"
    skip: str = ""  # why the row is not run
    result: dict = field(default_factory=dict)
    step_s: list = field(default_factory=list)  # the median step of each --repeat

    @property
    def id(self):
        return f"{self.model}:{self.script}:b{self.batch}:{self.flags}"

    def has(self, flag):
        return flag in self.flags.split("+")


def parse_rows(args):
    """The rows of --rows, in the order given; SCRIPT * is ours, then the reference."""
    rows = []
    for text in args.rows:
        model, script, batch, flags = (text.split(":") + ["", "", ""])[:4]
        ok = model in ("sd", "lora", "dit-b2", "dit-xl2") and script in ("ours", "reference", "*")
        if not (ok and batch[1:].isdigit() and all(f in FLAGS for f in flags.split("+"))):
            raise SystemExit(f"error: {text!r} is not MODEL:SCRIPT:bBATCH:FLAGS (see --help)")
        scripts = ["ours", "reference"] if script == "*" else [script]
        for script in scripts[: 1 if model.startswith("dit") else 2]:
            row = Row(model, script, int(batch[1:]), flags)
            if script == "reference" and model.startswith("dit"):
                row.skip = "n/a: no reference DiT script"
            elif script == "reference" and row.has("cache"):
                row.skip = "n/a: the reference has no --cache_latents"
            elif script == "reference" and args.reference_dir is None:
                row.skip = "n/a: no reference scripts found (--reference_dir)"
            elif row.has("8bit") and args.tiny:
                row.skip = "skipped: 8-bit Adam is for a GPU (--tiny)"
            if row.id not in [r.id for r in rows]:
                rows.append(row)
    return rows


def estimate_s(row):
    """Seconds a row takes on the H100 of 2026-11-26, from launch to exit."""
    compiled = row.has("compile") or row.has("reduce-overhead")
    if row.model.startswith("dit"):
        return ESTIMATE_S["dit"] if compiled else ESTIMATE_S["row"]
    return ESTIMATE_S["row"] + ESTIMATE_S["compile"] * compiled


log = partial(print, file=sys.stderr, flush=True)


def run_env(args, compile_model=False, extra=None):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    env |= {"TRANSFORMERS_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    # every cache (datasets' encodings of the images, ...) under the work folder
    env |= {"HF_HOME": str(args.work_dir / "hf_home"), "ACCELERATE_DYNAMO_BACKEND": "NO"}
    env |= (COMPILE if compile_model else {}) | (extra or {})
    env.pop("HF_DATASETS_CACHE", None)  # under HF_HOME
    if args.tiny:  # on a CPU shared with other jobs, OpenMP threads that spin-wait for each other
        env["OMP_NUM_THREADS"] = "1"  # make a tiny step up to 100x slower; one thread is steady
    return env


def row_env(args, row):
    """The row's own environment: its flags', and which step to profile."""
    env = {k: v for flag in row.flags.split("+") for k, v in FLAGS[flag][2].items()}
    return env | ({"TIMED_PROFILE": str(args.steps)} if row.has("profile") else {})


def script_command(args, row, pipeline, data, output_dir):
    """The script and its flags for a row."""
    if row.model.startswith("dit"):
        script = REPO / OURS["dit"]
        common = ["--model_config_name_or_path", dit_config(args, row.model)[0]]
        common += ["--train_data_dir", data, "--pretrained_vae_model_name_or_path"]
        common += [f"{pipeline}/vae", "--cache_latents", "--center_crop"]
        common += ["--resolution", args.dit_resolution, "--logger", "none"]
        common += ["--save_images_epochs", NEVER, "--eval_batch_size", 1]
        common += ["--num_inference_steps", 1, "--dataloader_num_workers", 4 * (not args.tiny)]
    else:
        ours = row.script == "ours"
        script = REPO / OURS[row.model] if ours else args.reference_dir / REFERENCE[row.model]
        common = ["--pretrained_model_name_or_path", pipeline, "--train_data_dir", data]
        common += ["--resolution", args.resolution, "--center_crop", "--dataloader_num_workers", 0]
        common += ["--rank", 4] if row.model == "lora" else []
    common += ["--train_batch_size", row.batch, "--max_train_steps", args.steps]
    common += ["--mixed_precision", "no" if args.tiny else "bf16", "--output_dir", output_dir]
    common += ["--checkpointing_steps", NEVER, "--seed", 0]
    common += [f for flag in row.flags.split("+") for f in FLAGS[flag][1]]
    return [str(script), *map(str, common)]


def run_row(args, row, pipeline, data, timeout):
    """Run one row's script under the step timer; fill row.result with its figures or error."""
    if row.model.startswith("dit"):
        dit_config(args, row.model)[1]()
    (args.work_dir / "logs").mkdir(parents=True, exist_ok=True)
    log_file = args.work_dir / "logs" / (row.id.replace(":", "_") + ".log")
    with tempfile.TemporaryDirectory(dir=args.work_dir) as tmp, open(log_file, "w") as out:
        timed_json = Path(tmp) / "steps.json"  # the outputs are deleted: GBs each
        cmd = [sys.executable, str(TIMED), *script_command(args, row, pipeline, data, f"{tmp}/out")]
        env = run_env(args, extra={**row_env(args, row), "TIMED_JSON": str(timed_json)})
        out.write(f"{shlex.join(cmd)}\n\n")
        out.flush()
        start = time.perf_counter()
        # a session of its own: on a timeout, kill the script and every process it started
        # (inductor's compile workers), or they would hold on to GPU memory
        output = {"stdout": out, "stderr": subprocess.STDOUT}
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, start_new_session=True, **output)
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            code = f"timed out after {timeout:.0f} s"
        timed = json.loads(timed_json.read_text()) if timed_json.is_file() else {}
    result = {"seconds": time.perf_counter() - start, "log": str(log_file)}
    result |= {"device": timed.get("device"), "profile": timed.get("profile")}
    times = timed.get("step_times", [])
    if code != 0 or len(times) != args.steps:
        error = timed.get("error") or (code if isinstance(code, str) else f"exit code {code}")
        oom = "OutOfMemoryError" in error or "out of memory" in error.lower()
        # one short line, without the table's column separator
        result["error"] = "OOM" if oom else error.splitlines()[0][:80].replace("|", "/")
        if code == 0:  # it ended normally but did not step as often as asked
            result["error"] = f"{len(times)} optimizer steps, not {args.steps}"
    else:
        durations = [b - a for a, b in itertools.pairwise(times)][args.warmup - 1 :]
        result["step_s"] = statistics.median(durations)
        result["first_step_s"] = times[0] - timed["start"]
        result["last_step_s"] = times[-1] - times[-2]  # a profile row's profiled step
        peak = timed.get("max_memory_allocated")
        result["peak_gib"] = peak / 2**30 if peak is not None else None
    row.result = result


def dit_data(args, batch):
    """Whole batches only (a last, smaller one would time fewer images), and few enough that
    epoch 0 ends within the warm-up: train_dit.py samples after it whatever --save_images_epochs
    says (one image a class in one step, as script_command asks)."""
    return photo_folder(args.work_dir, args.dit_resolution, batch * max(1, args.warmup - 1))


def dit_model_type(args, model):
    return "DiT-S/2" if args.tiny else {"dit-b2": "DiT-B/2", "dit-xl2": "DiT-XL/2"}[model]


def dit_config(args, model):
    """The folder of the row's DiT config.json, which train_dit.py builds from, and its writer."""
    model_type = dit_model_type(args, model)
    folder = args.work_dir / "dit-configs" / model_type.replace("/", "-")
    return folder, lambda: _models.meta_dit(model_type, args.dit_resolution).save_config(folder)


def model_label(args, row):
    if row.model.startswith("dit"):
        return dit_model_type(args, row.model)
    name = "SD 1.5" if not args.tiny else "tiny SD"
    return f"{name} LoRA r4" if row.model == "lora" else f"{name} UNet"


def step_flops(args, row):
    if row.model.startswith("dit"):
        model_type = dit_model_type(args, row.model)
        return _models.dit_step_flops(model_type, row.batch, args.dit_resolution)
    lora, gc, cache = row.model == "lora", row.has("gc"), row.has("cache")
    pipeline = str(pipeline_folder(args))
    return _models.sd_step_flops(pipeline, lora, row.batch, args.resolution, gc, cache)[0]


def ratio(rows, row):
    """Our img/s over the reference's at the same flags, or else at its default (then True)."""
    if row.script != "ours" or "step_s" not in row.result:
        return None, False
    for flags in (row.flags, "default"):
        for other in rows:
            same = (other.model, other.batch, other.flags) == (row.model, row.batch, flags)
            if same and other.script == "reference" and "step_s" in other.result:
                return other.result["step_s"] / row.result["step_s"], flags != row.flags
    return None, False


def profile_lines(row):
    """A profile row's last step: its kernels, the host's launches, and the ten heaviest."""
    found, unit = row.result["profile"], "kernels" if row.result["device"] != "cpu" else "ops"
    launches = "" if found["launches"] is None else f", {found['launches']} launches by the host"
    head = f"Profile of {row.id}: its last step took {1e3 * row.result['last_step_s']:.1f} ms under"
    head += f" the profiler; {found['kernels']} {unit}{launches}, {found['busy_ms']:.1f} ms in all."
    lines = ["", head, "", f"| {unit[:-1]} | calls | ms |", "|---|--:|--:|"]
    return lines + [f"| `{name[:90]}` | {n} | {ms:.2f} |" for name, n, ms in found["top"]]


def format_table(args, rows, device, peak, notes):
    names = ("torch", "diffusers", "accelerate", "transformers", "peft")
    lines = ["# Training speed: our scripts and the Diffusers examples", ""]
    lines += [f"- date: {datetime.now(UTC):%Y-%m-%d %H:%M} UTC", f"- device: {device}"]
    lines[-1] += f", dense bf16 peak {peak:g} TFLOP/s" if peak else ""
    lines += ["- " + ", ".join(f"{m} {importlib.import_module(m).__version__}" for m in names)]
    lines += [f"- {args.steps} steps a row; it/s from the median step after {args.warmup} warm-up"]
    lines[-1] += f" steps; {'fp32' if args.tiny else 'bf16'}; SD at {args.resolution} px, DiT at"
    lines[-1] += f" {args.dit_resolution} px on cached latents"
    lines += ["", "| " + " | ".join(COLUMNS) + " |", "|---|---|--:|---|--:|--:|--:|--:|--:|--:|"]
    for row in rows:
        labels = " ".join(FLAGS[flag][0] for flag in row.flags.split("+"))
        cells, result = [row.script, model_label(args, row), str(row.batch), labels], row.result
        if row.skip or "step_s" not in result:
            cells += [row.skip or result.get("error", "not run"), "", "", "", "", ""]
        else:
            it_s, gib = 1 / result["step_s"], result["peak_gib"]
            tflops = result["flops"] / result["step_s"] / 1e12
            value, vs_default = ratio(rows, row)
            cells += [f"{it_s:.2f}", f"{it_s * row.batch:.2f}", f"{gib:.1f}" if gib else "—"]
            cells += [f"{tflops:.3g}", f"{tflops / peak:.1%}" if peak else "—"]
            cells += ["" if value is None else f"{value:.2f}x" + " vs default" * vs_default]
        lines.append("| " + " | ".join(cells) + " |")
    firsts = [f"{r.id} {r.result['first_step_s']:.0f} s" for r in rows if "step_s" in r.result]
    if firsts:  # compilation shows here
        notes = [*notes, "from launch to the end of the first step: " + ", ".join(firsts)]
    lines += ["", *[f"- {note}" for note in notes]]
    for row in rows:
        if row.result.get("profile") and "step_s" in row.result:
            lines += profile_lines(row)
    return "\n".join(lines) + "\n"


def goals(rows, peak):
    """The targets, read from the table: our img/s at least the reference's at the same flags,
    1.5x its default with cached latents; at most 3.5 GiB at batch 1 with checkpointing (a 4 GB
    card); DiT-B/2 at 35 % MFU."""
    found = []
    for row in rows:
        value, _ = ratio(rows, row)
        goal = 1.5 if row.has("cache") else 1.0
        if value is not None and not row.has("profile"):
            met = "met" if value >= goal else "NOT met"
            found.append(f"{row.id}: {value:.2f}x the reference's img/s (>= {goal}x): {met}")
        if row.has("gc") and row.batch == 1 and (gib := row.result.get("peak_gib")):
            found.append(f"{row.id}: {gib:.1f} GiB (<= 3.5): {'met' if gib <= 3.5 else 'NOT met'}")
        if row.model == "dit-b2" and "step_s" in row.result and peak:
            mfu = row.result["flops"] / row.result["step_s"] / 1e12 / peak
            found.append(f"{row.id}: {mfu:.1%} MFU (>= 35%): {'met' if mfu >= 0.35 else 'NOT met'}")
    return found


def device_name(args):
    if args.tiny:
        return "CPU (--tiny: the figures say nothing about a GPU)"
    code = "import torch; print(torch.cuda.get_device_name() if torch.cuda.is_available() else '')"
    found = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    if not found.stdout.strip():
        raise SystemExit("error: no CUDA GPU here; use --tiny for the small CPU version")
    return found.stdout.strip().splitlines()[-1]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rows", nargs="+", default=DEFAULT_ROWS, help="Row ids, the first run first.")
    p.add_argument("--tiny", action="store_true", help="Tiny models, 64 px, fp32: a CPU.")
    p.add_argument("--budget_s", type=float, help="Start no row that would end after this.")
    p.add_argument("--dry_run", action="store_true", help="Print the plan; start nothing.")
    p.add_argument("--steps", type=int, help="Optimizer steps a row (20; --tiny 5).")
    p.add_argument("--warmup", type=int, help="First steps left out (5; --tiny 1); >= 1.")
    p.add_argument("--repeat", type=int, default=1, help="Run the rows this many times, in turn.")
    p.add_argument("--timeout", type=float, default=600, help="Seconds a row may take.")
    p.add_argument("--out", type=Path, help="benchmarks/gpu_table.md (--tiny: gpu_table_tiny.md)")
    work_dir = Path(tempfile.gettempdir()) / "gpu-table"
    p.add_argument("--work_dir", type=Path, default=work_dir, help="Models, data, caches, logs.")
    p.add_argument("--pipeline", help="Train this pipeline folder instead of building one.")
    p.add_argument("--reference_dir", type=Path, help="The Diffusers examples' folder.")
    p.add_argument("--peak_tflops", type=float, help="The GPU's dense bf16 peak, for MFU.")
    args = p.parse_args(argv)
    args.resolution, args.dit_resolution = (64, 64) if args.tiny else (512, 256)
    args.steps = args.steps or (5 if args.tiny else 20)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.tiny else 5)
    if not 1 <= args.warmup < args.steps:
        p.error("--warmup must be at least 1 (the first step has no start) and below --steps")
    args.out = args.out or REPO / "benchmarks" / f"gpu_table{'_tiny' if args.tiny else ''}.md"
    args.work_dir = args.work_dir.resolve()
    found = [d for d in REFERENCE_DIRS if (d / REFERENCE["sd"]).is_file()] + [None]
    args.reference_dir = args.reference_dir or found[0]
    args.reference_dir = args.reference_dir and args.reference_dir.resolve()
    return args


def dry_run(args, rows):
    """The plan, nothing started: each row's estimate, when it would end, and its command."""
    folder = args.work_dir / ("tiny-sd" if args.tiny else "sd15")
    spent = 0 if args.pipeline or (folder / "done").is_file() else ESTIMATE_S["build"]
    print(f"building the pipeline: ~{spent} s" if spent else "the pipeline: built")
    for row in [row for _ in range(args.repeat) for row in rows]:
        ends = spent + estimate_s(row)
        if not row.skip and ends > (args.budget_s or float("inf")):
            left = args.budget_s - spent
            print(f"{row.id}: skipped: ~{estimate_s(row)} s, {left:.0f} s of --budget_s left")
            continue
        if row.skip:
            print(f"{row.id}: {row.skip}")
            continue
        env = "".join(f"{k}={v} " for k, v in row_env(args, row).items())
        cmd = shlex.join(script_command(args, row, "PIPELINE", "DATA", "OUTPUT_DIR"))
        spent = ends
        print(f"{row.id}: ~{estimate_s(row)} s, ends at ~{ends} s: {env}{cmd}")
    budget = f" (--budget_s {args.budget_s:g})" if args.budget_s else ""
    print(f"estimate: ~{spent} s{budget}, from the H100 run of 2026-11-26")


def main():
    args = parse_args()
    rows = parse_rows(args)
    if args.dry_run:
        return dry_run(args, rows)
    device = device_name(args)
    peak = args.peak_tflops or next((v for k, v in PEAK_TFLOPS.items() if k in device), None)
    notes = [] if peak or args.tiny else [f"no bf16 peak known for {device}: no MFU"]
    started = time.perf_counter()
    args.work_dir.mkdir(parents=True, exist_ok=True)
    pipeline = pipeline_folder(args)
    sd_data = photo_folder(args.work_dir, args.resolution, 64)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    if args.repeat > 1:
        notes.append(f"every row ran {args.repeat} times, in turn: the median of the runs' medians")
    for row in [row for _ in range(args.repeat) for row in rows]:  # ours, reference, ours, ...
        left = (args.budget_s or float("inf")) - (time.perf_counter() - started)
        over = f"skipped: ~{estimate_s(row)} s, {max(left, 0):.0f} s of --budget_s left"
        skip = row.skip or (estimate_s(row) > left and over)
        if skip:
            row.skip = "" if row.step_s else skip  # a repeat keeps the runs it had
            log(f"{row.id}: {skip}")
            continue
        log(f"{row.id}: running")
        data = dit_data(args, row.batch) if row.model.startswith("dit") else sd_data
        before = row.result
        run_row(args, row, pipeline, data, min(args.timeout, left))
        result = row.result
        outcome = result.get("error") or f"{1 / result['step_s']:.3f} it/s"
        log(f"{row.id}: {outcome} ({result['seconds']:.0f} s; log {result['log']})")
        if "step_s" in result:
            row.step_s.append(result["step_s"])
            result |= {"step_s": statistics.median(row.step_s), "flops": step_flops(args, row)}
        elif row.step_s:  # a repeat that failed: the table keeps the runs before it
            notes.append(f"{row.id}: run {len(row.step_s) + 1} failed: {outcome}")
            row.result = before
        if result["device"] and not args.tiny and result["device"] != device:
            notes.append(f"{row.id} ran on {result['device']}")
        args.out.write_text(format_table(args, rows, device, peak, notes))  # a cut run keeps rows
    notes.append(f"the whole table took {(time.perf_counter() - started) / 60:.1f} min")
    notes += [f"logs: {args.work_dir / 'logs'}", f"reference scripts: {args.reference_dir}"]
    table = format_table(args, rows, device, peak, notes)
    if goals(rows, peak):
        judged = " (on a CPU they mean nothing)" if args.tiny else ""
        table += f"\nGoals{judged}:\n\n" + "".join(f"- {goal}\n" for goal in goals(rows, peak))
    print(table)
    args.out.write_text(table)
    log(f"written to {args.out}")


if __name__ == "__main__":
    main()
