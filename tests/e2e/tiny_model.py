"""A tiny random-weight LLaVA, built offline and seeded, so a real vLLM engine runs it on a CPU.

There is no network to a model hub here, so the end-to-end suite makes its own model: a byte-level
BPE tokenizer trained on a fixed text, a CLIP vision tower (2 layers, width 64) over 56x56 images
(16 patches of 14 pixels: 16 image tokens per image), a projector, and a Llama text model (2
layers, hidden 128, vocabulary 512). The weights are random but seeded: every build of the same
generator writes the same bytes, so greedy tokens are reproducible, and different images give
different tokens (the output depends on the image, so a wrong or missing embedding shows).

`model_dir()` builds it once into a cache directory (ECD_E2E_CACHE, as `make test-e2e` sets it)
named after this file's digest: a change
to the generator builds a new model, an unchanged one is reused across runs.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from pathlib import Path

SEED = 20261201
IMAGE_SIZE = 56
PATCH_SIZE = 14
IMAGE_TOKENS = (IMAGE_SIZE // PATCH_SIZE) ** 2
VISION_WIDTH = 64
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


def model_dir(cache: Path | None = None) -> Path:
    """The model's directory, built on first use (atomically: a crash mid-build leaves no half
    model behind for the next run to trust)."""
    if cache is None:
        default = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "ecd"
        cache = Path(os.environ.get("ECD_E2E_CACHE", default))
    digest = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:12]
    target = cache / f"e2e-tiny-llava-{digest}"
    if (target / "model.safetensors").exists():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=cache))
    try:
        build(scratch)
        os.rename(scratch, target)
    except OSError:
        if not (target / "model.safetensors").exists():
            raise
        shutil.rmtree(scratch, ignore_errors=True)  # another process built it meanwhile
    except BaseException:
        shutil.rmtree(scratch, ignore_errors=True)
        raise
    return target


def build(dest: Path) -> None:
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
            size={"shortest_edge": IMAGE_SIZE},
            crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE},
        ),
        tokenizer=tokenizer,
        patch_size=PATCH_SIZE,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,  # CLIP's class token, dropped by "default"
    )
    processor.save_pretrained(dest)

    config = LlavaConfig(
        vision_config=CLIPVisionConfig(
            hidden_size=VISION_WIDTH,
            intermediate_size=2 * VISION_WIDTH,
            num_hidden_layers=2,
            num_attention_heads=2,
            image_size=IMAGE_SIZE,
            patch_size=PATCH_SIZE,
            projection_dim=VISION_WIDTH,
        ),
        text_config=LlamaConfig(
            hidden_size=TEXT_WIDTH,
            intermediate_size=2 * TEXT_WIDTH,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=VOCAB,
            max_position_embeddings=512,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        ),
        image_token_index=image_token,
        image_seq_length=IMAGE_TOKENS,
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
