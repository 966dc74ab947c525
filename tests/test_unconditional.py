"""train_unconditional.py: exact resume (1 and 2 processes, DeepSpeed ZeRO-2), the checkpoint contract,
the output users load, each process's own noise, spawned workers, the loss weights, bad input, and stopping
(a signal saves the run, a diverged loss stops it)."""

import math
import os
import shutil
import signal

import pytest
import torch
from conftest import (require_deepspeed, REPO, assert_same_ema, assert_same_optimizer_state, assert_same_weights, checkpoints,
                      ema_weights, import_script,
                      resume_copy, run_script, run_signalled, train_in_process, weights, zero)

SCRIPT = "train_unconditional.py"


@pytest.fixture(scope="module")
def common(digits_folder, tiny_unet_config):
    """12 images of 40 x 48 px, randomly cropped to 32 and flipped; EMA, min-SNR, clipping; batches
    of 4 make 3 steps an epoch, so checkpoint-4 falls inside the second epoch."""
    return ["--train_data_dir", digits_folder, "--model_config_name_or_path", tiny_unet_config,
            "--resolution", "32", "--random_flip", "--use_ema", "--snr_gamma", "5", "--max_grad_norm", "0.5",
            "--learning_rate", "1e-3", "--lr_warmup_steps", "2", "--max_train_steps", "6",
            "--checkpointing_steps", "2", "--checkpoints_total_limit", "2", "--ddpm_num_inference_steps", "2",
            "--eval_batch_size", "2", "--save_images_epochs", "1", "--logger", "tensorboard"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory, common):
    out = tmp_path_factory.mktemp("uncond") / "ref"
    train_in_process(SCRIPT, common + ["--train_batch_size", "4", "--output_dir", out])
    return out


def assert_same_run(out, reference):
    for sub in ["checkpoint-6/unet", "unet"]:
        assert_same_weights(weights(out / sub), weights(reference / sub))
    assert_same_ema(out / "checkpoint-6", reference / "checkpoint-6", "unet")
    assert_same_optimizer_state(out / "checkpoint-6", reference / "checkpoint-6")


def test_resume_is_exact_and_skips_a_half_written_checkpoint(reference, common, caplog):
    caplog.set_level("INFO")
    out = resume_copy(reference, "checkpoint-4")
    (out / "tmp-checkpoint-5" / "unet").mkdir(parents=True)  # a save that died halfway
    train_in_process(SCRIPT, common + ["--train_batch_size", "4", "--output_dir", out, "--resume_from_checkpoint", "latest"])
    assert f"Resumed from {out}/checkpoint-4" in caplog.text
    assert_same_run(out, reference)


def test_checkpoint_contract_and_the_pipeline_users_load(reference):
    from diffusers import DDPMPipeline, UNet2DModel

    assert checkpoints(reference) == ["checkpoint-4", "checkpoint-6"]  # rotation kept the last two
    assert not list(reference.glob("tmp-*"))
    UNet2DModel.from_pretrained(reference / "checkpoint-6", subfolder="unet")
    averaged, step = ema_weights(reference / "checkpoint-6", "unet")  # the EMA, as accelerate saved it
    assert step == 6
    raw, final = weights(reference / "checkpoint-6" / "unet"), weights(reference / "unet")
    assert any(not torch.equal(raw[k], averaged[k]) for k in averaged)
    assert_same_weights({k: final[k] for k in averaged}, averaged)  # the final pipeline holds the EMA weights
    pipeline = DDPMPipeline.from_pretrained(reference)
    images = pipeline(batch_size=2, num_inference_steps=2, generator=torch.manual_seed(0), output_type="np").images
    assert images.shape == (2, 32, 32, 3)
    assert sorted(p.name for p in (reference / "samples").iterdir()) == ["step-3.png", "step-6.png"]
    assert list((reference / "logs").rglob("events.out.tfevents.*"))


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory, common):
    """A run on 2 processes, each recording the noise ε it draws."""
    out = tmp_path_factory.mktemp("uncond2") / "ref"
    launcher = out.parent / "record_noise.py"
    launcher.write_text(
        "import os, sys, torch\n"
        f"sys.path.insert(0, {str(REPO)!r})\n"
        "import train_unconditional as script\n"
        "randn_like = torch.randn_like\n"
        "def record(x):\n"
        "    noise = randn_like(x)\n"
        f"    torch.save(noise, {str(out.parent)!r} + f'/noise-{{os.environ[\"RANK\"]}}.pt')\n"
        "    return noise\n"
        "torch.randn_like = record\n"
        "script.main(script.parse_args())\n"
    )
    run_script(launcher, common + ["--train_batch_size", "2", "--output_dir", out], num_processes=2)
    return out


