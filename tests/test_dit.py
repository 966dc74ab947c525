"""train_dit.py: exact resume, the paper's set-up (adaLN-Zero, one label drop per image), guidance, latent
training with cached latents, the DiTPipeline folder users load, bad input."""

import pytest
import torch
from conftest import (assert_same_ema, assert_same_optimizer_state, assert_same_weights, checkpoints, ema_weights,
                      import_script, resume_copy,
                      train_in_process, weights, write_imagefolder)

SCRIPT = "train_dit.py"


@pytest.fixture(scope="module")
def common(digits_folder, tiny_dit_config):
    """12 labelled digits cropped at random to 32 px and flipped; EMA; 3 steps an epoch at batch 4."""
    return ["--train_data_dir", digits_folder, "--model_config_name_or_path", tiny_dit_config, "--resolution", "32",
            "--random_flip", "--use_ema", "--learning_rate", "1e-3", "--max_train_steps", "6",
            "--checkpointing_steps", "2", "--num_inference_steps", "2", "--eval_batch_size", "1",
            "--save_images_epochs", "1", "--logger", "none", "--train_batch_size", "4"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory, common):
    out = tmp_path_factory.mktemp("dit") / "ref"
    train_in_process(SCRIPT, common + ["--output_dir", out])
    return out


def test_resume_is_exact(reference, common):
    out = resume_copy(reference, "checkpoint-4")
    train_in_process(SCRIPT, common + ["--output_dir", out, "--resume_from_checkpoint", "latest"])
    for sub in ["checkpoint-6/transformer", "transformer"]:
        assert_same_weights(weights(out / sub), weights(reference / sub))
    assert_same_ema(out / "checkpoint-6", reference / "checkpoint-6", "transformer")
    assert_same_optimizer_state(out / "checkpoint-6", reference / "checkpoint-6")


def test_checkpoints_and_the_folder_users_load(reference):
    from diffusers import DDIMScheduler, DiTPipeline, DiTTransformer2DModel

    assert checkpoints(reference) == ["checkpoint-2", "checkpoint-4", "checkpoint-6"]
    DiTTransformer2DModel.from_pretrained(reference / "checkpoint-6", subfolder="transformer")
    averaged, final = ema_weights(reference / "checkpoint-6", "transformer")[0], weights(reference / "transformer")
    assert_same_weights({k: final[k] for k in averaged}, averaged)  # the EMA weights saved
    pipeline = DiTPipeline.from_pretrained(reference, vae=None)  # a pixel-space DiT has no VAE
    assert isinstance(pipeline.scheduler, DDIMScheduler) and pipeline.scheduler.config.clip_sample is False
    assert pipeline.labels["3"] == 3  # id2label, for DiTPipeline.get_label_ids
    assert sorted(p.name for p in (reference / "samples").iterdir()) == ["step-3.png", "step-6.png"]


def test_a_fresh_transformer_is_adaln_zero_and_drops_no_labels_itself(common):
    script = import_script("train_dit")
    model = script.build_transformer(script.parse_args(common + ["--output_dir", "unused"]), 10, None)
    assert all(block.norm1.emb.class_embedder.dropout_prob == 0 for block in model.transformer_blocks)
    out = model(torch.randn(2, 3, 32, 32), torch.tensor([3, 500]), torch.tensor([1, 10])).sample
    assert torch.equal(out, torch.zeros_like(out))  # every block starts as the identity, the output at 0


@pytest.mark.parametrize("probability, dropped", [(0.0, "none"), (0.5, "some"), (1.0, "all")])
def test_labels_become_the_null_class_at_the_requested_rate(probability, dropped, common, tmp_path, monkeypatch):
    from diffusers import DiTTransformer2DModel

    seen, forward = [], DiTTransformer2DModel.forward

    def record(self, hidden_states, timestep=None, class_labels=None, **kwargs):
        if self.training:
            seen.append(class_labels.clone())
        return forward(self, hidden_states, timestep, class_labels, **kwargs)

    monkeypatch.setattr(DiTTransformer2DModel, "forward", record)
    args = common + ["--output_dir", tmp_path, "--class_dropout_prob", str(probability), "--save_images_epochs", "9"]
    train_in_process(SCRIPT, args + ["--checkpointing_steps", "99"])
    labels = torch.cat(seen)
    assert len(labels) == 24 and labels.max() <= 10
    null = labels == 10  # the row after the 10 classes
    assert {"none": not null.any(), "some": 0 < null.sum() < 24, "all": null.all()}[dropped]


