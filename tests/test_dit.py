"""train_dit.py: the checkpoint contract, exact resume, two processes, the paper's fixes, guidance, output, bad input."""
import json
import re
import shutil
from argparse import Namespace

import numpy as np
import pytest
import torch
from conftest import (EQUIVALENT, NO_EMA, REPO, STABLE_ADAM, assert_same_optimizer_state, assert_same_weights, checkpoints,
                      copy_without_ema, load_digits_images, run_script, snapshot, unet_weights)
from PIL import Image

SCRIPT = "train_dit.py"


@pytest.fixture(scope="module")
def dit(monkeypatch_module):
    return __import__("train_dit")


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(REPO))
        yield mp


@pytest.fixture(scope="module")
def tiny_dit_config_path(tmp_path_factory):
    """A folder holding only the config.json of a tiny DiT: 2 blocks of width 32, patches of 2, RGB."""
    from diffusers import DiTTransformer2DModel

    path = tmp_path_factory.mktemp("tiny_dit_config")
    DiTTransformer2DModel(num_attention_heads=2, attention_head_dim=16, in_channels=3, out_channels=3, num_layers=2,
                          sample_size=16, patch_size=2, num_embeds_ada_norm=10).save_config(path)
    return str(path)


@pytest.fixture(scope="module")
def common(label_folder, tiny_dit_config_path):
    """6 images of the classes 0..5 at 16 px; random crop and flip; a third of the labels dropped; 3 steps per epoch
    at batch 2; cosine schedule with warmup; a checkpoint every 2 steps, at most 3 kept."""
    return ["--train_data_dir", label_folder, "--model_config_name_or_path", tiny_dit_config_path,
            "--resolution", "16", "--random_flip", "--use_ema", "--ema_max_decay", "0.9", "--seed", "0",
            "--class_dropout_prob", "0.3", "--learning_rate", "1e-3", "--lr_scheduler", "cosine", "--lr_warmup_steps", "2",
            "--max_train_steps", "8", "--checkpointing_steps", "2", "--checkpoints_total_limit", "3",
            "--num_inference_steps", "2", "--eval_batch_size", "1", "--save_images_epochs", "100",
            "--save_model_epochs", "100", "--max_grad_norm", "0.1", *STABLE_ADAM]


@pytest.fixture(scope="module")
def reference(tmp_path_factory, common):
    """One uninterrupted run: checkpoint-4 falls one batch into the second epoch."""
    out = tmp_path_factory.mktemp("dit") / "ref"
    run_script(SCRIPT, common + ["--train_batch_size", "2", "--output_dir", out])
    return out


def test_rotation_keeps_the_last_checkpoints_and_the_output_is_complete(reference):
    assert checkpoints(reference) == ["checkpoint-4", "checkpoint-6", "checkpoint-8"]
    assert json.loads((reference / "id2label.json").read_text()) == {str(i): str(i) for i in range(6)}
    config = json.loads((reference / "transformer" / "config.json").read_text())
    assert config["num_embeds_ada_norm"] == 6 and config["out_channels"] == 3 and config["sample_size"] == 16
    assert json.loads((reference / "scheduler" / "scheduler_config.json").read_text())["_class_name"] == "DDIMScheduler"
    assert_same_weights(unet_weights(reference / "transformer"), unet_weights(reference / "checkpoint-8" / "transformer_ema"), rtol=0)
    # a row per validation class (0..5), one image each, enlarged 4x: at the first epoch (step 3) and at the end
    for step in [3, 8]:
        assert Image.open(reference / "samples" / f"step-{step}.png").size == (64 + 2 * 2, 6 * 64 + 7 * 2)