def slow_launcher(folder):
    """train_unconditional.py with a pause before each micro-batch's noise, so that a signal lands mid-run."""
    launcher = folder / "slow.py"
    launcher.write_text(
        "import sys, time, torch\n"
        f"sys.path.insert(0, {str(REPO)!r})\n"
        "import train_unconditional as script\n"
        "randn_like = torch.randn_like\n"
        "def slow(x):\n"
        "    time.sleep(0.5)\n"
        "    return randn_like(x)\n"
        "torch.randn_like = slow\n"
        "script.main(script.parse_args())\n"
    )
    return launcher


def test_each_process_draws_its_own_noise(two_processes):
    """Seeded per process: the Diffusers text-to-image examples, given --seed, seed every process alike, so that
    every GPU adds the same ε to its images."""
    noise = [torch.load(two_processes.parent / f"noise-{rank}.pt") for rank in (0, 1)]
    assert noise[0].shape == noise[1].shape and not torch.equal(*noise)


def test_deepspeed_zero2_stops_on_sigterm_and_resumes_exactly(common, tmp_path):
    out = tmp_path / "zero2"
    args = common + ["--train_batch_size", "2", "--max_train_steps", "6", "--checkpointing_steps", "2"]
    run_script(SCRIPT, args + ["--output_dir", out], num_processes=2, launch_args=zero(2))
    resumed = tmp_path / "signalled"
    status, log, _ = run_signalled(slow_launcher(tmp_path), args + ["--output_dir", resumed], resumed / "checkpoint-2",
                                   num_processes=2, launch_args=zero(2))
    assert status != 0 and "Stopped at step " in log, log[-3000:]
    run_script(SCRIPT, args + ["--output_dir", resumed, "--resume_from_checkpoint", "latest"], num_processes=2,
               launch_args=zero(2))
    assert_same_weights(weights(resumed / "unet"), weights(out / "unet"))


def test_spawned_dataloader_workers_train_the_same_weights(reference, common, tmp_path):
    """Workers started by spawn (as on macOS and Windows) unpickle the transform; the batches are
    the same, and so is every random draw."""
    import multiprocessing

    out = tmp_path / "workers"
    method = multiprocessing.get_start_method()
    multiprocessing.set_start_method("spawn", force=True)
    try:
        train_in_process(SCRIPT, common + ["--train_batch_size", "4", "--output_dir", out, "--dataloader_num_workers", "1"])
    finally:
        multiprocessing.set_start_method(method, force=True)
    assert_same_run(out, reference)


def test_min_snr_weights_cap_the_easy_timesteps():
    """Min-SNR-γ's properties, not its formula: for ε the weight is 1 where SNR(t) ≤ γ and falls past it
    (the nearly clean timesteps count less); for v it is min(SNR, γ)/(SNR + 1), below 1 everywhere."""
    from diffusers import DDPMScheduler
    from diffusers.training_utils import compute_snr

    script = import_script("train_unconditional")
    t = torch.arange(1000)
    epsilon, v = DDPMScheduler(prediction_type="epsilon"), DDPMScheduler(prediction_type="v_prediction")
    snr = compute_snr(epsilon, t)  # falls with t: t = 0 is nearly clean
    hard = snr <= 5.0
    assert 0 < hard.sum() < 1000  # both regimes are present
    weights = script.min_snr_weights(epsilon, t, 5.0)
    assert torch.all(weights[hard] == 1)
    easy = weights[~hard]  # as t falls the SNR grows and the weight shrinks
    assert torch.all(easy < 1) and torch.all(easy.flip(0)[1:] <= easy.flip(0)[:-1])
    v_weights = script.min_snr_weights(v, t, 5.0)
    torch.testing.assert_close(v_weights * (snr + 1), torch.minimum(snr, torch.tensor(5.0)))
    assert torch.all(v_weights < 1)
    # On x_0 (the paper's own form): min(SNR, γ) itself.
    sample = DDPMScheduler(prediction_type="sample")
    torch.testing.assert_close(script.min_snr_weights(sample, t, 5.0), torch.minimum(snr, torch.tensor(5.0)))


