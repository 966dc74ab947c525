"""The guides' stated results, rerun. Each test reads the number from the guide's own text and
runs the command it belongs to, so that a change to either the text or the code breaks it."""

import glob
import math
import re
import shlex
from pathlib import Path

import pytest
import torch
from conftest import REPO, import_script, run_script

GUIDE_1 = REPO / "docs" / "1-toy-linear.md"
W_LIST = r"\[([-\w., ]+)\]"
SUPERSCRIPT = str.maketrans("⁰¹²³⁴⁵⁶⁷⁸⁹⁻", "0123456789-")


def as_w(text):
    """[2.0018, 2.9973, nan, ...] as floats."""
    return [float(v) for v in text.split(",")]


def same_w(printed, stated):
    """The printed w (rounded to 4 places by the script) is the stated one, nan for nan."""
    return len(printed) == len(stated) and all(
        (math.isnan(a) and math.isnan(b)) or round(a, 4) == b for a, b in zip(printed, stated)
    )


def stated_number(text):
    """'1.3 × 10³²' or '0.0096' as a float."""
    mantissa, _, exponent = text.partition(" × 10")
    return float(mantissa) * 10 ** int(exponent.translate(SUPERSCRIPT) or 0)


def toy_run(tmp_path, capsys, flags, name="run"):
    """toy_linear.py with `flags`, in this process (a second, where a launch takes five): its
    printed w and its TensorBoard scalars {tag: {step: value}}."""
    from accelerate.state import AcceleratorState, GradientState
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    toy = import_script("toy_linear")
    out = tmp_path / name
    args = toy.parse_args([*flags, "--output_dir", str(out), "--checkpointing_steps", "100000"])
    capsys.readouterr()
    try:
        toy.train_plain(args) if args.plain else toy.main(args)
    finally:
        # The next run builds its own state, gradient accumulation included.
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()
    printed = re.findall(r"learned w: " + W_LIST, capsys.readouterr().out)
    assert len(printed) == 1
    scalars = {}
    for events in glob.glob(f"{out}/logs/**/events.out.tfevents.*", recursive=True):
        accumulator = EventAccumulator(events)
        accumulator.Reload()
        for tag in accumulator.Tags()["scalars"]:
            scalars[tag] = {e.step: e.value for e in accumulator.Scalars(tag)}
    return as_w(printed[0]), scalars


def table_rows():
    """Guide 1's 'Edit it yourself' rows: (flags, stated w)."""
    rows = re.findall(r"^\| `(--[^`]+)` \| " + W_LIST + r" \|", GUIDE_1.read_text(), re.MULTILINE)
    assert len(rows) >= 6
    return [(flags, as_w(w)) for flags, w in rows]


def test_the_default_w_is_the_one_the_guide_and_the_readme_state(tmp_path, capsys):
    w, _ = toy_run(tmp_path, capsys, ["--report_to", "none"])
    plain, _ = toy_run(tmp_path, capsys, ["--plain"], name="plain")
    guide = re.search(r"default run: .*?learned w = " + W_LIST, GUIDE_1.read_text(), re.DOTALL)
    readme = re.search(r"toy_linear.py` learns w = " + W_LIST, (REPO / "README.md").read_text())
    assert same_w(w, as_w(guide.group(1))) and same_w(w, as_w(readme.group(1)))
    assert plain == w  # --plain "gets the same numbers"


@pytest.mark.parametrize("flags, stated", table_rows(), ids=[f for f, _ in table_rows()])
def test_each_row_of_guide_1s_table_learns_the_w_it_states(tmp_path, capsys, flags, stated):
    w, _ = toy_run(tmp_path, capsys, [*shlex.split(flags), "--report_to", "none"])
    assert same_w(w, stated), f"{flags}: printed {w}, guide 1 states {stated}"


