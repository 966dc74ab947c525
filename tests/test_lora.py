"""train_lora.py: exact resume (1 and 2 processes), checkpoints of the LoRA alone, the files users load (diffusers
loads every layer; kohya's keys follow the rule every tool reads; both draw what the fused weights draw), fp32 LoRA
under bf16, bad input (DeepSpeed refused before the models load)."""

import json
import re

import pytest
import torch
from conftest import (require_deepspeed, assert_same_optimizer_state, assert_same_weights, checkpoints, import_script, resume_copy,
                      run_script, train_in_process, weights)
from safetensors import safe_open

SCRIPT = "train_lora.py"
LORA = "pytorch_lora_weights.safetensors"
KOHYA_TARGETS = "to_q,to_k,to_v,to_out.0,proj_in,proj_out,ff.net.0.proj,ff.net.2"  # kohya's default set
# The module names ComfyUI (comfy/lora.py), A1111 and Forge (networks.py) and kohya map to SD 1.x layers
TEXT_KEY = re.compile(r"^lora_te_text_model_encoder_layers_\d+_(self_attn_(q|k|v|out)_proj|mlp_fc[12])$")
UNET_KEY = re.compile(r"^lora_unet_(down_blocks_\d+_attentions_\d+|up_blocks_\d+_attentions_\d+|mid_block_attentions_0)_"
                      r"(proj_in|proj_out|transformer_blocks_\d+_(attn[12]_to_(q|k|v|out_0)|ff_net_0_proj|ff_net_2))$")


@pytest.fixture(scope="module")
def common(tiny_sd_path, kohya_folder):
    """12 digits with kohya caption files, cropped at random to 64 and flipped; LoRA of rank 4 and α 8
    on kohya's set of UNet layers and on the text encoder; EMA; 3 steps an epoch at batch 4."""
    return ["--pretrained_model_name_or_path", tiny_sd_path, "--train_data_dir", kohya_folder, "--resolution", "64",
            "--random_flip", "--train_text_encoder", "--rank", "4", "--lora_alpha", "8", "--lora_target_modules",
            KOHYA_TARGETS, "--use_ema", "--snr_gamma", "5", "--noise_offset", "0.1", "--learning_rate", "1e-2",
            "--lr_warmup_steps", "0", "--max_train_steps", "6", "--checkpointing_steps", "2", "--train_batch_size", "4",
            "--num_inference_steps", "2", "--report_to", "none"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory, common):
    out = tmp_path_factory.mktemp("lora") / "ref"
    train_in_process(SCRIPT, common + ["--output_dir", out, "--validation_prompt", "a handwritten digit seven",
                                       "--num_validation_images", "2"])
    return out


def assert_same_run(out, reference):
    for sub in [f"checkpoint-6/{LORA}", LORA, f"{reference.name}.safetensors"]:
        assert_same_weights(weights(out, sub.replace(reference.name, out.name)), weights(reference, sub))
    assert_same_optimizer_state(out / "checkpoint-6", reference / "checkpoint-6")


def test_resume_is_exact(reference, common):
    out = resume_copy(reference, "checkpoint-4")
    train_in_process(SCRIPT, common + ["--output_dir", out, "--resume_from_checkpoint", "latest"])
    assert_same_run(out, reference)
    # custom_checkpoint_1.pkl: the EMA, registered for checkpointing after the masters.
    ema, ema_ref = (torch.load(d / "checkpoint-6" / "custom_checkpoint_1.pkl") for d in (out, reference))
    for a, b in zip(ema["shadow_params"], ema_ref["shadow_params"]):
        assert torch.equal(a, b)


def test_checkpoints_hold_the_lora_alone(reference):
    assert checkpoints(reference) == ["checkpoint-2", "checkpoint-4", "checkpoint-6"]
    assert sorted(p.name for p in (reference / "checkpoint-6").iterdir()) == [
        "custom_checkpoint_0.pkl", "custom_checkpoint_1.pkl", "optimizer.bin", LORA, "random_states_0.pkl", "scheduler.bin"]
    lora = weights(reference / "checkpoint-6", LORA)
    assert all(".lora_A." in k or ".lora_B." in k for k in lora)  # no frozen weight
    assert sum(v.numel() for v in lora.values()) < 100_000
    # The optimizer's masters: in fp32 the model's own A and B, the same numbers as the LoRA file.
    masters = torch.load(reference / "checkpoint-6" / "custom_checkpoint_0.pkl")
    assert sorted(v.numel() for v in masters.values()) == sorted(v.numel() for v in lora.values())
    assert (reference / "samples" / "step-3.png").exists()


