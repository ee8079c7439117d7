"""A tiny random Llama with a byte-level BPE trained here, saved as a model folder: what the examples'
``--tiny`` switch trains instead of your model (seconds on a CPU, no download). Not part of a recipe."""
from pathlib import Path

TEXT = ("The student sees what the engine runs. Quantization rounds each block of weights to four bits, and "
        "distillation pulls the rounded model back toward its teacher, token by token.")


def make(dst, vocab_size: int = 300, seed: int = 0) -> str:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
    dst = Path(dst)
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tk.train_from_iterator([TEXT] * 20, trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|endoftext|>", bos_token="<|endoftext|>",
                                  pad_token="<|endoftext|>")
    tok.chat_template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}<|endoftext|>{% endfor %}"
                         "{% if add_generation_prompt %}assistant: {% endif %}")
    tok.save_pretrained(dst)
    torch.manual_seed(seed)
    LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                                 max_position_embeddings=256, initializer_range=0.2, eos_token_id=tok.eos_token_id,
                                 bos_token_id=tok.bos_token_id, pad_token_id=tok.pad_token_id)).save_pretrained(dst)
    return str(dst)


def texts(n: int = 32):
    words = TEXT.split()
    return [" ".join(words[i % len(words):] + words[:i % len(words)]) for i in range(n)]
