"""Multi-LoRA serving: PEFT adapters, the batched LoRA layer, device slots and the CPU cache behind them."""