def test_sample_prediction_trains_on_x0_as_the_official_example(common, tmp_path, monkeypatch):
    """--prediction_type sample (the official script's x_0-prediction): the loss's target is the clean image
    x_0 (randn_like's input), and the saved pipeline's scheduler says what the UNet predicts."""
    from diffusers import DDPMPipeline

    seen = {"x_0": [], "target": []}
    randn_like, mse_loss = torch.randn_like, torch.nn.functional.mse_loss

    def record_noise(x):
        seen["x_0"].append(x.clone())
        return randn_like(x)

    def record_target(prediction, target, **kwargs):
        seen["target"].append(target.clone())
        return mse_loss(prediction, target, **kwargs)

    monkeypatch.setattr(torch, "randn_like", record_noise)
    monkeypatch.setattr(torch.nn.functional, "mse_loss", record_target)
    out = tmp_path / "sample"
    train_in_process(SCRIPT, common + ["--train_batch_size", "4", "--output_dir", out, "--prediction_type", "sample",
                                       "--max_train_steps", "2"])
    assert len(seen["target"]) == 2
    for x_0, target in zip(seen["x_0"], seen["target"]):
        assert torch.equal(target, x_0)
    assert DDPMPipeline.from_pretrained(out).scheduler.config.prediction_type == "sample"


# The commands of the Diffusers example's README (examples/unconditional_image_generation/README.md), flags as
# the shell passes them. Adapted for an offline CPU: the hub dataset becomes a local digits imagefolder, --push_to_hub is dropped
# (no network), --logger=wandb becomes tensorboard (wandb is not installed) and fp16 becomes no (a CPU has none),
# `accelerate launch --multi_gpu` becomes one process; then 2 steps, a tiny UNet and 2 sampling steps.
README_COMMANDS = {
    "flowers": ["--dataset_name=huggan/flowers-102-categories", "--resolution=64", "--center_crop", "--random_flip",
                "--output_dir=ddpm-ema-flowers-64", "--train_batch_size=16", "--num_epochs=100",
                "--gradient_accumulation_steps=1", "--use_ema", "--learning_rate=1e-4", "--lr_warmup_steps=500",
                "--mixed_precision=no", "--push_to_hub"],
    "pokemon": ["--dataset_name=huggan/pokemon", "--resolution=64", "--center_crop", "--random_flip",
                "--output_dir=ddpm-ema-pokemon-64", "--train_batch_size=16", "--num_epochs=100",
                "--gradient_accumulation_steps=1", "--use_ema", "--learning_rate=1e-4", "--lr_warmup_steps=500",
                "--mixed_precision=no", "--push_to_hub"],
    "multi-gpu": ["--dataset_name=huggan/pokemon", "--resolution=64", "--center_crop", "--random_flip",
                  "--output_dir=ddpm-ema-pokemon-64", "--train_batch_size=16", "--num_epochs=100",
                  "--gradient_accumulation_steps=1", "--use_ema", "--learning_rate=1e-4", "--lr_warmup_steps=500",
                  "--mixed_precision=fp16", "--logger=wandb"],
}


@pytest.mark.parametrize("name", README_COMMANDS)
def test_the_diffusers_readme_commands_run(name, digits_folder, tiny_unet_config, tmp_path):
    from diffusers import DDPMPipeline

    offline = {"--push_to_hub": [], "--logger=wandb": ["--logger=tensorboard"],
               "--mixed_precision=fp16": ["--mixed_precision=no"]}
    args = [new for arg in README_COMMANDS[name] for new in offline.get(arg, [arg])]
    args = [f"--train_data_dir={digits_folder}" if a.startswith("--dataset_name") else a for a in args]
    args = [f"--output_dir={tmp_path / a.split('=')[1]}" if a.startswith("--output_dir") else a for a in args]
    train_in_process(SCRIPT, args + ["--max_train_steps", "2", "--model_config_name_or_path", tiny_unet_config,
                                     "--ddpm_num_inference_steps", "2", "--eval_batch_size", "2"])
    out = next(tmp_path.iterdir())
    assert DDPMPipeline.from_pretrained(out).unet.config.sample_size == 32  # the tiny UNet, trained on 64 px
    assert (out / "samples" / "step-2.png").exists()


