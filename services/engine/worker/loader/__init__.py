"""Checkpoint loading: HF safetensors folders, GGUF files (weights and tokenizer), and the default model cache."""