def test_lr_1_2_diverges_and_the_schedule_brings_it_back(tmp_path, capsys):
    text = " ".join(GUIDE_1.read_text().split())
    toy = import_script("toy_linear")
    x = toy.make_dataset(toy.parse_args([])).tensors[0]
    eigenvalues = torch.linalg.eigvalsh(2 * x.T @ x / len(x))
    low, high = re.search(r"its eigenvalues: ([\d.]+) to ([\d.]+)", text).groups()
    assert (f"{eigenvalues[0]:.2f}", f"{eigenvalues[-1]:.2f}") == (low, high)

    # "grows from A at step S to B at step P, the first step logged after ... lr under 1"
    found = re.search(
        r"lr 1\.2 the loss .*? grows from ([^a-z]+) at step (\d+) to ([^a-z]+) at step (\d+), .*?"
        r"lr under 1\. From then on the loss falls, to ([\d.]+) at step (\d+)",
        text,
    )
    start, first_step, peak, peak_step, end, last_step = found.groups()
    _, scalars = toy_run(tmp_path, capsys, ["--learning_rate", "1.2"])
    loss, lr = scalars["loss"], scalars["lr"]
    assert f"{loss[int(first_step)]:.1e}" == f"{stated_number(start):.1e}"
    top = max(loss, key=loss.get)
    assert top == int(peak_step) and f"{loss[top]:.1e}" == f"{stated_number(peak):.1e}"
    assert loss[top] > 1e6 * loss[int(first_step)]  # far above where it started
    assert lr[top - 10] > 1 > lr[top]  # the first read after lr fell under 1
    assert max(loss.keys()) == int(last_step) and f"{loss[int(last_step)]:.2g}" == end
    # The table's row says the same.
    row = next(line for line in text.split("| `") if line.startswith("--learning_rate 1.2`"))
    assert f"{peak} at step {peak_step}" in row


def test_lr_1_5_overflows_before_the_schedule_can_help(tmp_path, capsys):
    text = " ".join(GUIDE_1.read_text().split())
    found = re.search(
        r"lr 1\.5 the loss .*?\(inf from step (\d+)\), .*?nan from step (\d+)\), "
        r"while lr is still above ([\d.]+)",
        text,
    )
    inf_step, nan_step, lr_above = found.groups()
    _, scalars = toy_run(tmp_path, capsys, ["--learning_rate", "1.5"])
    loss, lr = scalars["loss"], scalars["lr"]
    assert min(s for s, v in loss.items() if math.isinf(v)) == int(inf_step)
    assert min(s for s, v in loss.items() if math.isnan(v)) == int(nan_step)
    assert lr[int(nan_step)] > float(lr_above)
    row = next(line for line in text.split("| `") if line.startswith("--learning_rate 1.5`"))
    assert f"inf from step {inf_step}, nan from step {nan_step}" in row


def test_two_processes_at_the_default_batch_learn_the_w_guide_1_states(tmp_path):
    """Two processes of 32 train on 64 a step, half the steps: close to one process's w, not it.
    (tests/test_toy_linear.py shows that 2 x 16 gives one process's w exactly.)"""
    text = " ".join(GUIDE_1.read_text().split())
    stated = as_w(re.search(r"without `--train_batch_size 16` learns w = " + W_LIST, text)[1])
    one = as_w(re.search(r"default run: .*?learned w = " + W_LIST, text)[1])
    log = run_script("toy_linear.py", ["--output_dir", tmp_path, "--report_to", "none"],
                     num_processes=2)  # fmt: skip
    printed = as_w(re.findall(r"learned w: " + W_LIST, log)[-1])
    assert same_w(printed, stated) and stated != one
    assert max(abs(a - b) for a, b in zip(stated, one)) < 1e-3


def test_accelerate_launch_without_a_config_runs_one_process_below_two_gpus():
    """Guide 1: `accelerate launch --num_processes 2` with no config turns on multi-GPU only when
    torch sees two GPUs or more; otherwise accelerate's simple launcher runs one process."""
    from accelerate.commands.config import default_config_file
    from accelerate.commands.launch import (
        _validate_launch_command,
        launch_command_parser,
    )

    text = " ".join(GUIDE_1.read_text().split())
    assert "`_validate_launch_command` in `accelerate/commands/launch.py`" in text
    if Path(default_config_file).exists():
        pytest.skip(f"an accelerate config exists: {default_config_file}")
    args = launch_command_parser().parse_args(["--num_processes", "2", "toy_linear.py"])
    args, _, _ = _validate_launch_command(args)
    assert args.multi_gpu == (torch.cuda.device_count() > 1)