def pipeline(tiny_sd_path):
    from diffusers import StableDiffusionPipeline

    pipe = StableDiffusionPipeline.from_pretrained(tiny_sd_path, safety_checker=None)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def draw(pipe):
    return pipe("a handwritten digit seven", num_inference_steps=2, generator=torch.manual_seed(0),
                output_type="np").images


def test_diffusers_loads_every_layer_of_the_file(reference, tiny_sd_path):
    pipe = pipeline(tiny_sd_path)
    pipe.load_lora_weights(reference)
    layers = {name: sum(1 for _, m in module.named_modules() if "default_0" in getattr(m, "lora_A", {}))
              for name, module in [("unet", pipe.unet), ("text_encoder", pipe.text_encoder)]}
    in_file = {part: sum(1 for k in weights(reference, LORA) if k.startswith(part + ".") and ".lora_A." in k)
               for part in layers}
    assert layers == in_file and in_file["unet"] == 72 and in_file["text_encoder"] == 20
    with safe_open(reference / LORA, "pt") as f:  # loaders scale by α / r from the file's own config
        config = json.loads(f.metadata()["lora_adapter_metadata"])
    assert config["unet.r"] == 4 and config["unet.lora_alpha"] == 8 and config["text_encoder.lora_alpha"] == 8


def test_kohya_keys_follow_the_rule_every_tool_reads(reference):
    kohya = weights(reference, f"{reference.name}.safetensors")
    modules = {key.split(".")[0] for key in kohya}
    text = {m for m in modules if m.startswith("lora_te_")}
    assert len(text) == 20 and all(TEXT_KEY.match(m) for m in text), sorted(text)[:3]
    unet = modules - text
    assert len(unet) == 72 and all(UNET_KEY.match(m) for m in unet), sorted(m for m in unet if not UNET_KEY.match(m))
    for m in modules:
        assert set(k for k in kohya if k.split(".")[0] == m) == {f"{m}.lora_down.weight", f"{m}.lora_up.weight", f"{m}.alpha"}
        assert kohya[f"{m}.alpha"].item() == 8 and kohya[f"{m}.lora_down.weight"].shape[0] == 4


def test_both_files_draw_what_the_fused_weights_draw(reference, tiny_sd_path):
    """W' = W + (α/r)·B·A, applied by hand to the base model, against what the loaders apply."""
    base, lora = pipeline(tiny_sd_path), weights(reference, LORA)
    images = {}
    for name, source in [("diffusers", reference), ("kohya", reference / f"{reference.name}.safetensors")]:
        pipe = pipeline(tiny_sd_path)
        pipe.load_lora_weights(str(source))
        images[name] = draw(pipe)
    for part, module in [("unet", base.unet), ("text_encoder", base.text_encoder)]:
        layers = dict(module.named_modules())
        for key, A in lora.items():
            if key.startswith(part + ".") and ".lora_A." in key:
                path = key[len(part) + 1 : key.index(".lora_A.")]
                B = lora[key.replace(".lora_A.", ".lora_B.")]
                with torch.no_grad():
                    layers[path].weight += (8 / 4) * (B.flatten(1) @ A.flatten(1)).view_as(layers[path].weight)
    fused = draw(base)
    assert abs(images["diffusers"] - fused).max() < 2e-3 and abs(images["kohya"] - fused).max() < 2e-3
    assert abs(draw(pipeline(tiny_sd_path)) - fused).max() > 1e-2  # the LoRA changes what is drawn


# Two processes combined with bf16 (fp32 masters and their EMA), accumulation and DataLoader workers.
TWO_PROCESSES = ["--train_batch_size", "2", "--mixed_precision", "bf16", "--gradient_accumulation_steps", "2",
                 "--dataloader_num_workers", "2"]


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory, common):
    out = tmp_path_factory.mktemp("lora2") / "ref"
    run_script(SCRIPT, common + TWO_PROCESSES + ["--output_dir", out], num_processes=2)
    return out


def test_resume_on_two_processes_is_exact(two_processes, common):
    out = resume_copy(two_processes, "checkpoint-4")
    run_script(SCRIPT, common + TWO_PROCESSES + ["--output_dir", out, "--resume_from_checkpoint", "latest"],
               num_processes=2)
    assert_same_run(out, two_processes)
    # The fp32 masters (custom_checkpoint_0) and their EMA (custom_checkpoint_1).
    masters, masters_ref = (torch.load(d / "checkpoint-6" / "custom_checkpoint_0.pkl") for d in (out, two_processes))
    assert_same_weights(masters, masters_ref)
    ema, ema_ref = (torch.load(d / "checkpoint-6" / "custom_checkpoint_1.pkl") for d in (out, two_processes))
    assert all(torch.equal(a, b) for a, b in zip(ema["shadow_params"], ema_ref["shadow_params"], strict=True))