def test_resume_is_exact_and_ignores_partial_checkpoints(reference, common, tmp_path):
    out = tmp_path / "resumed"
    shutil.copytree(reference / "checkpoint-4", out / "checkpoint-4")
    # a save that crashed halfway leaves only its temporary folder, which `latest` must not pick
    (out / "tmp-checkpoint-8" / "transformer").mkdir(parents=True)
    log = run_script(SCRIPT, common + ["--train_batch_size", "2", "--output_dir", out, "--resume_from_checkpoint", "latest"])
    assert f"Resuming from {out / 'checkpoint-4'}" in log
    assert checkpoints(out) == ["checkpoint-4", "checkpoint-6", "checkpoint-8"] and not (out / "tmp-checkpoint-8").exists()
    # the label dropout draws replay too: a different draw would train a different model
    for sub in ["transformer", "transformer_ema"]:
        assert_same_weights(unet_weights(out / "checkpoint-8" / sub), unet_weights(reference / "checkpoint-8" / sub))
    assert_same_weights(unet_weights(out / "transformer"), unet_weights(reference / "transformer"))
    assert_same_optimizer_state(out / "checkpoint-8", reference / "checkpoint-8")


def test_a_resumed_run_at_its_limit_still_trains_one_step_and_rotates(reference, common, tmp_path):
    out = tmp_path / "at_limit"
    for name in ["checkpoint-6", "checkpoint-8"]:
        shutil.copytree(reference / name, out / name)
    log = run_script(SCRIPT, common + ["--train_batch_size", "2", "--output_dir", out, "--resume_from_checkpoint", "latest",
                                       "--checkpointing_steps", "9", "--checkpoints_total_limit", "2"])
    assert f"Resuming from {out / 'checkpoint-8'}" in log and f"Saved state to {out / 'checkpoint-9'}" in log
    assert checkpoints(out) == ["checkpoint-8", "checkpoint-9"]


def test_two_processes_match_one_with_the_same_global_batch(reference, common, tmp_path):
    out = tmp_path / "ddp"
    run_script(SCRIPT, common + ["--train_batch_size", "1", "--output_dir", out, "--checkpoints_total_limit", "1"],
               num_processes=2)
    assert checkpoints(out) == ["checkpoint-8"]  # rotation ran on the main process only
    assert_same_weights(unet_weights(out / "checkpoint-8" / "transformer"), unet_weights(reference / "checkpoint-8" / "transformer"),
                        **EQUIVALENT)
    assert_same_weights(unet_weights(out / "transformer"), unet_weights(reference / "transformer"), **EQUIVALENT)


def test_the_saved_transformer_and_scheduler_sample_what_validation_showed(reference, dit):
    """Reloaded, the final transformer (EMA weights) and scheduler draw the last validation grid pixel for pixel."""
    import torchvision
    from diffusers import DDIMScheduler, DiTTransformer2DModel

    transformer = DiTTransformer2DModel.from_pretrained(reference / "transformer").eval()
    scheduler = DDIMScheduler.from_pretrained(reference / "scheduler")
    images = dit.sample_images(transformer, scheduler, torch.arange(6), 4.0, 2, generator=torch.Generator("cpu").manual_seed(0))
    grid = torch.nn.functional.interpolate(images, scale_factor=4, mode="nearest")
    torchvision.utils.save_image(grid, reference / "reloaded.png", nrow=1)
    assert np.array_equal(np.asarray(Image.open(reference / "reloaded.png")), np.asarray(Image.open(reference / "samples" / "step-8.png")))


def test_validation_samples_without_dropout_and_training_goes_on_with_it(dit, tmp_path):
    """A config may set dropout (DDPM's CIFAR-10 model had 0.1): validation draws what the model draws in eval mode,
    then the model is back in train mode. (The same lines in the other scripts' log_validation.)"""
    import torchvision
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from diffusers import DDIMScheduler, DDPMScheduler, DiTTransformer2DModel

    DiTTransformer2DModel(num_attention_heads=2, attention_head_dim=16, in_channels=3, out_channels=3, num_layers=2, sample_size=16,
                          patch_size=2, num_embeds_ada_norm=10, dropout=0.5).save_config(tmp_path / "config")
    model = dit.build_transformer(Namespace(model_config_name_or_path=tmp_path / "config", model_type=None, resolution=16), 6, None)
    with torch.no_grad():  # past adaLN-Zero's start, where every block is the identity and dropout changes nothing
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    args = Namespace(validation_class_labels=[0, 1], eval_batch_size=1, cache_latents=False, validation_sampler="ddim",
                     guidance_scale=4.0, num_inference_steps=2, output_dir=tmp_path, resolution=16)
    try:
        dit.log_validation(Accelerator(), args, model.train(), None, DDPMScheduler(), 5, False, None)
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
    assert model.training
    images = dit.sample_images(model.eval(), DDIMScheduler(), torch.tensor([0, 1]), 4.0, 2, generator=torch.Generator("cpu").manual_seed(0))
    torchvision.utils.save_image(torch.nn.functional.interpolate(images, scale_factor=4, mode="nearest"), tmp_path / "eval.png", nrow=1)
    assert np.array_equal(np.asarray(Image.open(tmp_path / "eval.png")), np.asarray(Image.open(tmp_path / "samples" / "step-5.png")))


