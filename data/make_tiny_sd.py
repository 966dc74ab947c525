"""Build data/tiny-sd/: a tiny Stable Diffusion 1.x pipeline for 16 px digits, offline, seeded.

    python data/make_tiny_sd.py                   # 2-3 minutes on 2 idle CPU cores
    python data/make_tiny_sd.py --vae_steps 20    # seconds, a poor VAE: for the tests

Seeded: every run writes the same weights, given the same number of CPU threads (with another,
float sums run in another order). On cores busy with other work, OMP_NUM_THREADS=1 can be several
times faster: each operation waits for its slowest thread.

The folder has SD 1.x's layout (model_index.json, vae/, text_encoder/, tokenizer/, unet/,
scheduler/), so StableDiffusionPipeline.from_pretrained, train_text_to_image.py and train_lora.py
take it like a hub model. Only the VAE is trained here (on data/digits/); the UNet is left at its
random initialisation, for train_text_to_image.py to train. The VAE is also checked on the LoRA
demo's style, data/bold-digits/, which it never trains on.
"""

import argparse
import json
import tempfile
import time
from functools import cache
from pathlib import Path

import numpy as np
import torch
from diffusers import AutoencoderKL, DDPMScheduler, StableDiffusionPipeline, UNet2DConditionModel
from make_bold_digits import DATA, SIZE, TRIGGER, ink, read_images
from sklearn.datasets import load_digits
from sklearn.svm import SVC
from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer

NAMES = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]
WORDS = ["a", "handwritten", "digit", TRIGGER, *NAMES]  # every word of the captions
MAX_LENGTH = 8  # <|startoftext|> a bold handwritten digit seven <|endoftext|> is 7 tokens


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--output_dir", type=Path, default=DATA / "tiny-sd")
    parser.add_argument("--vae_steps", type=int, default=800, help="batches of 64 digits")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def make_tokenizer(folder, words=WORDS, max_length=MAX_LENGTH):
    """A CLIP tokenizer (byte-level BPE) that writes each of `words` as one token.

    The vocabulary starts with the 256 byte symbols, alone and as word ends ("</w>"), so any text
    can be written. Each merge joins two tokens into a new one; merging every word from the left
    makes it a single token. Other words fall back to pieces, down to single bytes.
    """
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]  # GPT-2/CLIP's byte map
    others = iter(range(256, 512))
    symbols = [chr(b) if b in printable else chr(next(others)) for b in range(256)]
    tokens, merges = [*symbols, *(s + "</w>" for s in symbols)], []
    for word in words:
        parts = [*word[:-1], word[-1] + "</w>"]
        while len(parts) > 1:
            if parts[0] + parts[1] not in tokens:
                merges.append(f"{parts[0]} {parts[1]}")
                tokens.append(parts[0] + parts[1])
            parts[:2] = [parts[0] + parts[1]]
    tokens += ["<|startoftext|>", "<|endoftext|>"]
    vocab, merges_file = Path(folder) / "vocab.json", Path(folder) / "merges.txt"
    vocab.write_text(json.dumps({token: i for i, token in enumerate(tokens)}))
    merges_file.write_text("#version: 0.2\n" + "".join(m + "\n" for m in merges))
    tokenizer = CLIPTokenizer(str(vocab), str(merges_file), model_max_length=max_length)
    assert all(tokenizer.tokenize(word) == [word + "</w>"] for word in words)
    return tokenizer


def make_text_encoder(tokenizer):
    """A tiny CLIP text encoder, random and frozen (no script trains it).

    It needs no training: the UNet only has to tell the captions apart, and a random encoder
    already gives different words different embeddings, which we check.
    """
    config = CLIPTextConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=MAX_LENGTH,
        projection_dim=64,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    text_encoder = CLIPTextModel(config).eval()
    captions = [f"a handwritten digit {name}" for name in NAMES]
    ids = tokenizer(captions, padding="max_length", return_tensors="pt").input_ids
    with torch.no_grad():
        embeddings = text_encoder(ids).last_hidden_state.flatten(1)  # what the UNet attends to
    distance = torch.cdist(embeddings, embeddings) / embeddings.norm(dim=1).mean()
    closest = distance[~torch.eye(len(NAMES), dtype=bool)].min().item()
    print(f"text encoder: the 10 digit captions' embeddings are >= {closest:.2f} apart (relative)")
    assert closest > 0.1, "two digit captions are (almost) the same to the UNet"
    return text_encoder


def to_pixels(grey):
    """Grey images (N, 16, 16) in [0, 1] as the training scripts feed the VAE: RGB in [-1, 1]."""
    return torch.as_tensor(grey)[:, None].repeat(1, 3, 1, 1) * 2 - 1


def train_vae(grey, steps, generator):
    """A tiny AutoencoderKL, 16x16x3 pixels <-> 8x8x4 latents, trained on the digits.

    The loss: reconstruction (MSE) plus the KL divergence from N(0, 1), weighted 1e-6 as in SD's
    VAE, just enough to keep the latents from drifting. (SD adds perceptual and GAN losses for
    sharp photos; 16 px digits do without.)
    """
    vae = AutoencoderKL(
        block_out_channels=(32, 64),  # two blocks: one downsampling, 16 px -> 8x8 latents
        down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2,
        latent_channels=4,
        sample_size=SIZE,
    )
    pixels = to_pixels(grey)
    optimizer = torch.optim.AdamW(vae.parameters(), lr=1e-3)
    start = time.perf_counter()
    for step in range(1, steps + 1):
        batch = pixels[torch.randint(len(pixels), (64,), generator=generator)]
        posterior = vae.encode(batch).latent_dist
        reconstruction = vae.decode(posterior.sample(generator)).sample
        mse = torch.nn.functional.mse_loss(reconstruction, batch)
        loss = mse + 1e-6 * posterior.kl().mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step % 100 == 0 or step == steps:
            seconds = time.perf_counter() - start
            print(f"VAE step {step}/{steps}: MSE {mse.item():.4f} ({seconds:.0f} s)")
    return vae.eval()


