"""Helpers of the diffusion scripts tested apart: the image decoder they share, validation in eval mode, and the
checkpoint hooks called with the lists accelerate passes them.

FSDP cannot run on a CPU through accelerate, so these hooks are tested as accelerate calls them: under
DeepSpeed and FSDP it hands the save hook an empty `weights` list and the load hook an empty `models`
list (it stores and loads the sharded model itself); under plain and DDP training it hands the weights.
DeepSpeed itself runs for real in the scripts' own tests.
"""
from argparse import Namespace

import pytest
import torch
from conftest import REPO


@pytest.mark.parametrize("script", ["train_unconditional", "train_text_to_image", "train_dit"])
def test_hooks_with_the_lists_each_backend_passes(script, tiny_unet_config_path, tiny_sd_path, tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(REPO))
    from accelerate import Accelerator
    from diffusers import DiTTransformer2DModel, UNet2DConditionModel, UNet2DModel
    from diffusers.training_utils import EMAModel

    hooks = __import__(script)
    folder = "transformer" if script == "train_dit" else "unet"  # where the hooks write the model
    if script == "train_unconditional":
        model = UNet2DModel.from_config(UNet2DModel.load_config(tiny_unet_config_path))
    elif script == "train_dit":
        model = DiTTransformer2DModel(num_attention_heads=2, attention_head_dim=8, in_channels=3, out_channels=3, num_layers=1,
                                      sample_size=8, patch_size=2, num_embeds_ada_norm=4)
    else:
        model = UNet2DConditionModel.from_pretrained(tiny_sd_path, subfolder="unet")
    accelerator, args = Accelerator(cpu=True), Namespace(foreach_ema=False, offload_ema=False)
    ema = EMAModel(model.parameters(), model_cls=type(model), model_config=model.config)

    hooks.save_model_hook(accelerator, args, ema, [model], [], tmp_path)  # DeepSpeed / FSDP: no weights to store
    assert (tmp_path / f"{folder}_ema").is_dir() and not (tmp_path / folder).exists()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ema.shadow_params[0].data.add_(1.0)
    hooks.load_model_hook(accelerator, args, ema, [], tmp_path)  # the backend loaded the model: only the EMA is read
    assert torch.equal(ema.shadow_params[0], next(model.parameters()).detach())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())

    weights = [model.state_dict()]  # plain and DDP: the UNet goes to unet/ and accelerate's copy is dropped
    hooks.save_model_hook(accelerator, args, ema, [model], weights, tmp_path)
    assert weights == [] and (tmp_path / folder / "config.json").is_file()
    with torch.no_grad():
        next(model.parameters()).add_(1.0)
    models = [model]
    hooks.load_model_hook(accelerator, args, ema, models, tmp_path)  # and is loaded back from there
    assert models == [] and all(torch.equal(before[k], v) for k, v in model.state_dict().items())


@pytest.mark.parametrize("script", ["train_unconditional", "train_dit", "train_text_to_image", "train_lora"])
def test_a_phone_photo_is_read_upright_and_a_broken_file_is_none(script, tmp_path, monkeypatch):
    """Cameras store a portrait photo sideways with an EXIF orientation; `datasets` turns it upright, so must we."""
    monkeypatch.syspath_prepend(str(REPO))
    from PIL import Image

    open_image = __import__(script).open_image
    upright = Image.new("RGB", (32, 64))
    upright.paste((255, 0, 0), (0, 0, 32, 16))  # red at the top
    exif = Image.Exif()
    exif[0x0112] = 6  # Orientation: rotate 90° clockwise to display
    upright.transpose(Image.Transpose.ROTATE_90).save(tmp_path / "photo.jpg", exif=exif, quality=95)
    data = (tmp_path / "photo.jpg").read_bytes()
    for item in [{"path": str(tmp_path / "photo.jpg"), "bytes": None}, {"path": None, "bytes": data}]:  # a folder, a hub dataset
        image = open_image(item).convert("RGB")
        assert image.size == (32, 64) and image.getpixel((16, 4))[0] > 200 and image.getpixel((16, 60))[0] < 50
    assert open_image({"path": None, "bytes": data[: len(data) // 2]}) is None  # cut short: fails only when decoded
    assert open_image({"path": str(tmp_path / "photo.jpg") + ".missing", "bytes": None}) is None


@pytest.mark.parametrize("script", ["train_unconditional", "train_text_to_image"])
def test_validation_samples_without_dropout_and_training_goes_on_with_it(script, tiny_unet_config_path, tiny_sd_path, tmp_path,
                                                                         monkeypatch):
    """A model config may set dropout: sampling in train mode would draw new dropout masks each time, so two
    validations of the same weights would differ. They must be equal, and the model back in train mode."""
    monkeypatch.syspath_prepend(str(REPO))
    import numpy as np
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from diffusers import DDPMScheduler, UNet2DConditionModel, UNet2DModel
    from PIL import Image
    from transformers import CLIPTextModel, CLIPTokenizer

    module = __import__(script)
    args = Namespace(output_dir=tmp_path, resolution=32, seed=0, validation_prompts=["a digit"], validation_sampler="ddim",
                     validation_inference_steps=2, eval_batch_size=1)
    if script == "train_unconditional":
        model, frozen = UNet2DModel.from_config({**UNet2DModel.load_config(tiny_unet_config_path), "dropout": 0.5}), []
    else:  # the VAE, text encoder and tokenizer come first in its log_validation
        model = UNet2DConditionModel.from_config({**UNet2DConditionModel.load_config(tiny_sd_path, subfolder="unet"), "dropout": 0.5})
        frozen = [cls.from_pretrained(tiny_sd_path, subfolder=name)
                  for cls, name in [(module.AutoencoderKL, "vae"), (CLIPTextModel, "text_encoder"), (CLIPTokenizer, "tokenizer")]]
    try:
        accelerator = Accelerator(cpu=True)
        for step in (1, 2):
            module.log_validation(accelerator, args, *frozen, model.train(), None, DDPMScheduler(), step, False)
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
    assert model.training
    first, second = (np.asarray(Image.open(tmp_path / "samples" / f"step-{step}.png")) for step in (1, 2))
    assert np.array_equal(first, second)
