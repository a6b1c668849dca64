"""Make a tiny, reproducible Hugging Face model folder for development, tests and benchmarks.

No model can be downloaded where this project is built and tested, so it makes its own: a byte-level BPE
tokenizer trained with ``tokenizers`` on ``data/corpus.txt`` (code, English and Chinese; the wheel ships it as
package data), with a chat template, and a seeded, randomly initialised Llama model saved with
``save_pretrained``. Everything else loads the folder with the ordinary ``from_pretrained`` code, exactly as it
would load a real model. ``--kind vlm`` makes a LLaVA-style vision-language model instead: a small CLIP vision
tower and projector in front of the same tiny Llama, with a processor whose ``<image>`` token stands for
:data:`VLM_IMAGE_TOKENS` image features. ``--kind lora BASE DIR`` makes a seeded random LoRA adapter for the
model folder BASE, in peft's ``save_pretrained`` layout, for tests of adapters served beside the base model.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
from pathlib import Path

CORPUS = Path(__file__).with_name("data") / "corpus.txt"
BOS, EOS, UNK, PAD = "<s>", "</s>", "<unk>", "<pad>"
IMAGE_TOKEN = "<image>"
VLM_IMAGE_SIZE, VLM_PATCH_SIZE = 32, 8
VLM_IMAGE_TOKENS = (VLM_IMAGE_SIZE // VLM_PATCH_SIZE) ** 2  # CLIP's patches; its CLS feature is dropped
# ChatML-like, starting with BOS as Llama's templates do, so that the OpenAI chat routes serve the tiny model
# out of the box. Its markers are plain text to this tokenizer: the vocabulary stays as trained.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _train_tokenizer(vocab_size: int, extra_special_tokens: dict[str, str] | None = None):
    """Byte-level BPE with BOS/EOS, wrapped as a transformers fast tokenizer that adds BOS like Llama;
    ``extra_special_tokens`` (name -> text, e.g. ``image_token``) are added after the trained vocabulary."""
    if not CORPUS.is_file():  # else the tokenizers library fails with a bare "No such file or directory"
        raise FileNotFoundError(
            f"the tokenizer's training text {CORPUS} is missing: this install of ferry-llm lacks its package data"
        )
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE(unk_token=None))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[UNK, BOS, EOS, PAD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train([str(CORPUS)], trainer)
    bos_id = tokenizer.token_to_id(BOS)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token=BOS, eos_token=EOS, unk_token=UNK, pad_token=PAD,
        chat_template=CHAT_TEMPLATE,
        # only when there are some: an empty list saved in tokenizer_config.json would hide a folder's
        # special_tokens_map.json additional_special_tokens from transformers
        **({"extra_special_tokens": extra_special_tokens} if extra_special_tokens else {}),
    )


def _text_config(tokenizer):
    """The tiny Llama's shape, for the text model and the VLM's language model alike."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=352,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        # A wider init than the default 0.02 spreads the logits of a random model, so greedy decoding
        # rarely meets near-ties that batched and unbatched float arithmetic could resolve differently.
        initializer_range=0.1,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )


def _save(out_dir: Path, *parts) -> Path:
    """``save_pretrained`` each part into ``out_dir`` atomically: a half-written folder is never seen."""
    out_dir = Path(out_dir)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}-", dir=out_dir.parent))
    staging.chmod(0o755)
    for part in parts:
        part.save_pretrained(staging)
    if out_dir.exists():
        shutil.rmtree(out_dir)
    try:
        os.rename(staging, out_dir)
    except OSError:  # another process finished the same folder first: keep theirs
        shutil.rmtree(staging, ignore_errors=True)
    return out_dir


def make_tiny_model(out_dir: Path, *, vocab_size: int = 4096, seed: int = 0) -> Path:
    """Write the tokenizer and model to ``out_dir``."""
    import torch
    from transformers import GenerationConfig, LlamaForCausalLM

    Path(out_dir).parent.mkdir(parents=True, exist_ok=True)
    tokenizer = _train_tokenizer(vocab_size)
    config = _text_config(tokenizer)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id
    )
    return _save(out_dir, model, tokenizer)


