"""Shared helpers and fixtures for the training-script tests.

Nothing comes from the model hub: the tiny models, the tokenizer and the image folders are
all built locally, once per test session. Heavy libraries (torch, diffusers, ...) are only
imported inside the functions that need them, so collecting the tests stays fast.
"""
import atexit
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from functools import cache
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
IMAGE_SIZE = 64
CORRUPT_FILE = "0003.png"
DIGIT_NAMES = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")

# One scratch folder per session (per process): the accelerate config and every HF cache live
# here, so no test reads or writes ~/.cache. It is set for this process too, before any test
# module imports datasets/transformers, which read these variables when they are imported.
SESSION_DIR = Path(tempfile.mkdtemp(prefix="diffusion-tests-"))
atexit.register(shutil.rmtree, SESSION_DIR, ignore_errors=True)
HF_ENV = {
    "HF_HUB_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "PYTHONUNBUFFERED": "1",
    "HF_HOME": str(SESSION_DIR / "hf_home"),
    "HF_DATASETS_CACHE": str(SESSION_DIR / "hf_home" / "datasets"),
}
os.environ.update(HF_ENV)


# ----------------------------------------------------------------------------- running scripts


@cache
def _accelerate_config():
    from accelerate.utils import write_basic_config

    path = SESSION_DIR / "accelerate_config.json"
    write_basic_config(mixed_precision="no", save_location=str(path))  # a CPU config here
    return str(path)


def _free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _fail(reason, cmd, log):
    pytest.fail(f"{reason}: {shlex.join(cmd)}\n--- last lines of the log ---\n{log[-8000:]}", pytrace=False)


def zero(stage):
    """`accelerate launch` flags for DeepSpeed ZeRO-`stage` (ZeRO-3 saving whole 16-bit weights at the end)."""
    return ["--use_deepspeed", "--zero_stage", str(stage)] + (["--zero3_save_16bit_model", "true"] if stage == 3 else [])


def run_script(script, args, *, num_processes=1, launch_args=(), expect_fail=False, env=None, timeout=900):
    """Run `script` (relative to REPO, or absolute) under `accelerate launch [launch_args]`; return its stdout+stderr.

    Fails the test if the exit code is non-zero, or zero when `expect_fail` is set.
    """
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", _accelerate_config(), *launch_args]
    run_env = {**os.environ, **HF_ENV}
    if "--use_deepspeed" in launch_args:
        # DeepSpeed on CPU processes: the script names gloo. ACCELERATE_USE_CPU would silently make it plain DDP.
        launch += ["--num_processes", str(num_processes), "--main_process_port", str(_free_port())]
    elif num_processes > 1:
        # Several CPU processes talking over gloo; a fresh port so runs never clash.
        launch += ["--multi_gpu", "--num_processes", str(num_processes), "--main_process_port", str(_free_port())]
        run_env["ACCELERATE_USE_CPU"] = "1"
    run_env.update(env or {})
    cmd = [*launch, str(REPO / script), *map(str, args)]  # REPO / an absolute path is that path
    # A session of its own, so a timeout can kill the launcher and all the ranks it started.
    with subprocess.Popen(
        cmd, cwd=REPO, env=run_env, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
    ) as proc:
        try:
            log = proc.communicate(timeout=timeout)[0]
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            _fail(f"timed out after {timeout} s", cmd, proc.communicate()[0])
    if (proc.returncode != 0) != expect_fail:
        expected = "a failure" if expect_fail else "success"
        _fail(f"exit code {proc.returncode}, expected {expected}", cmd, log)
    return log


@pytest.fixture
def run_in_process(monkeypatch, capsys):
    """Run a script's main() in this process, for inputs that must stop it with one clear error before training;
    return the error and what it printed. A second each, where a launched process spends ten on its imports."""
    monkeypatch.syspath_prepend(str(REPO))

    def run(script, args):
        import importlib

        from accelerate.state import AcceleratorState

        module = importlib.import_module(Path(script).stem)
        try:
            with pytest.raises(SystemExit) as stop:
                module.main(module.parse_args([str(a) for a in args]))
        finally:
            AcceleratorState._reset_state(reset_partial_state=True)  # the next run builds its own Accelerator
        assert stop.value.code not in (0, None)
        captured = capsys.readouterr()
        return f"{stop.value.code}\n{captured.out}{captured.err}"

    return run


# ----------------------------------------------------------------------------- image folders


def load_digits_images(n, size=IMAGE_SIZE):
    """The first n scikit-learn digits as (RGB PIL image of size x size, int label) pairs."""
    from PIL import Image
    from sklearn.datasets import load_digits

    digits = load_digits()
    pairs = []
    for pixels, label in zip(digits.images[:n], digits.target[:n]):
        gray = Image.fromarray((pixels * 255 / 16).round().astype("uint8"))  # ink 0..16 -> 0..255
        pairs.append((gray.resize((size, size), Image.Resampling.BICUBIC).convert("RGB"), int(label)))
    return pairs


