"""GPU check part 3: the engine end to end on a random-weight Llama-3-8B-shaped model (load_format dummy):
output tok/s for many prompts and batch-1 inter-token latency, eager and with CUDA graphs where they run."""

from __future__ import annotations

import json
import time
from pathlib import Path

from benchmarks.kernels import LLAMA3_8B as KERNEL_SHAPE
from benchmarks.kernels import TINY_LLAMA as KERNEL_TINY

LLAMA3_8B = {  # the kernel benchmark's Llama-3-8B shape as a config.json
    **KERNEL_SHAPE,
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "rms_norm_eps": 1e-5,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "bos_token_id": 1,
    "eos_token_id": 2,
}
# the kernel benchmark's tiny Llama, with the vocabulary of the script's tokenizer and room for the runs
TINY = LLAMA3_8B | KERNEL_TINY | {"vocab_size": 512, "max_position_embeddings": 1024}
# (prompts, prompt tokens, output tokens): the 64 x 512 -> 128 and batch 1 128 -> 128
FULL_RUNS = {"many": (64, 512, 128), "batch1": (1, 128, 128)}
SMOKE_RUNS = {"many": (4, 16, 8), "batch1": (1, 16, 8)}


def model_folder(out: Path, shape: dict) -> Path:
    """config.json and a small tokenizer (prompts are token ids; the weights are random: load_format dummy)."""
    from tests.checkpoints import build_tokenizer

    folder = out / "model-llama3-shape"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(shape))
    build_tokenizer(folder)
    return folder


def _run(llm: object, prompts: int, prompt_len: int, out_len: int) -> dict:
    from services.engine import SamplingParams

    ids = [[(7 + 13 * i + j) % 500 + 3 for j in range(prompt_len)] for i in range(prompts)]
    params = SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True)
    llm.generate(ids[:1], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))  # type: ignore[attr-defined]
    t0 = time.perf_counter()
    outs = llm.generate(ids, params)  # type: ignore[attr-defined]
    seconds = time.perf_counter() - t0
    produced = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"prompts": prompts, "prompt_tokens": prompt_len, "output_tokens": out_len, "seconds": seconds,
            "output_tok_per_s": produced / seconds, "itl_ms": 1e3 * seconds / max(out_len - 1, 1)}  # fmt: skip


def engine_check(out: Path, smoke: bool) -> dict:
    """Each run eager (enforce_eager) and with CUDA graphs allowed (no difference where graphs do not run)."""
    from services.engine import LLM

    shape, runs = (TINY, SMOKE_RUNS) if smoke else (LLAMA3_8B, FULL_RUNS)
    folder = model_folder(out, shape)
    device, dtype = ("cpu", "float32") if smoke else ("cuda", "bfloat16")
    result: dict = {"ok": True, "model": "random Llama-3-8B shape" if not smoke else "tiny", "runs": {}}
    for eager in (True, False):
        kw = dict(device=device, dtype=dtype, load_format="dummy", enforce_eager=eager, max_model_len=1024)
        kw |= {"num_kv_blocks": 256} if smoke else {"gpu_memory_utilization": 0.85, "max_num_seqs": 256}
        llm = LLM(model=str(folder), **kw)
        mode = "eager" if eager else "graphs"
        for name, (n, p, o) in runs.items():
            result["runs"][f"{name}-{mode}"] = _run(llm, n, p, o)
            print(f"  engine {name:7s} {mode:6s}: {result['runs'][f'{name}-{mode}']}", flush=True)
        del llm
        _free()
    return result


def _free() -> None:
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
