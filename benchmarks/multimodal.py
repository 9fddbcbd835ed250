"""Vision-language serving: TTFT and output tok/s for 32 requests x 1 image, encoder cache cold vs warm in the
same run, the encoder's time per image, and its time per batched step (the cold row's encoder steps).

Model: a random-weight SmolVLM built once into $KVFERRY_HOME/bench-models (SigLIP 6 x 384 on 224 px tiles of
14 px patches -> 64 tokens per tile; images resized to a 448 px longest edge: 2x2 tiles + the global image,
320 image tokens; a 4-layer 576-wide Llama LM). 32 distinct 640x480 images, each with the same 40-token
question, submitted at once; 32 greedy tokens each. Rows, one engine: cold (nothing cached), warm encoder
(the same images again with the prefix cache reset: KV is recomputed, features come from the encoder
cache), warm prefix (nothing reset: the image blocks are prefix-cache hits too). Prints a table, writes
benchmarks/results/multimodal.json.

    python benchmarks/multimodal.py [--dtype bfloat16] [--requests 32]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from PIL import Image  # noqa: E402

from benchmarks.timing import median_ms  # noqa: E402
from services.common.openai.tokenizer import Tokenizer  # noqa: E402
from services.engine import LLM, SamplingParams  # noqa: E402
from services.engine.worker.loader.default_model import kvferry_home  # noqa: E402
from tests.checkpoints_idefics3 import build_idefics3  # noqa: E402

SHAPE = {
    "vision": {
        "hidden_size": 384, "intermediate_size": 1536, "num_hidden_layers": 6, "num_attention_heads": 6,
        "image_size": 224, "patch_size": 14,
    },
    "text": {
        "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 4, "num_attention_heads": 9,
        "num_key_value_heads": 3,
    },
    "longest_edge": 448,
}  # fmt: skip
OUTPUT_TOKENS = 32


def checkpoint() -> Path:
    out = kvferry_home() / "bench-models" / "smolvlm-bench"
    if not (out / "processor_config.json").is_file():  # written last
        build_idefics3(out, "smolvlm", shape=SHAPE)
    return out


def prompts(folder: Path, n: int, seed: int = 0) -> list[dict]:
    question = "describe the picture in detail, then say what the dog and the fox do in it " * 3
    ids = Tokenizer(folder).encode(question[:160] + "<image>", add_special_tokens=False)
    rng = np.random.default_rng(seed)
    images = [Image.fromarray(rng.integers(0, 255, (480, 640, 3), dtype=np.uint8)) for _ in range(n)]
    return [{"prompt_token_ids": ids, "multi_modal_data": {"image": img}} for img in images]


def run(llm: LLM, batch: list[dict]) -> dict[str, float]:
    """Submit every request at once, step to the end; TTFT per request from the submission."""
    engine, params = llm.engine, SamplingParams(temperature=0, max_tokens=OUTPUT_TOKENS, ignore_eos=True)
    start = time.perf_counter()
    for i, p in enumerate(batch):
        engine.add_request(
            p["prompt_token_ids"], params, request_id=f"r{i}", images=[p["multi_modal_data"]["image"]]
        )
    first: dict[str, float] = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.outputs[0].token_ids and out.request_id not in first:
                first[out.request_id] = time.perf_counter() - start
    wall = time.perf_counter() - start
    ttft = sorted(first.values())
    return {
        "ttft_p50_ms": statistics.median(ttft) * 1e3,
        "ttft_p90_ms": ttft[int(0.9 * (len(ttft) - 1))] * 1e3,
        "tok_s": len(batch) * OUTPUT_TOKENS / wall,
        "wall_s": wall,
    }


def record_encoder_steps(llm: LLM) -> list[tuple[int, float]]:
    """Wrap the model's encode_images: the list gets (tiles, ms) of each call (one per step and tile shape)."""
    model = llm.engine.core.runner.model
    encode, steps = model.encode_images, []  # type: ignore[union-attr]

    def timed(pixels: torch.Tensor) -> torch.Tensor:
        start = time.perf_counter()
        out = encode(pixels)
        steps.append((pixels.shape[0], (time.perf_counter() - start) * 1e3))
        return out

    model.encode_images = timed  # type: ignore[union-attr]
    return steps