def validation_halves(folder, step, n=2, size=64):
    """The validation grid's one row (one prompt): its n images at LoRA scale 0, then its n at scale 1."""
    import numpy as np
    from PIL import Image

    grid = np.asarray(Image.open(folder / "samples" / f"step-{step}.png"))
    tiles = [grid[2 : 2 + size, 2 + i * (size + 2) : 2 + i * (size + 2) + size] for i in range(2 * n)]
    return np.stack(tiles[:n]), np.stack(tiles[n:])


def test_validation_draws_the_base_model_then_the_trained_lora(reference, common, tmp_path):
    """The validation pipeline is built on the very modules that train: at scale 1 it draws the LoRA
    (here, after 6 steps at lr 1e-2, other images than at scale 0); with an untrained adapter (B = 0)
    the two halves are the same images."""
    off, on = validation_halves(reference, 6)
    assert (off != on).any()
    untrained = tmp_path / "untrained"
    train_in_process(SCRIPT, common + ["--output_dir", untrained, "--learning_rate", "0", "--max_train_steps", "1",
                                       "--validation_prompt", "a handwritten digit seven", "--num_validation_images",
                                       "2"])
    off, on = validation_halves(untrained, 1)
    assert (off == on).all()


def test_an_untrained_adapter_changes_nothing(common, tiny_sd_path, tmp_path):
    train_in_process(SCRIPT, common + ["--output_dir", tmp_path, "--learning_rate", "0", "--max_train_steps", "1"])
    lora = weights(tmp_path, LORA)
    assert all(torch.count_nonzero(v) == 0 for k, v in lora.items() if ".lora_B." in k)  # B = 0 in both models
    pipe = pipeline(tiny_sd_path)
    pipe.load_lora_weights(tmp_path)
    assert abs(draw(pipe) - draw(pipeline(tiny_sd_path))).max() < 1e-6


def test_bf16_updates_of_1e_4_land_in_fp32_masters_and_resume_exactly(common, tmp_path):
    """Under bf16 the model computes with bf16 copies of A and B and the optimizer updates fp32 masters: Adam's first
    steps of about 1e-4, which a bf16 weight near A's σ = 1/r = 0.25 rounds away, land in A; the files hold the fp32
    masters (here their EMA, which averages: it is not the masters themselves); a resumed run ends bit for bit where
    the whole run does."""
    args = common + ["--mixed_precision", "bf16", "--learning_rate", "1e-4", "--max_train_steps", "2",
                     "--checkpointing_steps", "1"]
    train_in_process(SCRIPT, args + ["--output_dir", tmp_path / "run"])
    train_in_process(SCRIPT, args + ["--output_dir", tmp_path / "init", "--learning_rate", "0"])
    lora, init = weights(tmp_path / "run", LORA), weights(tmp_path / "init", LORA)
    assert {v.dtype for v in lora.values()} == {torch.float32}
    A = [k for k in lora if ".lora_A." in k]
    moved = sum(int((lora[k] != init[k]).sum()) for k in A) / sum(lora[k].numel() for k in A)
    assert moved > 0.9, moved  # bf16 weights would keep A as it was
    assert all(lora[k].to(torch.bfloat16).float().ne(lora[k]).any() for k in A)  # not bf16 values
    # EMAModel.step copies a tensor that needs no gradient instead of averaging it.
    masters, ema = (torch.load(tmp_path / "run" / "checkpoint-2" / f"custom_checkpoint_{i}.pkl") for i in (0, 1))
    assert not any(torch.equal(a, b) for a, b in zip(masters.values(), ema["shadow_params"]) if a.any())
    resumed = resume_copy(tmp_path / "run", "checkpoint-1")
    train_in_process(SCRIPT, args + ["--output_dir", resumed, "--resume_from_checkpoint", "latest"])
    assert_same_weights(weights(resumed, LORA), lora)


