"""toy_linear.py: the loop learns w, and every way of running it gives the same w."""
import shutil

import pytest
import torch
from conftest import run_script
from safetensors.torch import load_file

TRUE_W = torch.tensor([[2.0, 3.0, 4.0, 7.0]])


def train(out, *args, num_processes=1):
    log = run_script("toy_linear.py", ["--output_dir", out, "--report_to", "none", *args], num_processes=num_processes)
    return load_file(f"{out}/model.safetensors")["weight"], log


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One default run (1 process, batch 32, 640 steps, checkpoints every 100), shared by the tests below."""
    out = tmp_path_factory.mktemp("toy") / "ref"
    return out, *train(out)


def test_learns_true_w(reference):
    out, w, log = reference
    assert (w - TRUE_W).abs().max() < 1e-2
    assert "learned w:" in log and "true w:" in log


def test_plain_pytorch_loop_matches_accelerate(reference, tmp_path):
    _, w, _ = reference
    w_plain, _ = train(tmp_path / "plain", "--plain")
    torch.testing.assert_close(w_plain, w, rtol=1e-6, atol=1e-7)


def test_resume_mid_epoch_matches_uninterrupted_run(reference, tmp_path):
    out, w, _ = reference
    # As if the run had died after step 300 (9 epochs of 32 steps, then 12 steps into the 10th)
    (tmp_path / "resumed").mkdir()
    shutil.copytree(out / "checkpoint-300", tmp_path / "resumed" / "checkpoint-300")
    w_resumed, log = train(tmp_path / "resumed", "--resume_from_checkpoint", "latest")
    assert "Resumed from" in log and "checkpoint-300" in log
    torch.testing.assert_close(w_resumed, w, rtol=1e-6, atol=1e-7)


def test_two_processes_match_one_with_same_global_batch(reference, tmp_path):
    _, w, _ = reference
    w2, _ = train(tmp_path / "ddp", "--train_batch_size", "16", num_processes=2)
    torch.testing.assert_close(w2, w, rtol=1e-5, atol=1e-6)


def test_gradient_accumulation_matches_full_batch(reference, tmp_path):
    _, w, _ = reference
    w_acc, _ = train(tmp_path / "acc", "--train_batch_size", "16", "--gradient_accumulation_steps", "2")
    torch.testing.assert_close(w_acc, w, rtol=1e-5, atol=1e-6)


def test_checkpoint_rotation_and_missing_resume(tmp_path):
    out = tmp_path / "rot"
    # `latest` with none yet starts afresh; rotation keeps the last two; no temporary folder stays
    train(out, "--max_train_steps", "60", "--checkpointing_steps", "10", "--checkpoints_total_limit", "2",
          "--resume_from_checkpoint", "latest")
    assert sorted(p.name for p in out.iterdir() if "checkpoint" in p.name) == ["checkpoint-50", "checkpoint-60"]
    # a named checkpoint that is missing is one clear error (starting afresh would rotate the others away)
    log = run_script("toy_linear.py", ["--output_dir", out, "--resume_from_checkpoint", "checkpoint-999"], expect_fail=True)
    assert f"error: --resume_from_checkpoint {out}/checkpoint-999: " in log
