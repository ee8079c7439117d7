"""Tiny causal LMs for tests: a byte-level BPE trained on real text and a random Llama sized to it."""
from pathlib import Path


def train_bpe(dst: Path, texts, vocab_size: int):
    """A byte-level BPE trained here on ``texts`` and saved to ``dst``: hermetic, and the kind of
    tokenizer the GGUF exporter and transformers' GGUF loader accept. Returns the loaded tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tk.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                      show_progress=False))
    PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|endoftext|>", bos_token="<|endoftext|>").save_pretrained(dst)
    return AutoTokenizer.from_pretrained(dst)


def tiny_llama(tok, intermediate_size: int, max_position_embeddings: int, seed: int = 0):
    """A random 2-layer Llama (hidden 64, tied embeddings) whose vocabulary is exactly the tokenizer's
    (a GGUF whose vocabulary has filler rows does not survive GGUF -> HF -> GGUF)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=intermediate_size, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                      max_position_embeddings=max_position_embeddings, eos_token_id=tok.eos_token_id,
                      bos_token_id=tok.bos_token_id, initializer_range=0.05)
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg)