def caption(label):
    return f"a handwritten digit {DIGIT_NAMES[label]}"


def write_imagefolder(path, n, columns=("text", "label")):
    """Write n digit PNGs (0000.png, ...) into `path`, in the `datasets` imagefolder format.

    metadata.jsonl gets `file_name` plus the chosen `columns` ("text" and/or "label");
    with no columns, no metadata.jsonl is written at all. Returns the path as a str.
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    rows = []
    for i, (image, label) in enumerate(load_digits_images(n)):
        name = f"{i:04d}.png"
        image.save(path / name)
        values = {"file_name": name, "text": caption(label), "label": label}
        rows.append({key: values[key] for key in ("file_name", *columns)})
    if columns:
        (path / "metadata.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


@pytest.fixture(scope="session")
def caption_folder(tmp_path_factory):
    return write_imagefolder(tmp_path_factory.mktemp("caption_folder"), 20)


@pytest.fixture(scope="session")
def label_folder(tmp_path_factory):
    return write_imagefolder(tmp_path_factory.mktemp("label_folder"), 6, columns=("label",))


@pytest.fixture(scope="session")
def nocaption_folder(tmp_path_factory):
    return write_imagefolder(tmp_path_factory.mktemp("nocaption_folder"), 6, columns=("label",))


@pytest.fixture(scope="session")
def plain_image_folder(tmp_path_factory):
    return write_imagefolder(tmp_path_factory.mktemp("plain_image_folder"), 6, columns=())


@pytest.fixture(scope="session")
def corrupt_image_folder(tmp_path_factory):
    path = write_imagefolder(tmp_path_factory.mktemp("corrupt_image_folder"), 6)
    (Path(path) / CORRUPT_FILE).write_bytes(b"not a png" * 10)
    return path


@pytest.fixture(scope="session")
def empty_folder(tmp_path_factory):
    return str(tmp_path_factory.mktemp("empty_folder"))


# ----------------------------------------------------------------------------- tiny models

CAPTION_WORDS = ("a", "the", "of", "photo", "handwritten", "digit", "number", *DIGIT_NAMES)


def _byte_symbols():
    """CLIP's byte-level alphabet: one printable unicode character for each of the 256 bytes."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    unprintable = [b for b in range(256) if b not in printable]
    symbols = {b: chr(b) for b in printable} | {b: chr(256 + i) for i, b in enumerate(unprintable)}
    return [symbols[b] for b in range(256)]


def write_clip_vocab(folder):
    """Write a tiny CLIP-style vocab.json and merges.txt into `folder`; return their paths.

    The vocab is the 256 byte symbols, the same with "</w>" (end of word), one token per
    merge, and the two special tokens. The merges join each of CAPTION_WORDS from the left,
    so every caption word becomes a single token; any other text falls back to bytes.
    """
    symbols = _byte_symbols()
    tokens = [*symbols, *(s + "</w>" for s in symbols)]
    merges = []
    for word in CAPTION_WORDS:
        parts = [*word[:-1], word[-1] + "</w>"]
        while len(parts) > 1:
            pair = f"{parts[0]} {parts[1]}"
            if pair not in merges:
                merges.append(pair)
                tokens.append(parts[0] + parts[1])
            parts[:2] = [parts[0] + parts[1]]
    tokens += ["<|startoftext|>", "<|endoftext|>"]
    vocab_file, merges_file = Path(folder) / "vocab.json", Path(folder) / "merges.txt"
    vocab_file.write_text(json.dumps({token: i for i, token in enumerate(tokens)}))
    merges_file.write_text("#version: 0.2\n" + "".join(m + "\n" for m in merges))
    return str(vocab_file), str(merges_file)


def _seeded(model_class, *args, **kwargs):
    """Build a model with freshly seeded random weights, so every fixture build is identical."""
    import torch

    torch.manual_seed(0)
    return model_class(*args, **kwargs)


@pytest.fixture(scope="session")
def tiny_sd_path(tmp_path_factory):
    return build_tiny_sd(tmp_path_factory.mktemp("clip_vocab"), tmp_path_factory.mktemp("tiny_sd"))