def test_guidance_mixes_the_conditional_and_the_null_prediction(reference):
    from diffusers import DDIMScheduler, DiTTransformer2DModel

    sample = import_script("train_dit").sample_images
    model = DiTTransformer2DModel.from_pretrained(reference / "transformer").eval()
    scheduler = DDIMScheduler.from_pretrained(reference / "scheduler")
    images = {}
    for name, labels, scale in [("s=0", [3, 5], 0.0), ("null", [10, 10], 1.0), ("s=1", [3, 5], 1.0), ("s=4", [3, 5], 4.0)]:
        images[name] = sample(model, scheduler, torch.tensor(labels), scale, 3, generator=torch.manual_seed(0))
    torch.testing.assert_close(images["s=0"], images["null"])  # s = 0: the unconditional model alone
    assert not torch.allclose(images["s=1"], images["s=4"])
    assert images["s=4"].shape == (2, 3, 32, 32) and 0 <= images["s=4"].min() and images["s=4"].max() <= 1


def test_cached_latents_are_the_vaes_moments_of_both_sides(digits_folder, tiny_sd_path):
    from diffusers import AutoencoderKL
    from torchvision import transforms

    script = import_script("train_dit")
    vae = AutoencoderKL.from_pretrained(tiny_sd_path, subfolder="vae")
    args = script.parse_args(["--train_data_dir", digits_folder, "--model_config_name_or_path", "x", "--random_flip",
                              "--resolution", "64", "--center_crop", "--output_dir", "unused"])
    splits = script.load_datasets(args, "image")
    splits["train"] = splits["train"].select(range(2))
    augment = transforms.Compose([transforms.Resize(64), transforms.CenterCrop(64), transforms.ToTensor(),
                                  transforms.Normalize([0.5], [0.5])])
    cache = script.cache_latents(args, splits, augment, vae)  # by row: both sides' μ and log σ²
    pixels = torch.stack([augment(script.open_image(item).convert("RGB")) for item in splits["train"]["image"]])
    with torch.no_grad():
        for side, images in enumerate([pixels, pixels.flip(-1)]):
            expected = vae.encode(images).latent_dist.parameters
            cached = torch.stack([cache[row][side] for row in splits["train"]["row"]])
            torch.testing.assert_close(cached, expected)


def test_validation_draws_the_datasets_classes_not_the_vaes_thousand(tiny_dit_config, tiny_sd_path, tmp_path):
    """With a VAE the transformer has ImageNet's 1000 label rows (DiTPipeline's ∅ is 1000), but a dataset of 2
    classes trains only 2 of them: the validation grid has a row for each of those, not 10."""
    from PIL import Image

    folder = write_imagefolder(tmp_path / "two", 2)
    out = tmp_path / "out"
    train_in_process(SCRIPT, ["--train_data_dir", folder, "--model_config_name_or_path", tiny_dit_config,
                              "--pretrained_vae_model_name_or_path", f"{tiny_sd_path}/vae", "--resolution", "64",
                              "--max_train_steps", "1", "--train_batch_size", "2", "--num_inference_steps", "1",
                              "--eval_batch_size", "1", "--logger", "none", "--output_dir", out])
    # One column (a grid of 1 per class), 2 rows of 64 px, torchvision's 2 px padding around each tile.
    assert Image.open(out / "samples" / "step-1.png").size == (64 + 4, 2 * (64 + 2) + 2)


