"""The end-to-end suite's models: random-weight LLaVAs, built offline and seeded, so a real vLLM
engine runs them on a CPU.

There is no network to a model hub here, so the suite makes its own models: a byte-level BPE
tokenizer trained on a fixed text, a CLIP vision tower, a projector, and a Llama text model (2
layers, hidden 128, vocabulary 512). `TINY`'s vision tower (2 layers, width 64, over 56x56 images:
16 patches of 14 pixels, 16 image tokens per image) costs nothing, so the scenarios run fast;
`VIT_L_336`'s has the shape of CLIP ViT-L/14-336, the vision tower of LLaVA-1.5 (24 layers, width
1024, 16 heads, MLP 4096, 336x336 images: 577 positions, 576 image tokens), so that an encode costs
what a real model's does (compute does not depend on the weights' values) and a figure shows what
a hit saves. The weights are random but seeded: every build of the same generator writes the same
bytes, so greedy tokens are reproducible, and different images give different tokens (the output
depends on the image, so a wrong or missing embedding shows).

`model_dir(shape)` builds a model once into a cache directory (ECD_E2E_CACHE, as `make test-e2e`
sets it) named after the shape and this file's digest: a change to the generator builds new
models, an unchanged one is reused across runs.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

SEED = 20261201
PATCH_SIZE = 14
TEXT_WIDTH = 128  # the LM's input-embedding width: one ecd block is one row of it
VOCAB = 512
SPECIALS = ["<s>", "</s>", "<pad>", "<image>"]
CORPUS = [
    "a photo of a cat sitting on a mat",
    "the quick brown fox jumps over the lazy dog",
    "describe the image in one sentence",
    "USER: what is in this picture? ASSISTANT: there is a red square and a blue circle",
    "an encoder cache keeps vision embeddings in shared memory between engines",
] * 8


@dataclass(frozen=True)
class Shape:
    """A model's vision tower: what an encode costs. The text model is the same in every shape."""

    name: str  # the cache directory's prefix
    image_size: int
    width: int
    layers: int
    heads: int
    mlp: int

    @property
    def image_tokens(self) -> int:
        """Rows of one image's encoder output: one per patch (CLIP's class token is dropped)."""
        return (self.image_size // PATCH_SIZE) ** 2


TINY = Shape("e2e-tiny-llava", image_size=56, width=64, layers=2, heads=2, mlp=128)
VIT_L_336 = Shape("e2e-vitl336-llava", image_size=336, width=1024, layers=24, heads=16, mlp=4096)


def model_dir(shape: Shape = TINY, cache: Path | None = None) -> Path:
    """The model's directory, built on first use (atomically: a crash mid-build leaves no half
    model behind for the next run to trust)."""
    if cache is None:
        default = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "ecd"
        cache = Path(os.environ.get("ECD_E2E_CACHE", default))
    digest = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:12]
    target = cache / f"{shape.name}-{digest}"
    if (target / "model.safetensors").exists():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=cache))
    try:
        build(scratch, shape)
        os.rename(scratch, target)
    except OSError:
        if not (target / "model.safetensors").exists():
            raise
        shutil.rmtree(scratch, ignore_errors=True)  # another process built it meanwhile
    except BaseException:
        shutil.rmtree(scratch, ignore_errors=True)
        raise
    return target


def build(dest: Path, shape: Shape) -> None:
    import torch
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import (
        CLIPImageProcessor,
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaProcessor,
        PreTrainedTokenizerFast,
    )

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(
        CORPUS,
        trainers.BpeTrainer(
            vocab_size=300,
            special_tokens=SPECIALS,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        ),
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe, bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )
    tokenizer.add_special_tokens({"additional_special_tokens": ["<image>"]})
    image_token = tokenizer.convert_tokens_to_ids("<image>")
    processor = LlavaProcessor(
        image_processor=CLIPImageProcessor(
            size={"shortest_edge": shape.image_size},
            crop_size={"height": shape.image_size, "width": shape.image_size},
        ),
        tokenizer=tokenizer,
        patch_size=PATCH_SIZE,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,  # CLIP's class token, dropped by "default"
    )
    processor.save_pretrained(dest)

    config = LlavaConfig(
        vision_config=CLIPVisionConfig(
            hidden_size=shape.width,
            intermediate_size=shape.mlp,
            num_hidden_layers=shape.layers,
            num_attention_heads=shape.heads,
            image_size=shape.image_size,
            patch_size=PATCH_SIZE,
            projection_dim=shape.width,
        ),
        text_config=LlamaConfig(
            hidden_size=TEXT_WIDTH,
            intermediate_size=2 * TEXT_WIDTH,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=VOCAB,
            max_position_embeddings=1024,  # a prompt of VIT_L_336 holds 576 image tokens
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        ),
        image_token_index=image_token,
        image_seq_length=shape.image_tokens,
        vision_feature_select_strategy="default",
        vision_feature_layer=-2,
        torch_dtype="bfloat16",
    )
    config.architectures = ["LlavaForConditionalGeneration"]
    torch.manual_seed(SEED)
    model = LlavaForConditionalGeneration(config).to(torch.bfloat16)
    config.save_pretrained(dest)
    save_file(
        {_vllm_name(k): v.contiguous() for k, v in model.state_dict().items()},
        str(dest / "model.safetensors"),
        metadata={"format": "pt"},
    )


def _vllm_name(name: str) -> str:
    """transformers 5 saves LLaVA as `model.vision_tower.*`, `model.language_model.*`; vLLM
    0.32's loader maps the classic layout, where the vision tower is a CLIPVisionModel
    (`vision_tower.vision_model.*`) and the text model a causal LM (`language_model.model.*`)."""
    for new, old in (
        ("vision_tower.vision_model.", "model.vision_tower."),
        ("language_model.model.", "model.language_model."),
        ("multi_modal_projector.", "model.multi_modal_projector."),
        ("language_model.lm_head.", "lm_head."),
    ):
        if name.startswith(old):
            return new + name[len(old) :]
    raise ValueError(f"unexpected LLaVA weight {name}")