def test_guide_4s_lines_draw_a_picture_at_the_buckets_shape(tiny_sd_path):
    """docs/4-text-to-image.md's ```py block on the tests' tiny SD pipeline, as written but for
    2 sampling steps of its 25."""
    guide = (REPO / "docs" / "4-text-to-image.md").read_text()
    block = re.search(r"```py\n(.*?)```", guide, re.DOTALL).group(1)
    assert '"sd-pairs"' in block and "--output_dir sd-pairs" in guide
    assert "num_inference_steps=25," in block
    block = block.replace('"sd-pairs"', repr(tiny_sd_path))
    block = block.replace("num_inference_steps=25,", "num_inference_steps=2,")
    namespace = {}
    exec(block, namespace)  # noqa: S102 (the guide's own lines)
    assert namespace["image"].size == (32, 16)  # PIL: (width, height)


def fused_adamw_launches(sizes, max_tensors=252, max_blocks=2240, chunk=65536):
    """Kernels one torch._fused_adamw_ call launches on a CUDA GPU for tensors of these sizes:
    multi_tensor_apply_for_fused_optimizer's rule (aten/src/ATen/native/cuda/MultiTensorApply.cuh,
    depth 4, large kernel arguments): launch when 252 tensors or 2,240 chunks are queued."""
    launches = blocks = tensors = 0
    for numel in sizes:
        tensors += 1
        chunks = -(-numel // chunk)
        for index in range(chunks):
            blocks += 1
            last = index == chunks - 1
            if (tensors == max_tensors and last) or blocks == max_blocks:
                launches, blocks, tensors = launches + 1, 0, 0 if last else 1
    return launches + (blocks > 0)


def test_the_sizes_and_kernel_counts_the_guides_state_for_sd_1_5():
    """SD 1.5's UNet (its config's differences from diffusers' defaults), built on the meta device:
    guide 2's tensors, numbers and fused AdamW kernels; guide 4's GB; guide 5's LoRA numbers."""
    from diffusers import UNet2DConditionModel
    from peft import LoraConfig

    with torch.device("meta"):
        unet = UNet2DConditionModel(cross_attention_dim=768, attention_head_dim=8, sample_size=64)
    sizes = [p.numel() for p in unet.parameters()]
    guide_2 = " ".join((REPO / "docs" / "2-unconditional.md").read_text().split())
    tensors, millions, kernels = re.search(
        r"UNet, (\d+) tensors of (\d+) M numbers in all, that rule gives (\d+) kernels", guide_2
    ).groups()
    assert (len(sizes), round(sum(sizes) / 1e6)) == (int(tensors), int(millions))
    assert fused_adamw_launches(sizes) == int(kernels)
    guide_4 = " ".join((REPO / "docs" / "4-text-to-image.md").read_text().split())
    fp32, bf16 = re.search(
        r"in fp32 \(([\d.]+) GB\).* a 16-bit copy \(([\d.]+) GB\)", guide_4
    ).groups()
    assert (f"{sum(sizes) * 4 / 1e9:.1f}", f"{sum(sizes) * 2 / 1e9:.1f}") == (fp32, bf16)
    targets = ["to_k", "to_q", "to_v", "to_out.0"]  # the LoRA script's default
    unet.add_adapter(LoraConfig(r=4, lora_alpha=4, target_modules=targets))
    lora = sum(p.numel() for name, p in unet.named_parameters() if "lora_" in name)
    guide_5 = " ".join((REPO / "docs" / "5-lora.md").read_text().split())
    stated = re.search(r"attention layers that is ([\d.]+) M numbers", guide_5)[1]
    assert f"{lora / 1e6:.1f}" == stated


def percent(value):
    return f"{value:.0%}".replace("%", " %")


def test_guide_3s_objectives_table_is_the_json_the_figure_reads():
    """docs/experiments.py dit_objectives wrote docs/figures/dit-objectives.json; guide 3's table
    quotes its shares, and docs/make_figures.py draws them."""
    import json

    results = json.loads((REPO / "docs" / "figures" / "dit-objectives.json").read_text())
    objectives = {"ε": "epsilon", "v": "v_prediction", "flow": "flow_prediction"}
    rows = re.findall(
        r"^\| (ε|v|flow), guidance (\d) +\|(.*)\|$",
        (REPO / "docs" / "3-dit.md").read_text(),
        re.MULTILINE,
    )
    assert len(rows) == 6
    for name, scale, cells in rows:
        stated = [cell.strip() for cell in cells.split("|")]
        keys = [
            f"{objectives[name]}, guidance {scale}, {steps} steps" for steps in (1, 2, 5, 10, 25)
        ]
        measured = [percent(results[key]["asked_for"]) for key in keys]
        assert stated == measured, f"{name}, guidance {scale}"


def test_guide_4s_and_the_readmes_bucket_shares_are_the_json_the_figure_reads():
    import json

    results = json.loads((REPO / "docs" / "figures" / "bucket-pairs.json").read_text())
    buckets, square = results["--aspect_ratio_buckets 16,32"], results["square crops (no flag)"]
    guide = " ".join((REPO / "docs" / "4-text-to-image.md").read_text().split())
    stated = re.search(
        r"With buckets, (\d+ %) of the 400 halves .*?and (\d+ %) of the 200 pictures have both "
        r"right\. With square crops, (\d+ %) and (\d+ %)",
        guide,
    ).groups()
    measured = [
        percent(v) for v in (buckets["halves"], buckets["both"], square["halves"], square["both"])
    ]
    assert list(stated) == measured
    readme = " ".join((REPO / "README.md").read_text().split())
    both = f"{measured[1]} have the digit asked for on both sides after training with buckets, "
    assert both + f"{measured[3]} after training on square crops" in readme


def test_guide_2s_held_out_numbers_are_the_json_the_figure_reads():
    """docs/experiments.py held_out wrote docs/figures/held-out.json; guide 2's section "The
    held-out loss" quotes its numbers, and docs/make_figures.py draws them."""
    import json

    results = json.loads((REPO / "docs" / "figures" / "held-out.json").read_text())
    curves, judged, cost = results["curves"], results["judged"], results["cost"]
    best, last = judged[str(results["best"])], judged[str(results["last"])]
    at_best = curves["step"].index(results["best"])
    guide = " ".join((REPO / "docs" / "2-unconditional.md").read_text().split())
    text = guide[guide.index("## The held-out loss") : guide.index("## 6 and 9.")]

    def loss(value):
        return f"{value:.4f}"

    def step(value):
        return f"{value:,}"

    stated = re.search(r"(\d+) trained and (\d+) held out, for ([\d,]+) steps", text).groups()
    assert stated == (str(results["trained"]), str(results["held_out"]), step(results["steps"]))
    assert f"a held-out loss every {results['every']} steps" in text
    stated = re.search(r"to (\d+\.\d+) over the last (\d+) steps", text).groups()
    assert stated == (loss(curves["train_loss"][-1]), str(results["every"]))
    stated = re.search(
        r"lowest at step ([\d,]+) \((\d+\.\d+)\), then climbs to (\d+\.\d+) at the last step, "
        r"([\d,]+)",
        text,
    ).groups()
    measured = (step(results["best"]), loss(best["val_loss"]), loss(last["val_loss"]))
    assert stated == (*measured, step(results["last"]))
    assert results["last"] == results["steps"] == curves["step"][-1]
    assert min(curves["val_loss"]) == best["val_loss"] == curves["val_loss"][at_best]
    stated = re.search(
        r"`val_loss_t0` grows from (\d+\.\d+) to (\d+\.\d+) while `val_loss_t3` falls from "
        r"(\d+\.\d+) to (\d+\.\d+)",
        text,
    ).groups()
    t0, t3 = curves["val_loss_t0"], curves["val_loss_t3"]
    assert stated == tuple(map(loss, (t0[at_best], t0[-1], t3[at_best], t3[-1])))
    stated = re.search(
        r"(\d+ %) are digits it is more than 90 % sure of at step ([\d,]+) and (\d+ %) at step "
        r"([\d,]+)\. But (\d+ %) of the last checkpoint's samples .*? against (\d+ %) at step "
        r"([\d,]+) and (\d+ %) for real digits",
        text,
    ).groups()
    best_step, last_step = step(results["best"]), step(results["last"])
    assert stated == (percent(best["share"]), best_step, percent(last["share"]), last_step,
                      percent(last["copies"]), percent(best["copies"]), best_step,
                      percent(results["real"]["copies"]))  # fmt: skip
    # "By the judge's score, no", and the held-out loss's pick "copies least of the four sampled".
    assert "By the judge's score, no" in text and best["share"] < last["share"]
    assert "copies least of the four sampled" in text and len(judged) == 4
    assert min(judged.values(), key=lambda row: row["copies"]) is best
    assert re.search(r"took (\d+\.\d+)× the CPU time", text)[1] == f"{cost['cpu_ratio']:.2f}"
    assert re.search(r"and (\d+\.\d+)× the clock time", text)[1] == f"{cost['ratio']:.2f}"
    # "All of the climb is at low noise": the other three quarters fall from the lowest point on.
    assert "All of the climb is at low noise" in text and t0[-1] > t0[at_best]
    assert all(curves[f"val_loss_t{q}"][-1] < curves[f"val_loss_t{q}"][at_best] for q in (1, 2, 3))
    assert f"{cost['steps']} steps of the README's demo" in text


def test_guide_1s_two_process_line_runs_two_processes_on_a_cpu(tmp_path):
    """The line people paste from guide 1's first block: two processes on a CPU, 16 images each, the w of one
    process of 32 (the README's), to the last printed digit."""
    import os
    import subprocess
    import sys

    from conftest import HF_ENV, _free_port

    block = re.search(r"```bash\n(.*?)```", GUIDE_1.read_text(), re.S).group(1)
    line = next(cmd for cmd in block.replace("\\\n", " ").splitlines() if "--num_processes 2" in cmd)
    words = shlex.split(line.split("#")[0])
    env = dict(word.split("=", 1) for word in words if "=" in word and not word.startswith("-"))
    words = [word for word in words if not ("=" in word and not word.startswith("-"))]
    assert words[:2] == ["accelerate", "launch"] and env == {"ACCELERATE_USE_CPU": "1"}
    command = [sys.executable, "-m", "accelerate.commands.launch", "--main_process_port", str(_free_port()),
               *words[2:], "--output_dir", str(tmp_path), "--report_to", "none"]
    log = subprocess.run(command, cwd=REPO, env={**os.environ, **HF_ENV, **env}, capture_output=True, text=True,
                         timeout=300)
    assert log.returncode == 0, log.stderr[-3000:]
    # One process of 16 would learn another w: 2 x 16 learns one process of 32's, the README's.
    readme = re.search(r"toy_linear.py` learns w = " + W_LIST, (REPO / "README.md").read_text())[1]
    printed = as_w(re.findall(r"learned w: " + W_LIST, log.stdout)[-1])
    assert same_w(printed, as_w(readme))


def test_dynamo_backend_is_a_flag_of_accelerate_launch_not_of_the_scripts(capsys):
    """The README lists `accelerate launch --dynamo_backend inductor` as the launcher's flag: the scripts'
    parsers refuse it, accelerate's launcher takes it."""
    from accelerate.commands.launch import launch_command_parser

    assert launch_command_parser().parse_args(["--dynamo_backend", "inductor", "x.py"]).dynamo_backend == "inductor"
    with pytest.raises(SystemExit):
        import_script("train_lora").parse_args(["--pretrained_model_name_or_path", "x", "--train_data_dir", "y",
                                                "--dynamo_backend", "inductor"])
    assert "unrecognized arguments: --dynamo_backend inductor" in capsys.readouterr().err
    assert "`accelerate launch --dynamo_backend inductor`" in " ".join((REPO / "README.md").read_text().split())


def test_diffusers_card_helper_fails_for_absolute_and_dot_paths_not_a_bare_name(tmp_path, monkeypatch):
    """docs/reference.md: diffusers' load_or_create_model_card looks for the card on the Hub first; a local
    folder named by an absolute or ./ path is no repository id (offline, as here: a bare name is looked up,
    not found, and a card is made)."""
    from diffusers.utils.hub_utils import load_or_create_model_card
    from huggingface_hub.errors import HFValidationError

    text = " ".join((REPO / "docs" / "reference.md").read_text().split())
    assert "it fails for an absolute or `./` path, which is not a repository id (a bare folder name passes)" in text
    (tmp_path / "out").mkdir()
    monkeypatch.chdir(tmp_path)
    for path in (str(tmp_path / "out"), "./out"):
        with pytest.raises(HFValidationError):
            load_or_create_model_card(path, from_training=True)
    assert load_or_create_model_card("out", from_training=True).data.library_name == "diffusers"


def test_one_process_accelerate_launch_signalled_checkpoints_the_step_it_is_in(tmp_path, tiny_unet_config):
    """A one-process `accelerate launch` whose steps are slow (0.1 s a micro-batch), its process group signalled
    after step 1: whatever the launcher does (accelerate 1.15 dies at once, 1.16 gives the script 5 s), the script
    checkpoints the step it is in (under load, the log shows step 1 a few steps late), not the next read of the
    loss (step 10), and writes the file `stopped`. Both
    signals, in two launches side by side."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from conftest import HF_ENV, _accelerate_config, write_imagefolder

    folder = write_imagefolder(tmp_path / "digits", 8)
    (tmp_path / "slow.py").write_text(
        "import sys, time, torch\n"
        f"sys.path.insert(0, {str(REPO)!r})\n"
        "import train_unconditional as script\n"
        "randn_like = torch.randn_like\n"
        "torch.randn_like = lambda x: time.sleep(0.1) or randn_like(x)\n"
        "script.main(script.parse_args())\n"
    )
    launches = {}
    for signum in ("SIGTERM", "SIGINT"):
        out = tmp_path / signum
        command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", _accelerate_config(),
                   tmp_path / "slow.py", "--train_data_dir", folder, "--resolution", "32", "--logger", "none",
                   "--model_config_name_or_path", tiny_unet_config, "--max_train_steps", "40",
                   "--ddpm_num_inference_steps", "1", "--eval_batch_size", "1", "--train_batch_size", "2",
                   "--output_dir", out]
        with open(tmp_path / f"{signum}.log", "w") as log:
            launches[signum] = subprocess.Popen(list(map(str, command)), env={**os.environ, **HF_ENV}, stdout=log,
                                                stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 300
    for signum, launcher in launches.items():
        while " 1/40 " not in (tmp_path / f"{signum}.log").read_text() and time.monotonic() < deadline:
            time.sleep(0.05)  # the first step is done
        os.killpg(launcher.pid, getattr(signal, signum))
    for signum, launcher in launches.items():
        assert launcher.wait(30) != 0
        out = tmp_path / signum
        # The script may outlive the launcher that it was started by (accelerate 1.15): until its save is whole.
        while not any(out.glob("checkpoint-*")) and time.monotonic() < deadline:
            time.sleep(0.1)
        while any(out.glob("tmp-checkpoint-*")) and time.monotonic() < deadline:
            time.sleep(0.1)
        step = int(sorted(out.glob("checkpoint-*"))[-1].name.split("-")[1])
        assert (out / "stopped").read_text() == f"Stopped by {signum}" and 1 <= step < 10, step