def test_the_official_flags_keep_their_meaning():
    script = import_script("train_unconditional")
    args = script.parse_args(["--train_data_dir=x", "--adam_beta1=0.8", "--ema_power=0.5", "--logging_dir=runs",
                              "--overwrite_output_dir", "--local_rank=0", "--save_model_epochs=3", "--cache_dir=c"])
    assert (args.adam_beta1, args.ema_power, args.logging_dir, args.save_model_epochs) == (0.8, 0.5, "runs", 3)
    defaults = script.parse_args(["--train_data_dir=x"])  # the Diffusers example's
    assert (defaults.adam_beta1, defaults.adam_beta2, defaults.adam_epsilon, defaults.adam_weight_decay) == \
        (0.95, 0.999, 1e-8, 1e-6)


@pytest.mark.parametrize("flag, expected", [
    (["--hub_token", "hf_x"], "--hub_token is left out: a token in a command lands in shell history"),
    (["--preserve_input_precision"], "--preserve_input_precision is left out: images are read as 8-bit RGB"),
])
def test_a_refused_official_flag_ends_in_one_line(flag, expected, capsys):
    with pytest.raises(SystemExit):
        import_script("train_unconditional").parse_args(["--train_data_dir", "x", *flag])
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error.split(": error: ", 1)[1].startswith(expected)


def test_an_ignored_official_flag_runs(digits_folder, tiny_unet_config, tmp_path):
    from diffusers import DDPMPipeline

    out = tmp_path / "xformers"
    train_in_process(SCRIPT, ["--train_data_dir", digits_folder, "--model_config_name_or_path", tiny_unet_config,
                              "--resolution", "32", "--max_train_steps", "1", "--ddpm_num_inference_steps", "1",
                              "--eval_batch_size", "1", "--logger", "none", "--output_dir", out,
                              "--enable_xformers_memory_efficient_attention"])
    DDPMPipeline.from_pretrained(out)


@pytest.fixture(scope="module")
def victim(reference, tmp_path_factory):
    """A copy of the reference run's output, for the inputs that concern an output_dir."""
    out = tmp_path_factory.mktemp("victim") / "out"
    shutil.copytree(reference, out)
    (out / "checkpoint-4" / "optimizer.bin").write_bytes(b"truncated")
    return out


@pytest.mark.parametrize("case, expected", [
    ("no_such_dir", "error: --train_data_dir /no/such/dir: no such folder"),
    ("empty_dir", "error: --train_data_dir "),
    ("column", "error: no column 'img'; the dataset has ['image', 'text', 'label']"),
    ("corrupt_image", "error: image "),
    ("model_config", "error: --model_config_name_or_path /no/such/config: "),
    ("fp16_on_cpu", "error: --mixed_precision fp16 needs a GPU"),
    ("missing_checkpoint", "error: --resume_from_checkpoint {victim}/checkpoint-99: "),
    ("corrupt_checkpoint", "error: --resume_from_checkpoint {victim}/checkpoint-4: "),
    ("push_to_hub_offline", "error: --push_to_hub: "),
    ("zero3", "error: launch with DDP or DeepSpeed ZeRO-1/2, not FSDP or ZeRO-3"),
])
def test_bad_input_is_one_clear_error_before_training(case, expected, victim, digits_folder, corrupt_folder, empty_folder,
                                                       tiny_unet_config, run_in_process, monkeypatch, tmp_path):
    # A finished run's folder for the resumes; for the rest a fresh folder that holds a user's file.
    if "checkpoint" not in case:
        victim = tmp_path / "fresh"
        victim.mkdir()
        (victim / "notes.txt").write_text("my notes")
    args = ["--train_data_dir", digits_folder, "--model_config_name_or_path", tiny_unet_config, "--resolution", "32",
            "--output_dir", victim, "--logger", "none", "--max_train_steps", "2", "--train_batch_size", "6"]
    changes = {"no_such_dir": ["--train_data_dir", "/no/such/dir"], "empty_dir": ["--train_data_dir", empty_folder],
               "column": ["--image_column", "img"], "corrupt_image": ["--train_data_dir", corrupt_folder],
               "model_config": ["--model_config_name_or_path", "/no/such/config"],
               "fp16_on_cpu": ["--mixed_precision", "fp16"], "missing_checkpoint": ["--resume_from_checkpoint", "checkpoint-99"],
               "corrupt_checkpoint": ["--resume_from_checkpoint", "checkpoint-4"], "push_to_hub_offline": ["--push_to_hub"]}
    if case == "zero3":  # what `accelerate launch --use_deepspeed --zero_stage 3` tells the script
        require_deepspeed()
        monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
        monkeypatch.setenv("ACCELERATE_DEEPSPEED_ZERO_STAGE", "3")
    before = sorted((str(p), p.stat().st_mtime_ns) for p in victim.rglob("*"))
    error = run_in_process(SCRIPT, args + changes.get(case, []))
    assert error.startswith(expected.format(victim=victim)) and "\n" not in error
    if case == "corrupt_image":
        assert "0003.png: UnidentifiedImageError: " in error  # the file, and why it cannot be read
    assert sorted((str(p), p.stat().st_mtime_ns) for p in victim.rglob("*")) == before  # nothing written


