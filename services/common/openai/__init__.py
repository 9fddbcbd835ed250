"""The OpenAI surface: protocol models, errors, SSE, chat prompts and tools, tokenizer, HTTP plumbing."""