def test_a_fresh_model_is_adaln_zero_and_drops_no_labels_itself(dit, tiny_dit_config_path):
    args = Namespace(model_config_name_or_path=tiny_dit_config_path, model_type=None, resolution=16)
    model = dit.build_transformer(args, 6, None).train()
    assert model.config.num_embeds_ada_norm == 6 and model.config.out_channels == 3
    x, t, y = torch.randn(16, 3, 16, 16), torch.arange(16) * 60, torch.arange(16) % 7
    assert torch.equal(model(x, t, y).sample, torch.zeros_like(x))  # every block the identity, the output layer 0
    with torch.no_grad():  # once trained, the output depends on the label, the same in every forward pass (no dropout inside)
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    torch.manual_seed(0)
    outputs = [model(x, t, torch.full((16,), label)).sample for label in (0, 0, 1, 6)]
    assert torch.equal(outputs[0], outputs[1]) and not torch.allclose(outputs[0], outputs[2]) and not torch.allclose(outputs[0], outputs[3])
    big = dit.build_transformer(Namespace(model_config_name_or_path=None, model_type="DiT-S/8", resolution=32), 1000, None)
    block = big.transformer_blocks[0]
    assert (len(big.transformer_blocks), big.inner_dim, block.attn1.heads, big.config.patch_size) == (12, 384, 6, 8)
    # in a VAE's latent space (4 channels, 8x smaller): ∅ is row 1000, where DiTPipeline asks for it, whatever the classes
    vae = Namespace(config=Namespace(latent_channels=4, block_out_channels=[64] * 4))
    latent = dit.build_transformer(Namespace(model_config_name_or_path=tiny_dit_config_path, model_type=None, resolution=64), 6, vae)
    assert (latent.config.num_embeds_ada_norm, latent.config.in_channels, latent.config.out_channels, latent.config.sample_size) == (1000, 4, 4, 8)


def test_dit_xl_2_counts_the_papers_flops(dit):
    """DiT-XL/2 at 256 px (32 x 32 latents), built on the meta device (no memory): the counted forward is twice the
    paper's 118.6 Gflops, which are multiply-adds; forward and backward, as the script logs them, are three forwards."""
    from torch.utils.flop_counter import FlopCounterMode

    vae = Namespace(config=Namespace(latent_channels=4, block_out_channels=[64] * 4))
    with torch.device("meta"):
        model = dit.build_transformer(Namespace(model_config_name_or_path=None, model_type="DiT-XL/2", resolution=256), 1000, vae)
        inputs = torch.randn(1, 4, 32, 32), torch.tensor([500]), torch.tensor([3])
    with FlopCounterMode(display=False) as counter:
        model(*inputs)
    forward = counter.get_total_flops()
    assert abs(forward / 2 / 118.6e9 - 1) < 0.005
    assert abs(dit.training_flops(model, Namespace(gradient_checkpointing=False), *inputs) / forward - 3) < 0.005