def test_fsdp_is_refused(digits_folder, tiny_unet_config, tmp_path, run_in_process, monkeypatch):
    """FSDP cannot run on these machines' CPUs (REFERENCE.md), so the script refuses it in one line."""
    from accelerate import Accelerator, DistributedType

    monkeypatch.setattr(Accelerator, "distributed_type", property(lambda self: DistributedType.FSDP))
    error = run_in_process(SCRIPT, ["--train_data_dir", digits_folder, "--output_dir", tmp_path])
    assert error == "error: launch with DDP or DeepSpeed ZeRO-1/2, not FSDP or ZeRO-3"


def test_a_dataset_is_required(capsys):
    with pytest.raises(SystemExit):
        import_script("train_unconditional").parse_args(["--resolution", "32"])
    assert "one of the arguments --dataset_name --train_data_dir is required" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # one source, not two
        import_script("train_unconditional").parse_args(["--dataset_name", "a", "--train_data_dir", "b"])
    assert "argument --train_data_dir: not allowed with argument --dataset_name" in capsys.readouterr().err


# ----------------------------------------------------------------------------- stopping: signals and divergence


@pytest.fixture(scope="module")
def stop_args(digits_folder, tiny_unet_config):
    """12 steps of 2 micro-batches of 2 (3 steps an epoch), EMA and min-SNR; checkpoints at steps 5 and 10, so that
    the loss is read at 5, 10 and 12."""
    return ["--train_data_dir", digits_folder, "--model_config_name_or_path", tiny_unet_config, "--resolution", "32",
            "--random_flip", "--use_ema", "--snr_gamma", "5", "--learning_rate", "1e-3", "--lr_warmup_steps", "2",
            "--train_batch_size", "2", "--gradient_accumulation_steps", "2", "--max_train_steps", "12",
            "--checkpointing_steps", "5", "--save_images_epochs", "9", "--ddpm_num_inference_steps", "2",
            "--eval_batch_size", "1", "--logger", "none"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, stop_args):
    out = tmp_path_factory.mktemp("uninterrupted") / "out"
    train_in_process(SCRIPT, stop_args + ["--output_dir", out])
    return out


@pytest.fixture
def signal_handlers():
    """The process's own SIGTERM and SIGINT handlers, put back after a run in this process installed its own."""
    saved = {signum: signal.getsignal(signum) for signum in (signal.SIGTERM, signal.SIGINT)}
    yield
    for signum, handler in saved.items():
        signal.signal(signum, handler)


def signal_on_call(monkeypatch, owner, name, calls):
    """SIGTERM to this process at the given calls (1 = the first) of owner.name, just before it runs."""
    original, count = getattr(owner, name), [0]

    def signalled(*args, **kwargs):
        count[0] += 1
        if count[0] in calls:
            os.kill(os.getpid(), signal.SIGTERM)
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, signalled)


@pytest.mark.parametrize("moment", ["between_steps", "mid_accumulation", "mid_save"])
def test_a_signal_at_any_moment_saves_and_the_resume_is_exact(moment, stop_args, uninterrupted, tmp_path, caplog,
                                                              monkeypatch, signal_handlers):
    """SIGTERM after the first optimizer step, inside the first micro-batch of two, or during the checkpoint save
    at step 5: with one process the run saves at the end of that optimizer step (step 1; step 6 for the save at
    5), not at the next read of the loss (step 3), and exits with 75; resumed, it ends bit-equal to the
    uninterrupted run."""
    from accelerate import Accelerator
    from accelerate.scheduler import AcceleratedScheduler

    caplog.set_level("INFO")
    out = tmp_path / "out"
    with monkeypatch.context() as patch:
        if moment == "between_steps":
            signal_on_call(patch, AcceleratedScheduler, "step", {1})
        elif moment == "mid_accumulation":
            signal_on_call(patch, torch, "randn_like", {1})
        else:
            signal_on_call(patch, Accelerator, "save_state", {1})
        with pytest.raises(SystemExit) as stop:
            train_in_process(SCRIPT, stop_args + ["--output_dir", out])
    assert stop.value.code == 75
    stopped = 6 if moment == "mid_save" else 1
    assert f"Stopped at step {stopped}: go on with --resume_from_checkpoint latest" in caplog.text
    assert checkpoints(out)[-1] == f"checkpoint-{stopped}"
    train_in_process(SCRIPT, stop_args + ["--output_dir", out, "--resume_from_checkpoint", "latest"])
    assert_same_weights(weights(out / "unet"), weights(uninterrupted / "unet"))
    assert_same_ema(out / "checkpoint-10", uninterrupted / "checkpoint-10", "unet")
    assert_same_optimizer_state(out / "checkpoint-10", uninterrupted / "checkpoint-10")


