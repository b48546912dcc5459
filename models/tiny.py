"""A tiny chat model the project builds offline: a byte-level BPE tokenizer trained on the
environments' own text, a ChatML chat template, and a small Llama-architecture causal LM with
random weights.

    python tiny_model.py OUT_DIR [--layers 4 --hidden 256 --vocab 2048]

The result is an ordinary Hugging Face folder: `AutoTokenizer.from_pretrained(OUT_DIR)` and
`AutoModelForCausalLM.from_pretrained(OUT_DIR)` load it, like any hub model. Random weights
cannot play a game; train.py warm-starts it with supervised fine-tuning on expert trajectories
(recipes/sft.py).
"""

from __future__ import annotations

import argparse
import os

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

# ChatML, the format of Qwen2.5 and many others: the turn ends with <|im_end|>, which the
# model samples.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def corpus(env_names=("textcraft", "babyai"), tasks_per_env: int = 200) -> list[str]:
    """Text the tokenizer learns its merges from: every env's instructions, first
    observations, and expert episodes (actions and observations) on a sample of tasks.
    Deterministic."""
    from env_server import get_env_class
    from env_server.agents import ACK, react_reply, system_prompt

    texts = []
    for name in env_names:
        env_cls = get_env_class(name)
        world = env_cls.load_world(None)
        env = env_cls(world)
        texts += [system_prompt(name), ACK]
        n = env_cls.num_tasks(world)
        for idx in range(0, n, max(1, n // tasks_per_env)):
            texts.append(env.reset(idx))
            for _ in range(30):
                action = env.expert_action()
                if action is None:
                    break
                texts.append(react_reply(name, action))
                step = env.step(action)
                texts.append(step.observation)
                if step.done:
                    break
    return texts


def build_tokenizer(texts: list[str], vocab_size: int = 2048,
                    kind: str = "bpe") -> PreTrainedTokenizerFast:
    """kind "bpe": byte-level BPE, encodes any text. kind "words": one token per word (with
    the space before it), digit or punctuation mark seen in `texts` ("[UNK]" for unseen words):
    Corridor's 50-token vocabulary."""
    if kind == "words":
        tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
        # words with the space before them (as GPT-2's tokenizer has them: " right" in a
        # sentence, "right" opening a reply, two tokens), digits, single punctuation marks and
        # other runs of whitespace are tokens: decoding joins them back into exactly the text
        # that was encoded
        tok.pre_tokenizer = pre_tokenizers.Split(
            Regex(r" ?[A-Za-z]+|[0-9]|\s+|[^A-Za-z0-9\s]"), behavior="isolated")
        tok.decoder = decoders.Fuse()
        trainer = trainers.WordLevelTrainer(vocab_size=vocab_size,
                                            special_tokens=SPECIAL_TOKENS + ["[UNK]"],
                                            show_progress=False)
        # the chat template's role names, and every digit: numbers are spelled digit by digit
        texts = texts + ["user\nassistant\nsystem\n", " ".join("0123456789")]
    elif kind == "bpe":
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                      show_progress=False)
    else:
        raise ValueError(f"--tokenizer must be bpe or words, got {kind!r}")
    tok.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>",
                                   additional_special_tokens=["<|im_start|>"],
                                   chat_template=CHAT_TEMPLATE, model_max_length=8192)


def build_model(vocab_size: int, layers: int = 4, hidden: int = 256, heads: int = 4,
                seed: int = 0, max_positions: int = 8192,
                init_std: float = 0.02) -> LlamaForCausalLM:
    # One key/value head per query head: with grouped-query attention transformers copies the
    # whole KV cache out to every head at each decoding step on CPU, 5x slower at 3,000 cached
    # tokens.
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden,
                         intermediate_size=hidden * 3, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=heads,
                         max_position_embeddings=max_positions, tie_word_embeddings=True,
                         rope_theta=10000.0, bos_token_id=None, eos_token_id=None,
                         pad_token_id=None, initializer_range=init_std)
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


def build(out_dir: str, env_names=("textcraft", "babyai"), vocab_size: int = 2048,
          layers: int = 4, hidden: int = 256, heads: int = 4, seed: int = 0,
          tokenizer: str = "bpe", init_std: float = 0.02) -> str:
    tok = build_tokenizer(corpus(env_names), vocab_size, tokenizer)
    model = build_model(len(tok), layers, hidden, heads, seed, init_std=init_std)
    model.config.eos_token_id = tok.eos_token_id
    model.config.pad_token_id = tok.pad_token_id
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    os.makedirs(out_dir, exist_ok=True)
    tok.save_pretrained(out_dir)
    model.save_pretrained(out_dir)
    return out_dir


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out_dir")
    p.add_argument("--envs", default="textcraft,babyai",
                   help="environments whose text trains the tokenizer")
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tokenizer", default="bpe", choices=["bpe", "words"])
    p.add_argument("--init-std", type=float, default=0.02,
                   help="std of the random initial weights (transformers' default 0.02)")
    a = p.parse_args()
    envs = tuple(a.envs.split(","))
    path = build(a.out_dir, envs, a.vocab, a.layers, a.hidden, a.heads, a.seed, a.tokenizer,
                 a.init_std)
    n = sum(x.numel() for x in LlamaForCausalLM.from_pretrained(path).parameters())
    print(f"tiny model written to {path} ({n / 1e6:.2f}M parameters)")


if __name__ == "__main__":
    main()
