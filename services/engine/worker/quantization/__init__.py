"""Weight-only quantization: the config, the quantized weight form, checkpoint readers and linear methods."""