def test_a_diverged_loss_stops_the_run_before_a_checkpoint_keeps_it(stop_args, tmp_path, run_in_process,
                                                                      signal_handlers):
    """An absurd learning rate: the run stops at the first read of an inf or NaN loss, with one line; every
    checkpoint written before it holds finite weights, and none is written after."""
    out = tmp_path / "out"
    args = stop_args + ["--output_dir", out, "--learning_rate", "1e30", "--checkpointing_steps", "1"]
    error = run_in_process(SCRIPT, args)
    assert error.startswith("error: the loss is ") and "resume an earlier checkpoint with a lower " \
        "--learning_rate" in error and "\n" not in error
    step = int(error.split(" at step ")[1].split(":")[0])
    assert not math.isfinite(float(error.split("the loss is ")[1].split(" ")[0]))
    assert checkpoints(out) == [f"checkpoint-{n}" for n in range(1, step)]
    for name in checkpoints(out):
        assert all(torch.isfinite(v).all() for v in weights(out / name / "unet").values()), name


def test_an_epoch_end_save_reads_the_loss_first(stop_args, tmp_path, run_in_process, signal_handlers):
    """Epochs of 3 steps, a pipeline saved at every epoch's end and no checkpoint before step 5: the diverged
    loss is read at the first epoch's end, before that save, and nothing non-finite reaches the disk."""
    out = tmp_path / "out"
    args = stop_args + ["--output_dir", out, "--learning_rate", "1e30", "--save_model_epochs", "1"]
    error = run_in_process(SCRIPT, args)
    assert error.startswith("error: the loss is ") and " at step 3:" in error
    assert not list(out.rglob("*.safetensors"))


def test_resuming_the_checkpoint_of_the_last_step_trains_no_more(stop_args, tmp_path, signal_handlers):
    """11 steps, 3 an epoch: the last step falls inside an epoch, where the resumed loop used to train one more."""
    out = tmp_path / "out"
    args = stop_args + ["--max_train_steps", "11", "--checkpointing_steps", "11"]
    train_in_process(SCRIPT, args + ["--output_dir", out])
    resumed = resume_copy(out, "checkpoint-11")
    train_in_process(SCRIPT, args + ["--output_dir", resumed, "--resume_from_checkpoint", "latest"])
    assert_same_weights(weights(resumed / "unet"), weights(out / "unet"))


def test_rotation_writes_the_new_checkpoint_before_it_removes_the_old(stop_args, tmp_path, monkeypatch,
                                                                      signal_handlers):
    """With --checkpoints_total_limit 1 a kill during a save must still find the previous checkpoint whole."""
    from accelerate import Accelerator

    out, on_disk = tmp_path / "out", []
    save_state = Accelerator.save_state

    def record(self, *args, **kwargs):
        on_disk.append(checkpoints(out))
        return save_state(self, *args, **kwargs)

    monkeypatch.setattr(Accelerator, "save_state", record)
    train_in_process(SCRIPT, stop_args + ["--output_dir", out, "--checkpoints_total_limit", "1"])
    assert on_disk == [[], ["checkpoint-5"]] and checkpoints(out) == ["checkpoint-10"]


