"""Offline stand-ins for the recipes' smoke mode: a word-level tokenizer and small synthetic datasets.

The smoke mode of each recipe checks the whole pipeline (tokenise/transform, DPTrainer, evaluate,
save, privacy card) in seconds on a CPU with no network. These helpers replace the two things that
would be downloaded: the tokenizer and the dataset. Each synthetic dataset has the *same columns*
as the real one (GLUE QNLI, arXiv abstracts, Alpaca, CIFAR), so the recipe's own preprocessing
code runs unchanged, and a simple learnable pattern, so a training loss can go down.
"""

from __future__ import annotations

import datasets
import numpy as np
from tokenizers import Tokenizer, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

TOPICS = ("graph", "noise", "model", "vision", "kernel", "privacy", "language", "matrix")
FILLERS = ("the", "a", "of", "is", "we", "study", "show", "that", "and", "new", "for", "with")
NUMBERS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
PROMPT_WORDS = ("###", "instruction", "response", "count", "from", "what", "which", ":", "?", ".")
VOCABULARY = tuple(dict.fromkeys(TOPICS + FILLERS + NUMBERS + PROMPT_WORDS))


def word_tokenizer(style: str = "bert", model_max_length: int = 64) -> PreTrainedTokenizerFast:
    """A fast word-level tokenizer over :data:`VOCABULARY`.

    ``style="bert"``: ``[PAD] [UNK] [CLS] [SEP] [MASK]`` and BERT's single/pair templates (with
    ``token_type_ids``). ``style="causal"``: ``<pad> <unk> <eos>``, no template (as GPT-2/Qwen).
    """
    if style == "bert":
        specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
        special_kwargs = dict(
            pad_token="[PAD]", unk_token="[UNK]", cls_token="[CLS]", sep_token="[SEP]", mask_token="[MASK]"
        )
        input_names = ["input_ids", "token_type_ids", "attention_mask"]
    elif style == "causal":
        specials = ["<pad>", "<unk>", "<eos>"]
        special_kwargs = dict(pad_token="<pad>", unk_token="<unk>", eos_token="<eos>")
        input_names = ["input_ids", "attention_mask"]
    else:
        raise ValueError(f"style must be 'bert' or 'causal', got {style!r}.")
    vocab = {token: index for index, token in enumerate(specials + list(VOCABULARY))}
    backend = Tokenizer(models.WordLevel(vocab, unk_token=special_kwargs["unk_token"]))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    if style == "bert":
        backend.post_processor = processors.TemplateProcessing(
            single="[CLS] $A [SEP]",
            pair="[CLS] $A [SEP] $B:1 [SEP]:1",
            special_tokens=[("[CLS]", vocab["[CLS]"]), ("[SEP]", vocab["[SEP]"])],
        )
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        model_max_length=model_max_length,
        model_input_names=input_names,
        **special_kwargs,
    )


CHAT_ROLES = ("<system>", "<user>", "<assistant>")

#: A minimal chat template: ``<role> content`` turns separated by spaces (the word-level tokenizer splits
#: on whitespace). The assistant's content and its end-of-turn ``<eos>`` are inside ``{% generation %}``,
#: so trl's ``assistant_only_loss`` trains exactly the assistant's tokens (stop token included).
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'assistant' -%}"
    "{{ '<assistant> ' }}{% generation %}{{ message['content'] + ' <eos>' }}{% endgeneration %}{{ ' ' }}"
    "{%- else -%}"
    "{{ '<' + message['role'] + '> ' + message['content'] + ' ' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<assistant> ' }}{%- endif -%}"
)