def test_labels_are_dropped_once_per_image_at_the_requested_rate(dit, tmp_path):
    from torchvision import transforms

    Image.new("L", (16, 16)).save(tmp_path / "x.png")
    n = 4000
    examples = {"image": [{"bytes": None, "path": str(tmp_path / "x.png")}] * n, "label": [i % 5 for i in range(n)],
                dit.ROW: list(range(n))}
    args = Namespace(image_column="image", label_column="label", seed=0, preserve_input_precision=False, ddpm_num_steps=1000,
                     class_dropout_prob=0.3, pretrained_vae_model_name_or_path=None, cache_latents=False)
    draw = dict(examples=examples, args=args, train_transforms=transforms.ToTensor(), in_channels=1, noise_shape=(1, 16, 16),
                null_class=5, weight_dtype=torch.float32)
    labels = torch.stack(dit.preprocess_train(**draw, epoch=0)["class_labels"])
    dropped = labels == 5
    assert abs(dropped.float().mean().item() - 0.3) < 0.03  # 4000 draws: ±0.007 is one standard deviation
    assert torch.equal(labels[~dropped], torch.tensor(examples["label"])[~dropped])  # the others keep their class
    assert torch.equal(torch.stack(dit.preprocess_train(**draw, epoch=0)["class_labels"]), labels)  # seeded per image
    assert not torch.equal(torch.stack(dit.preprocess_train(**draw, epoch=1)["class_labels"]), labels)  # new draws each epoch