def test_a_signal_before_the_first_step_ends_the_run_at_once(stop_args, tmp_path, monkeypatch, caplog,
                                                             signal_handlers):
    """Ctrl-C while the dataset loads (latent caching takes hours on a large folder): status 75 at once, one line,
    nothing trained or saved, and the file a scheduler reads to requeue."""
    import train_unconditional

    caplog.set_level("INFO")
    out = tmp_path / "out"
    signal_on_call(monkeypatch, train_unconditional, "load_datasets", {1})
    monkeypatch.setattr(os, "kill", lambda pid, signum, kill=os.kill: kill(pid, signal.SIGINT))
    with pytest.raises(SystemExit) as stop:
        train_in_process(SCRIPT, stop_args + ["--output_dir", out])
    assert stop.value.code == 75
    assert "Stopped by SIGINT: go on with --resume_from_checkpoint latest" in caplog.text
    assert [p.name for p in out.iterdir()] == ["stopped"]


def test_a_signal_during_validation_stops_right_after_it(stop_args, uninterrupted, tmp_path, monkeypatch, caplog,
                                                          signal_handlers):
    """Validation at the end of epoch 0 (step 3): a signal during it stops the run at the next step's end, 4,
    with a checkpoint (the stop comes before validation); resumed, the run ends as the uninterrupted one."""
    import train_unconditional

    caplog.set_level("INFO")
    out = tmp_path / "out"
    signal_on_call(monkeypatch, train_unconditional, "log_validation", {1})
    with pytest.raises(SystemExit) as stop:
        train_in_process(SCRIPT, stop_args + ["--output_dir", out])
    assert stop.value.code == 75 and checkpoints(out) == ["checkpoint-4"]
    assert "Stopped at step 4: go on with --resume_from_checkpoint latest" in caplog.text
    monkeypatch.undo()
    train_in_process(SCRIPT, stop_args + ["--output_dir", out, "--resume_from_checkpoint", "latest"])
    assert_same_weights(weights(out / "unet"), weights(uninterrupted / "unet"))
    assert not (out / "stopped").exists()


def test_a_signal_during_the_final_save_lets_it_complete(stop_args, uninterrupted, tmp_path, monkeypatch,
                                                         signal_handlers):
    from diffusers import DDPMPipeline

    out = tmp_path / "out"
    signal_on_call(monkeypatch, DDPMPipeline, "save_pretrained", {2})  # epoch 0's save, then the final one
    train_in_process(SCRIPT, stop_args + ["--output_dir", out])
    assert_same_weights(weights(out / "unet"), weights(uninterrupted / "unet"))
    assert not (out / "stopped").exists()


def test_a_second_signal_ends_the_run_at_once(stop_args, tmp_path, monkeypatch, caplog, signal_handlers):
    """The first SIGTERM asks for a checkpoint; a second, a second later, during that save, ends the run at once:
    the save is never renamed into place, and the file says the run was stopped."""
    import time

    from accelerate import Accelerator
    from accelerate.scheduler import AcceleratedScheduler

    caplog.set_level("INFO")
    out = tmp_path / "out"
    signal_on_call(monkeypatch, AcceleratedScheduler, "step", {1})
    save_state = Accelerator.save_state

    def second(self, *args, **kwargs):
        time.sleep(1.1)  # a repeat within 1 s is torchrun passing on the first
        os.kill(os.getpid(), signal.SIGTERM)
        return save_state(self, *args, **kwargs)

    monkeypatch.setattr(Accelerator, "save_state", second)
    with pytest.raises(SystemExit) as stop:
        train_in_process(SCRIPT, stop_args + ["--output_dir", out])
    assert stop.value.code == 75 and checkpoints(out) == []
    assert "Stopped by SIGTERM: go on with --resume_from_checkpoint latest" in caplog.text
    assert (out / "stopped").exists()


def test_the_file_stopped_is_written_when_the_signal_arrives(stop_args, tmp_path, monkeypatch, signal_handlers):
    """torchrun kills the processes 30 s after it passes a signal on: the file a scheduler requeues by is there
    before the checkpoint is written, not only after it."""
    from accelerate import Accelerator
    from accelerate.scheduler import AcceleratedScheduler

    out, seen = tmp_path / "out", []
    signal_on_call(monkeypatch, AcceleratedScheduler, "step", {1})
    save_state = Accelerator.save_state

    def record(self, *args, **kwargs):
        seen.append((out / "stopped").exists())
        return save_state(self, *args, **kwargs)

    monkeypatch.setattr(Accelerator, "save_state", record)
    with pytest.raises(SystemExit):
        train_in_process(SCRIPT, stop_args + ["--output_dir", out])
    assert seen == [True] and (out / "stopped").read_text() == "Stopped by SIGTERM"