def build_tiny_sd(vocab_dir, path):
    """A tiny Stable Diffusion 1.x-layout pipeline folder (random weights, no safety checker).

    The VAE has 4 blocks like the real one, so it downsamples by 8 (pipe.vae_scale_factor == 8):
    64 px images give 8x8 latents. The UNet's sample_size is 8, so the pipeline's default
    resolution is 64 px, which keeps validation images cheap.
    """
    from diffusers import AutoencoderKL, DDPMScheduler, StableDiffusionPipeline, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer

    tokenizer = CLIPTokenizer(*write_clip_vocab(vocab_dir), model_max_length=77)
    unet = _seeded(
        UNet2DConditionModel,
        block_out_channels=(32, 64),
        layers_per_block=2,
        sample_size=IMAGE_SIZE // 8,
        in_channels=4,
        out_channels=4,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        cross_attention_dim=32,
        attention_head_dim=8,
        norm_num_groups=32,
    )
    vae = _seeded(
        AutoencoderKL,
        block_out_channels=(32, 32, 32, 32),
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4,
        latent_channels=4,
        sample_size=IMAGE_SIZE,
    )
    text_config = CLIPTextConfig(
        hidden_size=32,
        intermediate_size=37,
        num_hidden_layers=5,
        num_attention_heads=4,
        max_position_embeddings=77,
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        projection_dim=32,
    )
    # The SD 1.x training noise schedule.
    scheduler = DDPMScheduler(
        num_train_timesteps=1000,
        beta_schedule="scaled_linear",
        beta_start=0.00085,
        beta_end=0.012,
        prediction_type="epsilon",
        clip_sample=False,
        steps_offset=1,
    )
    pipe = StableDiffusionPipeline(
        vae=vae,
        text_encoder=_seeded(CLIPTextModel, text_config),
        tokenizer=tokenizer,
        unet=unet,
        scheduler=scheduler,
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )
    pipe.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def tiny_unet_config_path(tmp_path_factory):
    """A folder holding only the config.json of a tiny UNet2DModel for 32 px RGB images."""
    from diffusers import UNet2DModel

    unet = UNet2DModel(
        sample_size=32,
        in_channels=3,
        out_channels=3,
        layers_per_block=1,
        block_out_channels=(16, 32),
        down_block_types=("DownBlock2D", "AttnDownBlock2D"),
        up_block_types=("AttnUpBlock2D", "UpBlock2D"),
        norm_num_groups=8,
    )
    path = tmp_path_factory.mktemp("tiny_unet_config")
    unet.save_config(path)
    return str(path)


# Comparing training outputs

def unet_weights(folder):
    from safetensors.torch import load_file

    return load_file(f"{folder}/diffusion_pytorch_model.safetensors")


def assert_same_weights(a, b, rtol=1e-6, atol=1e-7):
    import torch

    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=rtol, atol=atol, msg=lambda m: f"{k}: {m}")


# Runs that sum the same gradients in another order (2 processes, accumulation) differ by float rounding.
# Adam's first steps are ~lr·g/|g|, which would blow that rounding up to full steps where the true gradient
# is 0 (a bias right before a normalization that removes it). --adam_epsilon 1e-4 keeps such gradients
# negligible; real ones still move each weight by ~1e-3 per step, 100x the tolerance below.
STABLE_ADAM = ["--adam_epsilon", "1e-4"]
EQUIVALENT = dict(rtol=1e-4, atol=1e-5)


def assert_resumes_exactly(script, args, out, checkpoint, **launch):
    """As if the run in `out` had stopped after `checkpoint`: copy that alone to a new output_dir, resume there with
    the same `args` and launch, and compare the final UNet with the uninterrupted run's. Returns the new folder."""
    resumed = out.with_name(out.name + "-resumed")
    shutil.copytree(out / checkpoint, resumed / checkpoint)
    run_script(script, [*args, "--output_dir", resumed, "--resume_from_checkpoint", "latest"], **launch)
    assert_same_weights(unet_weights(resumed / "unet"), unet_weights(out / "unet"))
    return resumed


def assert_same_optimizer_state(checkpoint, reference_checkpoint):
    """Adam's moments in two checkpoint folders are equal; returns both optimizer states."""
    import torch

    opt, opt_ref = (torch.load(Path(d) / "optimizer.bin", weights_only=False) for d in (checkpoint, reference_checkpoint))
    for i, state in opt_ref["state"].items():
        for name in ["exp_avg", "exp_avg_sq"]:
            torch.testing.assert_close(opt["state"][i][name], state[name], rtol=1e-6, atol=1e-12)
    return opt, opt_ref


NO_EMA = "holds no EMA weights (its run had no --use_ema): resume without --use_ema"  # the error on a copy_without_ema


def copy_without_ema(checkpoint, ema, copy):
    """A copy of `checkpoint` as a run without --use_ema writes it: no `ema` file or folder, none in its manifest."""
    shutil.copytree(checkpoint, copy, ignore=lambda folder, names: [ema] if Path(folder) == Path(checkpoint) else [])
    state = json.loads((Path(copy) / "training_state.json").read_text())
    state["files"] = {f: size for f, size in state["files"].items() if not f.startswith(ema)}
    (Path(copy) / "training_state.json").write_text(json.dumps(state))


def checkpoints(out):
    return sorted((p.name for p in out.glob("checkpoint-*")), key=lambda n: int(n.split("-")[1]))


def seed_logged(log):
    import re

    return int(re.search(r"Training with seed (\d+)", log).group(1))


def truncate(path):
    """Cut a file in half, as an interrupted copy leaves it."""
    data = Path(path).read_bytes()
    Path(path).write_bytes(data[: len(data) // 2])


def snapshot(folder):
    return sorted((str(p.relative_to(folder)), p.stat().st_mtime_ns) for p in folder.rglob("*"))