@pytest.mark.parametrize("prediction_type", ["epsilon", "flow_prediction"])
def test_latent_training_with_cached_latents_saves_a_dit_pipeline(prediction_type, digits_folder, tiny_dit_config,
                                                                  tiny_sd_path, tmp_path):
    from diffusers import DDIMScheduler, DiTPipeline, DPMSolverMultistepScheduler

    out = tmp_path / "latent"
    train_in_process(SCRIPT, ["--train_data_dir", digits_folder, "--model_config_name_or_path", tiny_dit_config,
                              "--pretrained_vae_model_name_or_path", f"{tiny_sd_path}/vae", "--resolution", "64",
                              "--center_crop", "--random_flip", "--cache_latents", "--max_train_steps", "2",
                              "--train_batch_size", "4", "--num_inference_steps", "2", "--eval_batch_size", "1",
                              "--logger", "none", "--output_dir", out, "--prediction_type", prediction_type])
    pipeline = DiTPipeline.from_pretrained(out)  # with vae/: DiTPipeline's own call, ∅ as label 1000
    assert pipeline.transformer.config.num_embeds_ada_norm == 1000 and pipeline.transformer.config.sample_size == 8
    if prediction_type == "flow_prediction":  # a sampler in the flow convention: σ from 1 to 0, t = 1000·σ
        assert isinstance(pipeline.scheduler, DPMSolverMultistepScheduler)
        assert pipeline.scheduler.config.use_flow_sigmas and pipeline.scheduler.config.prediction_type == prediction_type
    else:
        assert isinstance(pipeline.scheduler, DDIMScheduler)
    images = pipeline(class_labels=[1, 7], num_inference_steps=2, guidance_scale=4.0, output_type="np").images
    assert images.shape == (2, 64, 64, 3)


@pytest.fixture(scope="module")
def flow_run(tmp_path_factory, common):
    """A pixel-space flow-matching run of 2 steps, recording x_0 and ε (randn_like's input and output), the
    transformer's input and t, the loss target, and what the run logged."""
    import logging

    from diffusers import DiTTransformer2DModel

    out, seen = tmp_path_factory.mktemp("flow") / "out", {"x_0": [], "noise": [], "x": [], "t": [], "target": []}
    randn_like, forward, mse_loss = torch.randn_like, DiTTransformer2DModel.forward, torch.nn.functional.mse_loss

    def record_noise(x):
        seen["x_0"].append(x.clone())
        seen["noise"].append(randn_like(x))
        return seen["noise"][-1]

    def record_input(self, hidden_states, timestep=None, class_labels=None, **kwargs):
        if self.training:
            seen["x"].append(hidden_states.clone())
            seen["t"].append(timestep.clone())
        return forward(self, hidden_states, timestep, class_labels, **kwargs)

    def record_target(prediction, target, **kwargs):
        seen["target"].append(target.clone())
        return mse_loss(prediction, target, **kwargs)

    log, handler = [], logging.Handler()
    handler.emit = lambda record: log.append(record.getMessage())
    loggers = [logging.getLogger("diffusers"), logging.getLogger("train_dit")]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch, "randn_like", record_noise)
        patch.setattr(DiTTransformer2DModel, "forward", record_input)
        patch.setattr(torch.nn.functional, "mse_loss", record_target)
        levels = [logger.level for logger in loggers]
        for logger in loggers:
            logger.addHandler(handler)
            logger.setLevel("INFO")  # the script's own line is INFO; diffusers' warning would pass too
        try:
            train_in_process(SCRIPT, common + ["--output_dir", out, "--prediction_type", "flow_prediction",
                                               "--max_train_steps", "2", "--save_images_epochs", "9"])
        finally:
            for logger, level in zip(loggers, levels):
                logger.removeHandler(handler)
                logger.setLevel(level)
    return out, seen, log


def test_flow_matching_trains_on_the_straight_line_from_data_to_noise(flow_run):
    """x_σ = (1-σ)·x_0 + σ·ε with σ logit-normal in (0, 1), the transformer told t = 1000·σ, the target ε - x_0."""
    _, seen, _ = flow_run
    assert len(seen["x"]) == len(seen["target"]) == 2
    for x_0, noise, x, t, target in zip(*seen.values()):
        assert t.dtype == torch.float32 and 0 < t.min() and t.max() < 1000 and not torch.equal(t, t.round())
        sigma = (t / 1000).view(-1, 1, 1, 1)
        torch.testing.assert_close(x, (1 - sigma) * x_0 + sigma * noise)
        torch.testing.assert_close(target, noise - x_0)


