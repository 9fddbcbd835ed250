"""Model execution: the model runner, input batch, sampler, rotary, compute backends, model classes and loaders."""
