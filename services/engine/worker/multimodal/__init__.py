"""Images for vision-language models: the model's preprocessing, placeholder expansion, the encoder cache."""