def make_tiny_vlm(out_dir: Path, *, vocab_size: int = 4096, seed: int = 0) -> Path:
    """Write a LLaVA-style model (CLIP vision tower, projector, the tiny Llama) and its processor to
    ``out_dir``: ``AutoProcessor`` and ``AutoModelForImageTextToText`` load it as they load LLaVA 1.5."""
    import torch
    from transformers import (
        CLIPImageProcessor,
        CLIPVisionConfig,
        GenerationConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaProcessor,
    )

    Path(out_dir).parent.mkdir(parents=True, exist_ok=True)
    tokenizer = _train_tokenizer(vocab_size, {"image_token": IMAGE_TOKEN})
    text_config = _text_config(tokenizer)
    vision_config = CLIPVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        image_size=VLM_IMAGE_SIZE, patch_size=VLM_PATCH_SIZE, projection_dim=32,
    )
    config = LlavaConfig(
        vision_config=vision_config, text_config=text_config, image_token_index=tokenizer.image_token_id,
        vision_feature_select_strategy="default", vision_feature_layer=-1, image_seq_length=VLM_IMAGE_TOKENS,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(config)
    model.generation_config = GenerationConfig(
        bos_token_id=text_config.bos_token_id, eos_token_id=text_config.eos_token_id,
        pad_token_id=text_config.pad_token_id,
    )
    image_processor = CLIPImageProcessor(
        size={"shortest_edge": VLM_IMAGE_SIZE}, crop_size={"height": VLM_IMAGE_SIZE, "width": VLM_IMAGE_SIZE}
    )
    processor = LlavaProcessor(
        image_processor=image_processor, tokenizer=tokenizer, patch_size=VLM_PATCH_SIZE,
        vision_feature_select_strategy="default", num_additional_image_tokens=1, image_token=IMAGE_TOKEN,
        chat_template=CHAT_TEMPLATE,
    )
    return _save(out_dir, model, processor)


LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LORA_B_STD = 0.1
"""The spread of the adapter's ``lora_B`` weights. peft starts B at zero (a trained adapter moves it), which
would make a fresh adapter a no-op; at this spread each adapted layer's output moves by a sixth to a third of the
base layer's, so greedy decoding of the tiny model visibly changes."""


def make_tiny_lora(base: Path, out_dir: Path, *, seed: int = 0, rank: int = 8) -> Path:
    """Write a LoRA adapter for the model folder ``base`` to ``out_dir``: every attention and MLP projection
    adapted at ``rank``, ``lora_A`` as peft initialises it and ``lora_B`` random too, both from ``seed``."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    if not Path(base, "config.json").is_file():  # else from_pretrained would look for it on the Hub
        raise FileNotFoundError(f"{base} is not a model folder (no config.json)")
    Path(out_dir).parent.mkdir(parents=True, exist_ok=True)
    model = AutoModelForCausalLM.from_pretrained(str(base))
    config = LoraConfig(task_type="CAUSAL_LM", r=rank, lora_alpha=2 * rank, target_modules=LORA_TARGETS)
    torch.manual_seed(seed)
    adapted = get_peft_model(model, config)
    with torch.no_grad():
        for name, parameter in adapted.named_parameters():
            if "lora_B" in name:
                parameter.normal_(std=LORA_B_STD)
    return _save(out_dir, adapted)


KINDS = {"llm": make_tiny_model, "vlm": make_tiny_vlm}


def ensure_tiny_model(out_dir: Path) -> Path:
    """Make the model folder unless a complete one is already there; one made before the tiny model had a chat
    template (no ``chat_template.jinja``) is made again, so that chat works on it too."""
    if not (Path(out_dir) / "chat_template.jinja").exists():
        make_tiny_model(out_dir)
    return Path(out_dir)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("base", type=Path, nargs="?", metavar="BASE",
                        help="--kind lora: the model folder the adapter is for")
    parser.add_argument("out_dir", type=Path, metavar="DIR", help="folder to write the model (or adapter) to")
    parser.add_argument("--kind", choices=[*KINDS, "lora"], default="llm",
                        help="llm: a causal LM (default); vlm: a LLaVA-style vision-language model; "
                             "lora: a LoRA adapter for the model folder BASE")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--rank", type=int, default=8, help="--kind lora: the adapter's rank")
    args = parser.parse_args(argv)
    if (args.kind == "lora") != (args.base is not None):
        parser.error("--kind lora takes two folders, BASE and DIR" if args.kind == "lora"
                     else f"--kind {args.kind} takes one folder, DIR")
    try:
        if args.kind == "lora":
            path = make_tiny_lora(args.base, args.out_dir, seed=args.seed, rank=args.rank)
        else:
            path = KINDS[args.kind](args.out_dir, vocab_size=args.vocab_size, seed=args.seed)
    except FileNotFoundError as exc:
        parser.exit(1, f"{parser.prog}: {exc}\n")
    print(path)


if __name__ == "__main__":
    main()