@torch.no_grad()
def reconstruct(vae, grey):
    """Encode and decode grey images; the result is grey again (mean of the channels), in [0, 1]."""
    decoded = vae.decode(vae.encode(to_pixels(grey)).latent_dist.mode()).sample
    return ((decoded.mean(1) + 1) / 2).clamp(0, 1).numpy()


@cache
def digits_classifier():
    digits = load_digits()
    return SVC(gamma=0.001).fit(digits.data, digits.target)


def read_as(grey, labels):
    """Share of grey images (N, 16, 16) in [0, 1] that a classifier trained on the 8x8 digits
    reads as `labels`. As tests/test_learning.py's judge: the images are area-downsampled to the
    data's 8x8 grid and scaled to its 0..16 ink counts."""
    small = torch.nn.functional.interpolate(torch.as_tensor(grey)[:, None], size=8, mode="area")
    return (digits_classifier().predict(small.flatten(1).numpy() * 16) == labels).mean()


def make_unet():
    """SD 1.x's UNet in miniature: attention at the higher resolution (8x8), none at the lower.

    Random, for train_text_to_image.py to train. cross_attention_dim is the text encoder's width.
    """
    return UNet2DConditionModel(
        sample_size=SIZE // 2,  # in latents: the pipeline's default images are 16 px
        in_channels=4,
        out_channels=4,
        block_out_channels=(32, 64),
        layers_per_block=1,
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=64,
        attention_head_dim=4,  # for this UNet class, diffusers' name for the number of heads
    )


def main(argv=None):
    args = parse_args(argv)
    start = time.perf_counter()
    generator = torch.Generator().manual_seed(args.seed)  # batches and latent noise
    digits, rows = read_images(DATA / "digits")
    # The LoRA demo's bold digits, and the digits they were made from (same file names)
    bold, bold_rows = read_images(DATA / "bold-digits")
    names = [row["file_name"] for row in rows]
    normal = digits[[names.index(row["file_name"]) for row in bold_rows]]
    labels = np.array([row["label"] for row in bold_rows])

    with tempfile.TemporaryDirectory() as folder:  # the tokenizer keeps its vocabulary in memory
        tokenizer = make_tokenizer(folder)
    torch.manual_seed(args.seed)
    text_encoder = make_text_encoder(tokenizer)
    torch.manual_seed(args.seed)
    vae = train_vae(digits, args.vae_steps, generator)

    # SD scales latents to unit variance before the diffusion sees them (SD 1.x: 0.18215);
    # measured like the training scripts draw them, a sample of the posterior.
    with torch.no_grad():
        latents = vae.encode(to_pixels(digits)).latent_dist.sample(generator)
    vae.register_to_config(scaling_factor=1 / latents.std().item())
    print(f"latents' std {latents.std():.3f}: scaling_factor {vae.config.scaling_factor:.4f}")

    # Can the VAE draw the digits, and the bold ones it never saw? Both styles of the same 300
    # digits: the classifier must read the reconstructions, and their ink must stay apart.
    figures = {}  # also returned, for the tests
    for name, grey in [("digits", normal), ("bold digits", bold)]:
        again = reconstruct(vae, grey)
        figures[name] = {"read": read_as(grey, labels), "read_again": read_as(again, labels)}
        figures[name].update(ink=ink(grey).mean(), ink_again=ink(again).mean())
        print(
            "{}: {read:.1%} classified as their digit, reconstructions {read_again:.1%}; "
            "ink {ink:.3f}, reconstructions {ink_again:.3f}".format(name, **figures[name])
        )

    # And two of them side by side, 16 x 32 px, a shape it never trained on (guide 4's bucket
    # demo): each half must still read as its digit.
    pairs = np.concatenate([normal, normal[::-1]], axis=2)
    again = reconstruct(vae, pairs)
    read = [
        (read_as(g[..., :SIZE], labels) + read_as(g[..., SIZE:], labels[::-1])) / 2
        for g in (pairs, again)
    ]
    figures["pairs"] = {"read": read[0], "read_again": read[1]}
    print(
        f"digits side by side (16 x 32): {read[0]:.1%} of halves read as their digit, "
        f"reconstructions {read[1]:.1%}"
    )

    torch.manual_seed(args.seed)
    unet = make_unet()
    scheduler = DDPMScheduler(  # SD 1.x's training noise schedule
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
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        unet=unet,
        scheduler=scheduler,
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )
    pipe.save_pretrained(args.output_dir)
    for name in ["vae", "text_encoder", "unet"]:
        count = sum(p.numel() for p in getattr(pipe, name).parameters())
        print(f"{name}: {count:,} parameters")
    print(f"wrote {args.output_dir} in {time.perf_counter() - start:.0f} s")
    return figures


if __name__ == "__main__":
    main()
