"""Tests of services.engine.worker: sampler, inputs, loaders, backends."""
