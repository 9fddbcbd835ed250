"""Tests of the engine HTTP app (services.engine.entrypoints): real `kvferry serve` processes and in-process apps."""