def test_adamw_is_torch_fused_and_8bit_adam_is_bitsandbytes(reference, common, tmp_path):
    """The optimizer state in the checkpoints: torch's fused AdamW by default (one kernel for all the weights),
    bitsandbytes' AdamW8bit with --use_8bit_adam (its own state, no torch flags passed to it), and both train."""
    fused = torch.load(reference / "checkpoint-6" / "optimizer.bin", weights_only=False)
    assert [group["fused"] for group in fused["param_groups"]] == [True]
    assert "exp_avg" in fused["state"][0]
    args = [a for a in common if a != "--use_ema"] + ["--max_train_steps", "1", "--checkpointing_steps", "1"]
    train_in_process(SCRIPT, args + ["--output_dir", tmp_path, "--use_8bit_adam"])
    eight_bit = torch.load(tmp_path / "checkpoint-1" / "optimizer.bin", weights_only=False)
    assert "fused" not in eight_bit["param_groups"][0] and "exp_avg" not in eight_bit["state"][0]
    assert all(v.abs().sum() > 0 for k, v in weights(tmp_path, LORA).items() if ".lora_B." in k)  # B = 0 at first


def test_the_text_encoder_adapter_passes_no_version_gate(common, tmp_path, monkeypatch):
    """transformers' add_adapter refuses peft releases older than its own minimum (5.24: peft 0.22, not yet
    released); the script calls peft directly, so a gate that always refuses must not stop it."""
    import transformers.integrations.peft as hf_peft

    def refuse(*args, **kwargs):
        raise ValueError("The version of PEFT you are using is not compatible")

    monkeypatch.setattr(hf_peft, "check_peft_version", refuse)
    train_in_process(SCRIPT, common + ["--output_dir", tmp_path, "--max_train_steps", "1", "--checkpointing_steps", "9"])
    assert sum(1 for k in weights(tmp_path, LORA) if k.startswith("text_encoder.") and ".lora_A." in k) == 20


def test_gradient_checkpointing_reaches_only_a_text_encoder_that_learns(common, tmp_path, monkeypatch):
    """A frozen CLIP runs no backward pass, so checkpointing it would do nothing: it is left alone. With
    --train_text_encoder it is checkpointed, and every B of its LoRA still learns."""
    from transformers import CLIPTextModel

    calls = []
    enable = CLIPTextModel.gradient_checkpointing_enable

    def record(self, *args, **kwargs):
        calls.append(self.training)
        return enable(self, *args, **kwargs)

    monkeypatch.setattr(CLIPTextModel, "gradient_checkpointing_enable", record)
    args = [a for a in common if a != "--train_text_encoder"] + ["--gradient_checkpointing", "--checkpointing_steps", "9"]
    train_in_process(SCRIPT, args + ["--output_dir", tmp_path / "unet", "--max_train_steps", "1"])
    assert calls == []
    train_in_process(SCRIPT, args + ["--output_dir", tmp_path / "both", "--max_train_steps", "2", "--train_text_encoder"])
    assert len(calls) == 1
    clip_b = [v for k, v in weights(tmp_path / "both", LORA).items() if k.startswith("text_encoder.") and ".lora_B." in k]
    assert len(clip_b) == 20 and all(v.abs().sum() > 0 for v in clip_b)  # B = 0 at first


def test_output_dir_dot_names_the_kohya_file_after_the_folder(common, tmp_path, monkeypatch):
    folder = tmp_path / "my-style"
    folder.mkdir()
    monkeypatch.chdir(folder)
    train_in_process(SCRIPT, common + ["--output_dir", ".", "--max_train_steps", "1", "--checkpointing_steps", "9"])
    assert (folder / "my-style.safetensors").exists() and (folder / LORA).exists()


def test_the_diffusers_readme_command_runs(tiny_sd_path, sd_folder, tmp_path):
    """examples/text_to_image/README.md's LoRA command, flags as written, for 2 steps. Adapted: the model is the tiny
    SD and the dataset a local imagefolder (offline); `accelerate launch --mixed_precision="fp16"` is left out (fp16
    needs a GPU: this CPU runs fp32); --report_to=wandb is tensorboard (wandb is not installed). Added for CI
    time: one validation image of one sampler step (the README's 4 of 20 steps at 512 px take 4 minutes here)."""
    out = tmp_path / "sd-naruto-model-lora"
    train_in_process(SCRIPT, [
        f"--pretrained_model_name_or_path={tiny_sd_path}", f"--dataset_name={sd_folder}", "--caption_column=text",
        "--resolution=512", "--random_flip", "--train_batch_size=1", "--num_train_epochs=100",
        "--checkpointing_steps=5000", "--learning_rate=1e-04", "--lr_scheduler=constant", "--lr_warmup_steps=0",
        "--seed=42", f"--output_dir={out}", "--validation_prompt=cute dragon creature", "--report_to=tensorboard",
        "--max_train_steps", "2", "--num_inference_steps", "1", "--num_validation_images", "1"])
    pipe = pipeline(tiny_sd_path)
    pipe.load_lora_weights(out)
    assert (out / f"{out.name}.safetensors").exists() and (out / "samples" / "step-2.png").exists()
    assert list((out / "logs" / "text2image-fine-tune").iterdir())  # TensorBoard's events, in --logging_dir