def test_guidance_mixes_the_conditional_and_the_null_prediction(dit):
    """Guided sampling with both halves in one batch equals ε(x, ∅) + s·(ε(x, y) − ε(x, ∅)) computed in two batches:
    at s = 1 the conditional prediction alone, at s = 0 the unconditional one."""
    from diffusers import DDIMScheduler, DiTTransformer2DModel

    torch.manual_seed(0)  # diffusers' random initialisation: the outputs depend on the label
    model = DiTTransformer2DModel(num_attention_heads=2, attention_head_dim=16, in_channels=3, out_channels=3, num_layers=2,
                                  sample_size=16, patch_size=2, num_embeds_ada_norm=6).eval()
    y, null = torch.tensor([0, 2, 5]), torch.full((3,), 6)

    def by_hand(scale):
        scheduler = DDIMScheduler()
        scheduler.set_timesteps(3)
        x = torch.randn((3, 3, 16, 16), generator=torch.Generator().manual_seed(1))
        for t in scheduler.timesteps:
            with torch.no_grad():
                conditional, unconditional = (model(x, t.expand(3), labels).sample for labels in (y, null))
            epsilon = {1.0: conditional, 0.0: unconditional}.get(scale, unconditional + scale * (conditional - unconditional))
            x = scheduler.step(epsilon, t, x).prev_sample
        return (x / 2 + 0.5).clamp(0, 1)

    for scale in [1.0, 0.0, 4.0]:
        ours = dit.sample_images(model, DDIMScheduler(), y, scale, 3, generator=torch.Generator().manual_seed(1))
        torch.testing.assert_close(ours, by_hand(scale), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(by_hand(1.0), by_hand(0.0))


@pytest.fixture(scope="module")
def class_subfolders(tmp_path_factory):
    """The ImageNet layout: one subfolder per class, named."""
    path = tmp_path_factory.mktemp("class_subfolders")
    for i, (image, label) in enumerate(load_digits_images(6)):
        folder = path / ["zero", "one", "two"][label % 3]
        folder.mkdir(exist_ok=True)
        image.save(folder / f"{i}.png")
    return str(path)


@pytest.fixture(scope="module")
def tiny_vae_path(tmp_path_factory):
    """A pipeline folder holding only a tiny VAE (4 latent channels, downsampling 2), in vae/."""
    from diffusers import AutoencoderKL

    path = tmp_path_factory.mktemp("sd")
    torch.manual_seed(0)
    AutoencoderKL(block_out_channels=(8, 8), down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
                  latent_channels=4, norm_num_groups=8, sample_size=16).save_pretrained(path / "vae")
    return str(path)


def test_with_a_vae_the_output_is_a_dit_pipeline_that_guides_with_the_trained_null_class(dit, class_subfolders, tiny_dit_config_path,
                                                                                         tiny_vae_path, tmp_path):
    from diffusers import DDIMScheduler, DiTPipeline, DiTTransformer2DModel

    out = tmp_path / "out"
    run_script(SCRIPT, ["--train_data_dir", class_subfolders, "--model_config_name_or_path", tiny_dit_config_path,
                        "--pretrained_vae_model_name_or_path", tiny_vae_path, "--vae_subfolder", "vae", "--resolution", "16",
                        "--train_batch_size", "2", "--max_train_steps", "3", "--learning_rate", "1e-2", "--num_inference_steps", "2",
                        "--eval_batch_size", "1", "--checkpointing_steps", "3", "--output_dir", out, "--seed", "0", "--report_to", "none"])
    pipe = DiTPipeline.from_pretrained(out)
    assert pipe.transformer.config.num_embeds_ada_norm == 1000 and pipe.get_label_ids(["one", "two", "zero"]) == [0, 1, 2]
    images = pipe(class_labels=[0, 2], guidance_scale=4.0, num_inference_steps=2, generator=torch.manual_seed(0), output_type="np").images
    assert images.shape == (2, 16, 16, 3) and np.isfinite(images).all()
    # the same guided samples as the script's own sampler draws from the checkpoint: DiTPipeline's ∅ (1000) is the trained one
    trained = DiTTransformer2DModel.from_pretrained(out / "checkpoint-3" / "transformer").eval()
    ours = dit.sample_images(trained, DDIMScheduler.from_pretrained(out, subfolder="scheduler"), torch.tensor([0, 2]), 4.0, 2, pipe.vae,
                             torch.manual_seed(0))
    np.testing.assert_allclose(images, ours.permute(0, 2, 3, 1).numpy(), rtol=0, atol=1e-5)


def test_cached_latents_train_the_weights_of_an_uncached_run(class_subfolders, tiny_dit_config_path, tiny_vae_path, tmp_path):
    """--cache_latents: the VAE encodes each image once, both orientations, before training (and not in the loop: 0
    FLOPs there); the transformer ends as in a run that encodes every step, up to float reordering."""
    args = ["--train_data_dir", class_subfolders, "--model_config_name_or_path", tiny_dit_config_path, "--pretrained_vae_model_name_or_path",
            tiny_vae_path, "--vae_subfolder", "vae", "--resolution", "16", "--center_crop", "--random_flip", "--class_dropout_prob", "0.3",
            "--train_batch_size", "2", "--max_train_steps", "4", "--learning_rate", "1e-3", "--num_inference_steps", "1",
            "--eval_batch_size", "1", "--checkpointing_steps", "100", "--seed", "0", "--report_to", "none", *STABLE_ADAM]
    run_script(SCRIPT, args + ["--output_dir", tmp_path / "plain"])
    log = run_script(SCRIPT, args + ["--output_dir", tmp_path / "cached", "--cache_latents"])
    assert "Cached the encodings of 6 images" in log and re.search(r"frozen VAE 0$", log, re.MULTILINE)
    assert_same_weights(unet_weights(tmp_path / "cached" / "transformer"), unet_weights(tmp_path / "plain" / "transformer"), **EQUIVALENT)


@pytest.fixture(scope="module")
def victim(reference, tmp_path_factory):
    """An output_dir with a checkpoint that no bad command may touch, and a checkpoint of another script."""
    out = tmp_path_factory.mktemp("victim")
    shutil.copytree(reference / "checkpoint-4", out / "checkpoint-4")
    shutil.copytree(reference / "checkpoint-4", out / "checkpoint-7")
    state = json.loads((out / "checkpoint-7" / "training_state.json").read_text())
    (out / "checkpoint-7" / "training_state.json").write_text(json.dumps({**state, "trainer": "train_unconditional"}))
    copy_without_ema(reference / "checkpoint-4", "transformer_ema", out / "checkpoint-9")
    return out


@pytest.mark.parametrize("extra, expected", [
    (["--label_column", "class"], "error: --label_column 'class' is not in the dataset; its columns are ['image', 'label']"),
    (["--validation_class_labels", "0", "6"], "error: --validation_class_labels [0, 6] must be among the classes 0..5"),
    (["--resolution", "15"], "error: --resolution 15 must be a multiple of 2 (patch size)"),
    (["--resume_from_checkpoint", "checkpoint-7"], "checkpoint-7 is not a checkpoint-N folder written by train_dit.py"),
    (["--resume_from_checkpoint", "checkpoint-9", "--train_batch_size", "2", "--use_ema"], f"checkpoint-9 {NO_EMA}"),
])
def test_bad_input_is_one_clear_error(extra, expected, victim, label_folder, tiny_dit_config_path, run_in_process):
    before = snapshot(victim)
    log = run_in_process(SCRIPT, ["--train_data_dir", label_folder, "--model_config_name_or_path", tiny_dit_config_path,
                                  "--resolution", "16", "--output_dir", victim, *extra])
    assert expected in log
    assert "Steps:" not in log  # failed before training started
    assert snapshot(victim) == before


def test_bad_labels_are_one_clear_error(dit):
    import datasets

    def classes(labels, feature=None, **flags):
        features = datasets.Features({"label": feature}) if feature else None
        dataset = datasets.Dataset.from_dict({"label": labels}, features=features)
        return dit.find_classes(dataset, Namespace(**{"label_column": "label", "num_classes": None, "pretrained_vae_model_name_or_path": None,
                                                      **flags}))

    assert classes([2, 0, 1]) == {0: "0", 1: "1", 2: "2"}
    assert classes([1, 0], num_classes=4) == {0: "0", 1: "1", 2: "2", 3: "3"}
    assert classes([1, 0], datasets.ClassLabel(names=["cat", "dog"])) == {0: "cat", 1: "dog"}
    for labels, feature, flags, expected in [
        ([0, 1], None, {"label_column": "y"}, "--label_column 'y' is not in the dataset; its columns are ['label']"),
        (["cat", "dog"], None, {}, "--label_column 'label' holds Value('string'), not integer classes"),
        ([0.0, 1.5], None, {}, "holds Value('float64'), not integer classes"),
        ([0, None], None, {}, "--label_column 'label' has the label None, not a class 0..0"),
        ([0, 1, 5], None, {"num_classes": 3}, "has the label 5, not a class 0..2"),
        ([0, -1], datasets.ClassLabel(names=["cat", "dog"]), {}, "has the label -1, not a class 0..1"),
        ([0, 0], None, {}, "has 1 classes: 2 or more"),
        ([0, 1001], None, {"pretrained_vae_model_name_or_path": "vae"}, "has 1002 classes: 2 or more, with a VAE at most 1000"),
    ]:
        with pytest.raises(SystemExit, match="^error: ") as error:
            classes(labels, feature, **flags)
        assert expected in str(error.value)


@pytest.mark.parametrize("argv, expected", [
    (["--class_dropout_prob", "1"], "--class_dropout_prob 1.0 must be in [0, 1)"),
    (["--prediction_type", "sample"], "argument --prediction_type: invalid choice: 'sample'"),
    (["--model_type", "DiT-M/2"], "argument --model_type: invalid choice: 'DiT-M/2'"),
    (["--cache_latents", "--center_crop"], "--cache_latents needs --pretrained_vae_model_name_or_path"),
])
def test_bad_flags_are_rejected_by_the_parser(argv, expected, dit, capsys):
    with pytest.raises(SystemExit) as exit:
        dit.parse_args(["--train_data_dir", "x", *argv])
    assert exit.value.code == 2 and expected in capsys.readouterr().err


def test_v_prediction_min_snr_weights_the_same_objective_as_epsilon(dit):
    from diffusers import DDPMScheduler

    scheduler, t = DDPMScheduler(), torch.tensor([0, 300, 999])
    alpha_bar = torch.cumprod(1 - torch.linspace(1e-4, 0.02, 1000, dtype=torch.float64), 0)[t]
    snr = alpha_bar / (1 - alpha_bar)
    epsilon = dit.snr_loss_weights(scheduler, t, Namespace(prediction_type="epsilon", snr_gamma=5.0)).double()
    v = dit.snr_loss_weights(scheduler, t, Namespace(prediction_type="v_prediction", snr_gamma=5.0)).double()
    torch.testing.assert_close(epsilon, snr.clamp(max=5) / snr, rtol=1e-3, atol=0)
    torch.testing.assert_close(v * (snr + 1) / snr, epsilon, rtol=1e-3, atol=0)  # ‖v − v_θ‖² = (SNR + 1) / SNR · ‖ε − ε_θ‖²