def encoder_ms(llm: LLM, image: Image.Image) -> tuple[float, int]:
    """Median time of the tower + connector on one image's tiles, and its tile count."""
    inputs = llm.engine.image_inputs
    assert inputs is not None
    _, placed = inputs.expand([inputs.token_id], [image])
    pixels = torch.from_numpy(np.asarray(placed[0].data))
    model = llm.engine.core.runner.model

    def encode() -> None:
        with torch.no_grad():
            model.encode_images(pixels)

    return median_ms([encode], min_reps=5, budget_s=3.0)[0], pixels.shape[0]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "multimodal.json"))
    args = ap.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    folder = checkpoint()
    llm = LLM(model=str(folder), dtype=args.dtype, num_kv_blocks=2048, max_num_seqs=args.requests)
    batch = prompts(folder, args.requests)
    run(llm, prompts(folder, 1, seed=1))  # warm-up (its image is not one of the batch's)
    cache = llm.engine.core.scheduler.encoder
    assert cache is not None
    cache.reset()
    llm.engine.core.kv_manager.reset_prefix_cache()
    steps = record_encoder_steps(llm)
    rows = {"cold": run(llm, batch)}
    cold_steps = list(steps)
    llm.engine.core.kv_manager.reset_prefix_cache()
    hits = cache.hits
    rows["warm encoder cache"] = run(llm, batch)
    rows["warm encoder cache"]["encoder_hits"] = cache.hits - hits
    rows["warm encoder + prefix cache"] = run(llm, batch)
    ms, tiles = encoder_ms(llm, batch[0]["multi_modal_data"]["image"])
    batches = {
        "encoder_steps": len(cold_steps),
        "tiles_per_step_p50": statistics.median(t for t, _ in cold_steps),
        "encoder_step_ms_p50": statistics.median(m for _, m in cold_steps),
        "encoder_ms_per_tile_batched": sum(m for _, m in cold_steps) / sum(t for t, _ in cold_steps),
        "max_num_encoder_input_tokens": llm.engine.core.scheduler.config.max_num_encoder_input_tokens,
    }
    tokens = len(
        llm.engine.image_inputs.expand(batch[0]["prompt_token_ids"], [batch[0]["multi_modal_data"]["image"]])[
            0
        ]
    )  # type: ignore[union-attr]
    result = {
        "model": "random SmolVLM (SHAPE)", "dtype": args.dtype, "requests": args.requests,
        "prompt_tokens": tokens, "output_tokens": OUTPUT_TOKENS, "tiles_per_image": tiles,
        "encoder_ms_per_image": ms, "encoder_ms_per_tile": ms / tiles, "encoder_batches": batches,
        "rows": rows, "shape": SHAPE,
    }  # fmt: skip
    print(
        f"\n{args.requests} requests x 1 image ({tiles} tiles, {tokens} prompt tokens), {OUTPUT_TOKENS} tokens each"
    )
    print("| encoder / prefix cache | TTFT p50 ms | TTFT p90 ms | output tok/s |\n|---|---:|---:|---:|")
    for label, r in rows.items():
        print(f"| {label} | {r['ttft_p50_ms']:.0f} | {r['ttft_p90_ms']:.0f} | {r['tok_s']:.1f} |")
    print(f"\nencoder (tower + connector): {ms:.1f} ms per image, {ms / tiles:.1f} ms per tile")
    print(
        f"cold row: {batches['encoder_steps']} batched encoder steps, {batches['tiles_per_step_p50']:.0f} tiles "
        f"and {batches['encoder_step_ms_p50']:.0f} ms per step (p50), "
        f"{batches['encoder_ms_per_tile_batched']:.1f} ms per tile"
    )
    Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
