"""Shared helpers and fixtures for the training-script tests.

Nothing comes from the model hub: the tiny models, the tokenizer and the image folders are built
locally, once per test session. Heavy libraries are imported inside the functions that need them,
so collecting the tests stays fast.
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
import time
from functools import cache
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
DIGIT_NAMES = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")

# One scratch folder per session: the accelerate config and every HF cache live here, so no test
# reads or writes ~/.cache. Set for this process too, before any test imports datasets.
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


def require_deepspeed():
    """DeepSpeed is not installed on Windows (requirements.in): its tests skip there, and only there."""
    import importlib.util

    if importlib.util.find_spec("deepspeed") is None:
        pytest.skip("deepspeed is not installed on this platform")


def zero(stage):
    """`accelerate launch` flags for DeepSpeed ZeRO-`stage` (ZeRO-3 saving whole 16-bit weights)."""
    require_deepspeed()
    flags = ["--use_deepspeed", "--zero_stage", str(stage)]
    return flags + (["--zero3_save_16bit_model", "true"] if stage == 3 else [])


def run_script(script, args, *, num_processes=1, launch_args=(), expect_fail=False, env=None, timeout=900):
    """Run `script` (relative to REPO, or absolute) under `accelerate launch`; return its output.
    Fails the test on a non-zero exit, or on a zero one when `expect_fail` is set."""
    returncode, log, cmd = run_signalled(script, args, None, num_processes=num_processes, launch_args=launch_args,
                                         env=env, timeout=timeout)
    if (returncode != 0) != expect_fail:
        wanted = "a failure" if expect_fail else "success"
        pytest.fail(f"exit {returncode}, not {wanted}: {shlex.join(cmd)}\n{log[-8000:]}", False)
    return log


def run_signalled(script, args, when, *, num_processes=1, launch_args=(), env=None, timeout=900, launcher=True):
    """Run `script` as run_script does (or with plain `python` if not `launcher`); once the path `when` exists,
    send SIGTERM to its whole process group, as Slurm and a terminal do. Returns (exit status, output, command)."""
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", _accelerate_config()]
    launch += list(launch_args)
    run_env = {**os.environ, **HF_ENV}
    if "--use_deepspeed" in launch_args:  # on CPU processes: the script names gloo itself
        launch += ["--num_processes", str(num_processes), "--main_process_port", str(_free_port())]
    elif num_processes > 1:  # CPU processes over gloo, a fresh port so that runs never clash
        launch += ["--multi_gpu", "--num_processes", str(num_processes)]
        launch += ["--main_process_port", str(_free_port())]
        run_env["ACCELERATE_USE_CPU"] = "1"
    run_env.update(env or {})
    cmd = [*(launch if launcher else [sys.executable]), str(REPO / script), *map(str, args)]
    # a session of its own, so that a timeout kills the launcher and every rank it started
    with subprocess.Popen(
        cmd, cwd=REPO, env=run_env, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        start_new_session=True,
    ) as proc:  # fmt: skip
        try:
            if when is not None:
                deadline = time.monotonic() + timeout
                while not Path(when).exists() and proc.poll() is None and time.monotonic() < deadline:
                    time.sleep(0.05)
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGTERM)
            log = proc.communicate(timeout=timeout)[0]
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            log = proc.communicate()[0]
            pytest.fail(f"timed out: {shlex.join(cmd)}\n{log[-8000:]}", pytrace=False)
    return proc.returncode, log, cmd


@pytest.fixture
def run_in_process(monkeypatch, capsys):
    """Run a script's main() in this process on input that must stop it with one clear error
    before training; return the error. A second each, where a launched run spends ten on imports."""
    monkeypatch.syspath_prepend(str(REPO))

    def run(script, args):
        import importlib

        from accelerate.state import AcceleratorState

        module = importlib.import_module(Path(script).stem)
        try:
            with pytest.raises(SystemExit) as stop:
                module.main(module.parse_args([str(a) for a in args]))
        finally:
            AcceleratorState._reset_state(reset_partial_state=True)  # the next run builds its own
            # A refused ZeRO-3 launch has told transformers to shard every model it loads from now on.
            from transformers.integrations import unset_hf_deepspeed_config

            unset_hf_deepspeed_config()
        assert stop.value.code not in (0, None)
        capsys.readouterr()
        return str(stop.value.code)

    return run


def train_in_process(script, args):
    """Run a script's main() to its end in this process: a one-process run without the ten
    seconds of imports a launched one spends."""
    from accelerate.state import AcceleratorState

    module = import_script(Path(script).stem)
    try:
        module.main(module.parse_args([str(a) for a in args]))
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)  # the next run builds its own


def import_script(name):
    """A training script as a module, for its helpers."""
    sys.path.insert(0, str(REPO))
    try:
        import importlib

        return importlib.import_module(name)
    finally:
        sys.path.remove(str(REPO))


# ----------------------------------------------------------------------------- image folders


def digit_images(n, size=(40, 48)):
    """The first n scikit-learn digits as (RGB image of width x height, label) pairs. Not square,
    so that a random crop has somewhere to go."""
    from PIL import Image
    from sklearn.datasets import load_digits

    digits = load_digits()
    pairs = []
    for pixels, label in zip(digits.images[:n], digits.target[:n]):
        grey = Image.fromarray((pixels * 255 / 16).round().astype("uint8"))  # ink 0..16 -> 0..255
        pairs.append((grey.resize(size, Image.Resampling.BICUBIC).convert("RGB"), int(label)))
    return pairs


def caption(label):
    return f"a handwritten digit {DIGIT_NAMES[label]}"


def write_imagefolder(path, n, columns=("text", "label"), size=(40, 48)):
    """n digit PNGs (0000.png, ...) in `datasets`' imagefolder layout; metadata.jsonl gets
    `file_name` and `columns` (none: no metadata.jsonl). Returns the path as a str."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    rows = []
    for i, (image, label) in enumerate(digit_images(n, size)):
        image.save(path / f"{i:04d}.png")
        values = {"file_name": f"{i:04d}.png", "text": caption(label), "label": label}
        rows.append({key: values[key] for key in ("file_name", *columns)})
    if columns:
        (path / "metadata.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


@pytest.fixture(scope="session")
def digits_folder(tmp_path_factory):
    """12 captioned, labelled digits of 40 x 48 px."""
    return write_imagefolder(tmp_path_factory.mktemp("digits"), 12)


@pytest.fixture(scope="session")
def sd_folder(tmp_path_factory):
    """12 captioned digits of 72 x 80 px, for the 64 px Stable Diffusion runs."""
    return write_imagefolder(tmp_path_factory.mktemp("sd_digits"), 12, size=(72, 80))


@pytest.fixture(scope="session")
def demo_sd(tmp_path_factory):
    """data/make_tiny_sd.py's pipeline for the SD demos and its VAE's figures: the full build with
    FULL_RUNS=1, else one with a VAE of 300 steps (fewer draw bold strokes too thin to tell)."""
    out = tmp_path_factory.mktemp("demo-sd")
    sys.path.append(str(REPO / "data"))
    full = os.environ.get("FULL_RUNS") == "1"
    start = time.perf_counter()
    figures = __import__("make_tiny_sd").main(["--output_dir", str(out), *([] if full else ["--vae_steps", "300"])])
    print(f"\nbuilt the tiny pipeline in {time.perf_counter() - start:.0f} s")
    return out, figures


@pytest.fixture(scope="session")
def kohya_folder(tmp_path_factory):
    """12 digits of 72 x 80 px, each with its caption in a .txt file beside it (kohya's layout)."""
    path = Path(write_imagefolder(tmp_path_factory.mktemp("kohya"), 12, (), size=(72, 80)))
    for i, (_, label) in enumerate(digit_images(12)):
        (path / f"{i:04d}.txt").write_text(caption(label) + "\n")
    return str(path)


@pytest.fixture(scope="session")
def corrupt_folder(tmp_path_factory):
    path = write_imagefolder(tmp_path_factory.mktemp("corrupt"), 6)
    (Path(path) / "0003.png").write_bytes(b"not a png" * 10)
    return path


@pytest.fixture(scope="session")
def empty_folder(tmp_path_factory):
    return str(tmp_path_factory.mktemp("empty"))


# ----------------------------------------------------------------------------- tiny models

CAPTION_WORDS = ("a", "the", "of", "photo", "handwritten", "digit", "number", *DIGIT_NAMES)


def clip_tokenizer(folder, max_length=77):
    """A tiny CLIP tokenizer in which every caption word is one token: data/make_tiny_sd.py's."""
    if str(REPO / "data") not in sys.path:
        sys.path.append(str(REPO / "data"))  # its tools import each other as scripts do
    from make_tiny_sd import make_tokenizer

    return make_tokenizer(folder, CAPTION_WORDS, max_length)


def build_tiny_sd(vocab_dir, path):
    """A tiny Stable Diffusion 1.x-layout pipeline folder, random weights: a VAE of 4 blocks (it
    downsamples by 8 like SD's: 64 px images, 8 x 8 latents), a 2-block UNet, a 5-layer CLIP."""
    import torch
    from diffusers import AutoencoderKL, DDPMScheduler, StableDiffusionPipeline
    from diffusers import UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel

    torch.manual_seed(0)
    tokenizer = clip_tokenizer(vocab_dir)
    unet = UNet2DConditionModel(
        block_out_channels=(32, 64), layers_per_block=2, sample_size=8, in_channels=4,
        out_channels=4, down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"), cross_attention_dim=32,
        attention_head_dim=8, norm_num_groups=32,
    )  # fmt: skip
    vae = AutoencoderKL(
        block_out_channels=(32,) * 4, down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4, latent_channels=4, sample_size=64,
    )  # fmt: skip
    text_config = CLIPTextConfig(
        hidden_size=32, intermediate_size=37, num_hidden_layers=5, num_attention_heads=4,
        max_position_embeddings=77, vocab_size=len(tokenizer), projection_dim=32,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )  # fmt: skip
    scheduler = DDPMScheduler(  # SD 1.x's training schedule
        beta_schedule="scaled_linear", beta_start=0.00085, beta_end=0.012, clip_sample=False,
        steps_offset=1,
    )  # fmt: skip
    StableDiffusionPipeline(
        vae=vae, text_encoder=CLIPTextModel(text_config), tokenizer=tokenizer, unet=unet,
        scheduler=scheduler, safety_checker=None, feature_extractor=None,
        requires_safety_checker=False,
    ).save_pretrained(path)  # fmt: skip
    return str(path)


@pytest.fixture(scope="session")
def tiny_sd_path(tmp_path_factory):
    return build_tiny_sd(tmp_path_factory.mktemp("vocab"), tmp_path_factory.mktemp("tiny_sd"))


@pytest.fixture(scope="session")
def tiny_unet_config(tmp_path_factory):
    """The folder of a tiny UNet2DModel config for 32 px RGB images."""
    from diffusers import UNet2DModel

    unet = UNet2DModel(
        sample_size=32, layers_per_block=1, block_out_channels=(16, 32), norm_num_groups=8,
        down_block_types=("DownBlock2D", "AttnDownBlock2D"),
        up_block_types=("AttnUpBlock2D", "UpBlock2D"),
    )  # fmt: skip
    path = tmp_path_factory.mktemp("tiny_unet")
    unet.save_config(path)
    return str(path)


@pytest.fixture(scope="session")
def tiny_dit_config(tmp_path_factory):
    """The folder of a tiny DiTTransformer2DModel config: 2 blocks of width 32, patches of 2."""
    from diffusers import DiTTransformer2DModel

    dit = DiTTransformer2DModel(
        num_layers=2, num_attention_heads=2, attention_head_dim=16, in_channels=3,
        out_channels=3, sample_size=32, num_embeds_ada_norm=10, norm_num_groups=8,
    )  # fmt: skip
    path = tmp_path_factory.mktemp("tiny_dit")
    dit.save_config(path)
    return str(path)


# ----------------------------------------------------------------------------- comparing runs


def weights(folder, name="diffusion_pytorch_model.safetensors"):
    from safetensors.torch import load_file

    return load_file(f"{folder}/{name}")


def ema_weights(checkpoint, subfolder, index=0):
    """The EMA in a checkpoint (EMAModel's state_dict, which accelerate saves as registered object
    `index`), named as the parameters of the model in `checkpoint/subfolder`; and its step count."""
    import torch
    import diffusers

    state = torch.load(Path(checkpoint) / f"custom_checkpoint_{index}.pkl", weights_only=True)
    config = json.loads((Path(checkpoint) / subfolder / "config.json").read_text())
    model = getattr(diffusers, config["_class_name"]).from_pretrained(Path(checkpoint) / subfolder)
    names = [name for name, _ in model.named_parameters()]
    assert len(names) == len(state["shadow_params"])
    return dict(zip(names, state["shadow_params"])), state["optimization_step"]


def assert_same_ema(checkpoint, reference_checkpoint, subfolder):
    a, step = ema_weights(checkpoint, subfolder)
    b, reference_step = ema_weights(reference_checkpoint, subfolder)
    assert step == reference_step
    assert_same_weights(a, b)


def assert_same_weights(a, b):
    """Bit for bit: the same computation in the same order gives the same floats."""
    import torch

    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def assert_same_optimizer_state(checkpoint, reference_checkpoint):
    import torch

    opt, ref = (torch.load(Path(d) / "optimizer.bin", weights_only=False) for d in (checkpoint, reference_checkpoint))
    assert opt["state"].keys() == ref["state"].keys()
    for i, state in ref["state"].items():
        for name in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(opt["state"][i][name], state[name])


def resume_copy(out, checkpoint, resumed=None):
    """A new output_dir holding `checkpoint` of `out` alone: as if the run had died after it."""
    resumed = resumed or out.with_name(out.name + "-resumed")
    shutil.copytree(out / checkpoint, resumed / checkpoint)
    return resumed


def checkpoints(out):
    return sorted((p.name for p in Path(out).glob("checkpoint-*")), key=lambda n: int(n[11:]))