def test_a_refused_official_flag_ends_in_one_line(capsys):
    with pytest.raises(SystemExit):
        import_script("train_lora").parse_args(["--pretrained_model_name_or_path", "x", "--train_data_dir", "y",
                                                "--hub_token", "hf_x"])
    error = capsys.readouterr().err.splitlines()[-1]  # after argparse's usage line
    assert error.split(": error: ", 1)[1] == ("--hub_token is left out: a token in a command lands in shell "
                                             "history; run `hf auth login`")


def test_an_ignored_official_flag_trains_and_no_validation_images_draw_none(common, tmp_path):
    """--enable_xformers_memory_efficient_attention (its help says why it is ignored) trains; with
    --num_validation_images 0 a run with prompts draws no grid at all."""
    train_in_process(SCRIPT, common + ["--output_dir", tmp_path, "--max_train_steps", "1", "--checkpointing_steps", "9",
                                       "--enable_xformers_memory_efficient_attention", "--validation_prompts", "a digit",
                                       "--num_validation_images", "0"])
    assert (tmp_path / LORA).exists() and not (tmp_path / "samples").exists()


@pytest.mark.parametrize("case, expected", [
    ("target", "error: --lora_target_modules to_x: "),
    ("not_a_pipeline", "error: --pretrained_model_name_or_path "),
    ("no_such_dir", "error: --train_data_dir /no/such/dir: "),
    ("fp16_on_cpu", "error: --mixed_precision fp16 needs a GPU"),
    ("rank", "error: --resume_from_checkpoint "),
    ("fewer_targets", "error: --resume_from_checkpoint {out}/checkpoint-4: "),
    ("more_targets", "error: --resume_from_checkpoint {out}/checkpoint-4: "),
    ("no_captions", "error: no column 'text'; give --instance_prompt or caption files: FileNotFoundError: "),
    ("corrupt_image", "error: image "),
    ("deepspeed", "error: launch with DDP, not DeepSpeed or FSDP"),
])
def test_bad_input_is_one_clear_error(case, expected, reference, tiny_sd_path, kohya_folder, corrupt_folder, tmp_path,
                                      run_in_process, monkeypatch):
    resumed = case in ("rank", "fewer_targets", "more_targets")
    out = resume_copy(reference, "checkpoint-4", tmp_path / "out") if resumed else tmp_path / "out"
    args = ["--pretrained_model_name_or_path", tiny_sd_path, "--train_data_dir", kohya_folder, "--resolution", "64",
            "--output_dir", out, "--report_to", "none", "--train_text_encoder"]
    changes = {"target": ["--lora_target_modules", "to_x"], "not_a_pipeline": ["--pretrained_model_name_or_path", tmp_path],
               "no_such_dir": ["--train_data_dir", "/no/such/dir"], "fp16_on_cpu": ["--mixed_precision", "fp16"],
               "rank": ["--rank", "8", "--lora_target_modules", KOHYA_TARGETS, "--resume_from_checkpoint", "latest"],
               "fewer_targets": ["--rank", "4", "--resume_from_checkpoint", "latest"],  # the default: attention's
               "more_targets": ["--lora_target_modules", KOHYA_TARGETS + ",conv1", "--resume_from_checkpoint", "latest"],
               "no_captions": ["--caption_extension", ".caption"], "corrupt_image": ["--train_data_dir", corrupt_folder,
                                                                                 "--caption_column", "text"],
               # Before the models load: a model that does not exist is never reached.
               "deepspeed": ["--pretrained_model_name_or_path", tmp_path / "no-model"]}
    if case == "deepspeed":
        require_deepspeed()
        monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
        monkeypatch.setenv("ACCELERATE_DEEPSPEED_ZERO_STAGE", "2")
    before = sorted(p.name for p in out.rglob("*")) if out.exists() else []
    error = run_in_process(SCRIPT, args + changes.get(case, []))
    assert error.startswith(expected.format(out=out)) and "\n" not in error
    assert (sorted(p.name for p in out.rglob("*")) if out.exists() else []) == before