def chat_tokenizer(model_max_length: int = 64) -> PreTrainedTokenizerFast:
    """A word-level causal tokenizer (``<pad> <unk> <eos>``, the role markers, :data:`VOCABULARY`) with
    :data:`CHAT_TEMPLATE`: what ``trl.SFTTrainer`` needs for conversational data, built offline."""
    specials = ["<pad>", "<unk>", "<eos>"]
    vocab = {token: index for index, token in enumerate(specials + list(CHAT_ROLES) + list(VOCABULARY))}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        model_max_length=model_max_length,
        model_input_names=["input_ids", "attention_mask"],
        pad_token="<pad>",
        unk_token="<unk>",
        eos_token="<eos>",
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def chats_like(num_examples: int, seed: int, system: bool = False) -> datasets.Dataset:
    """Conversational ``messages`` (trl's format): the user asks to "count from N", the assistant answers
    with the next numbers (a random length, so rows differ in length); optionally a system turn."""
    rng = np.random.default_rng(seed)
    rows: list[list[dict[str, str]]] = []
    for _ in range(num_examples):
        start = int(rng.integers(0, 6))
        length = int(rng.integers(2, 5))
        turns = [{"role": "system", "content": "count ."}] if system else []
        turns += [
            {"role": "user", "content": f"count from {NUMBERS[start]}"},
            {"role": "assistant", "content": " ".join(NUMBERS[start + 1 : start + 1 + length])},
        ]
        rows.append(turns)
    return datasets.Dataset.from_dict({"messages": rows})


def _words(rng: np.random.Generator, pool: tuple[str, ...], count: int) -> list[str]:
    return [pool[i] for i in rng.integers(0, len(pool), count)]


def qnli_like(num_examples: int, seed: int) -> datasets.Dataset:
    """GLUE QNLI's columns (question, sentence, label, idx); label 0 (entailment) iff the sentence
    mentions the question's topic, as QNLI's label says whether the sentence answers the question."""
    rng = np.random.default_rng(seed)
    rows: dict[str, list] = {"question": [], "sentence": [], "label": [], "idx": []}
    for index in range(num_examples):
        topic = TOPICS[rng.integers(len(TOPICS))]
        label = int(rng.integers(2))
        other = [t for t in TOPICS if t != topic]
        subject = topic if label == 0 else other[rng.integers(len(other))]
        rows["question"].append(" ".join(["what", "is", "the", topic, "?"]))
        rows["sentence"].append(
            " ".join(_words(rng, FILLERS, 3) + [subject] + _words(rng, FILLERS, 3) + ["."])
        )
        rows["label"].append(label)
        rows["idx"].append(index)
    features = datasets.Features(
        {
            "question": datasets.Value("string"),
            "sentence": datasets.Value("string"),
            "label": datasets.ClassLabel(names=["entailment", "not_entailment"]),
            "idx": datasets.Value("int32"),
        }
    )
    return datasets.Dataset.from_dict(rows, features=features)


def abstracts_like(num_examples: int, seed: int) -> datasets.Dataset:
    """arXiv-abstract-like text in an ``abstract`` column: templated sentences whose masked words
    can be predicted from the rest (the topic word repeats)."""
    rng = np.random.default_rng(seed)
    texts = []
    for _ in range(num_examples):
        topic, other = (TOPICS[i] for i in rng.choice(len(TOPICS), 2, replace=False))
        texts.append(
            f"we study the {topic} of a new {other} and we show that the {topic} is {NUMBERS[rng.integers(10)]} ."
        )
    return datasets.Dataset.from_dict({"abstract": texts})


def instructions_like(num_examples: int, seed: int) -> datasets.Dataset:
    """Alpaca's columns (instruction, input, output): "count from N" answered by the next numbers."""
    rng = np.random.default_rng(seed)
    rows: dict[str, list] = {"instruction": [], "input": [], "output": []}
    for _ in range(num_examples):
        start = int(rng.integers(0, 6))
        rows["instruction"].append(f"count from {NUMBERS[start]}")
        rows["input"].append("")
        rows["output"].append(" ".join(NUMBERS[start : start + 4]))
    return datasets.Dataset.from_dict(rows)


def images_like(
    num_examples: int, num_classes: int, size: int, seed: int, label_column: str = "label"
) -> datasets.Dataset:
    """CIFAR's columns (``img`` as ``[size, size, 3]`` uint8, integer labels); each class has its own
    mean colour plus noise, so a classifier can learn it quickly."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, num_classes, num_examples)
    palette = rng.integers(30, 225, (num_classes, 3))
    images = palette[labels][:, None, None, :] + rng.normal(0, 25, (num_examples, size, size, 3))
    images = np.clip(images, 0, 255).astype(np.uint8)
    features = datasets.Features(
        {
            "img": datasets.Array3D(shape=(size, size, 3), dtype="uint8"),
            label_column: datasets.ClassLabel(names=[f"class_{i}" for i in range(num_classes)]),
        }
    )
    return datasets.Dataset.from_dict({"img": images, label_column: labels}, features=features)