def test_a_pixel_space_save_writes_no_vae_folder(flow_run):
    """In pixel space the pipeline has vae=None: diffusers says it cannot save it (guide 3), and the folder
    holds transformer/ and scheduler/ alone."""
    out, _, log = flow_run
    assert (out / "transformer").is_dir() and (out / "scheduler").is_dir() and not (out / "vae").exists()


@pytest.mark.parametrize("run", ["epsilon", "flow_prediction"])
def test_the_guides_lines_sample_a_pixel_space_folder(run, reference, flow_run):
    """docs/3-dit.md's ```py block, as written, on a folder without vae/ (DiTPipeline cannot run it)."""
    import re

    from conftest import REPO

    folder = reference if run == "epsilon" else flow_run[0]
    block = re.search(r"```py\n(.*?)```", (REPO / "docs" / "3-dit.md").read_text(), re.S).group(1)
    assert '"dit-digits"' in block
    namespace = {}
    exec(block.replace('"dit-digits"', repr(str(folder))), namespace)
    images = namespace["images"]
    assert images.shape == (10, 3, 32, 32) and 0 <= images.min() and images.max() <= 1


def test_min_snr_is_refused_with_flow_matching(capsys):
    with pytest.raises(SystemExit):
        import_script("train_dit").parse_args(["--train_data_dir", "x", "--model_config_name_or_path", "y",
                                               "--prediction_type", "flow_prediction", "--snr_gamma", "5"])
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error.split(": error: ", 1)[1] == \
        "--snr_gamma is left out with flow: the logit-normal density weights the timesteps"


@pytest.mark.parametrize("case, expected", [
    ("no_such_dir", "error: --train_data_dir /no/such/dir: "),
    ("empty_dir", "error: --train_data_dir "),
    ("label_column", "error: no column 'class'; the dataset has ['image', 'text', 'label']"),
    ("corrupt_image", "error: image "),
    ("model_config", "error: --model_config_name_or_path /no/such/config: "),
    ("vae", "error: --pretrained_vae_model_name_or_path /no/such/vae: "),
    ("fp16_on_cpu", "error: --mixed_precision fp16 needs a GPU"),
    ("missing_checkpoint", "error: --resume_from_checkpoint "),
])
def test_bad_input_is_one_clear_error(case, expected, digits_folder, corrupt_folder, empty_folder, tiny_dit_config,
                                      tmp_path, run_in_process):
    args = ["--train_data_dir", digits_folder, "--model_config_name_or_path", tiny_dit_config, "--resolution", "32",
            "--output_dir", tmp_path, "--logger", "none", "--train_batch_size", "6"]
    changes = {"no_such_dir": ["--train_data_dir", "/no/such/dir"], "empty_dir": ["--train_data_dir", empty_folder],
               "label_column": ["--label_column", "class"],
               "corrupt_image": ["--train_data_dir", corrupt_folder],
               "model_config": ["--model_config_name_or_path", "/no/such/config"],
               "vae": ["--pretrained_vae_model_name_or_path", "/no/such/vae"], "fp16_on_cpu": ["--mixed_precision", "fp16"],
               "missing_checkpoint": ["--resume_from_checkpoint", "checkpoint-9"]}
    error = run_in_process(SCRIPT, args + changes[case])
    assert error.startswith(expected) and "\n" not in error
    assert not list(tmp_path.iterdir())  # nothing written


def test_caching_needs_a_vae_and_a_center_crop(capsys):
    with pytest.raises(SystemExit):
        import_script("train_dit").parse_args(["--train_data_dir", "x", "--model_config_name_or_path", "y", "--cache_latents"])
    assert "--cache_latents needs a VAE and --center_crop" in capsys.readouterr().err
