"""The `kvferry serve` flags by concern: what the engine serves, its LoRA adapters, its place in a pool."""

from __future__ import annotations

import argparse
from collections.abc import Callable

from services.common.openai.tool_templates import add_tool_template_flag
from services.common.pool.roles import RoleName, parse_role_name


def _role(value: str) -> RoleName:
    try:
        return parse_role_name(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_serving_flags(add: Callable[..., object]) -> None:
    """What the engine serves and how its chat answers are shaped."""
    add(
        "--task",
        default="auto",
        choices=["auto", "generate", "embed"],
        help="generate (completions, chat) or embed (/v1/embeddings); auto: from the checkpoint",
    )
    add(
        "--attention-backend",
        default=None,
        choices=["cpu", "torch", "triton"],
        help="compute backend (default: triton on CUDA, the C++ kernels on CPU, torch where they cannot build)",
    )
    add(
        "--speculative-config",
        default=None,
        help='speculative decoding, as JSON: {"method": "ngram", "num_speculative_tokens": 4} or '
        '{"method": "draft_model", "model": DIR, "num_speculative_tokens": 3}',
    )
    add("--seed", type=int, default=0)
    add("--host", default="127.0.0.1")
    add("--port", type=int, default=8000)
    add("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1 routes")
    add(
        "--api-key-file",
        default=None,
        help="as --api-key, the key read from FILE (e.g. the pool's Secret: its routers and picker present it)",
    )
    add("--chat-template", default=None, help="a Jinja chat template FILE replacing the model's")
    add_tool_template_flag(add)
    add(
        "--enable-auto-tool-choice",
        action="store_true",
        help="let the model decide to call tools (tool_choice auto)",
    )
    add(
        "--tool-call-parser",
        default=None,
        help="hermes | llama3_json | mistral | pythonic: reads tool calls from text",
    )
    add(
        "--reasoning-parser", default=None, help="deepseek_r1 | qwen3: <think> text goes to reasoning_content"
    )
    add(
        "--scheduling-policy",
        choices=["fcfs", "priority"],
        default="fcfs",
        help="fcfs: a request with a non-zero `priority` is a 400; priority: lower values are served first",
    )
    add(
        "--request-timeout",
        type=float,
        default=600.0,  # ServerSettings' DEFAULT_REQUEST_TIMEOUT_S (serving imports torch: not here)
        help="seconds before a request is aborted and its KV freed (default 600; 0: no limit)",
    )
    add("--drain-timeout", type=float, default=30.0, help="seconds SIGTERM waits for running requests")


def add_lora_flags(add: Callable[..., object]) -> None:
    add("--enable-lora", action="store_true", help="serve LoRA adapters (a request names one by `model`)")
    add("--max-loras", type=int, default=1, help="adapters one step can run (device slots)")
    add("--max-lora-rank", type=int, default=16, help="largest adapter rank")
    add(
        "--max-cpu-loras",
        type=int,
        default=None,
        help="loaded adapters kept in memory (default: --max-loras)",
    )
    add(
        "--lora-modules",
        nargs="+",
        default=[],
        metavar="NAME=PATH",
        help="PEFT adapter folders to load at start",
    )
    add(
        "--allow-runtime-lora-updating",
        action="store_true",
        help="enable POST /v1/load_lora_adapter and /v1/unload_lora_adapter",
    )
    add(
        "--allowed-local-media-path",
        default=None,
        help="vision models: a folder whose files image_url parts may name as file:// URLs (default: none)",
    )
    from services.common.media.media_settings import add_media_flags

    add_media_flags(add)


def add_pool_flags(add: Callable[..., object]) -> None:
    """Where the engine sits in a pool: its role, the KV tiers, the prefix index."""
    add(
        "--role",
        type=_role,
        default="both",
        help="both (aggregated) | prefill (keeps KV for a decode engine) | decode (pulls KV from prefill)",
    )
    add(
        "--kv-lease",
        type=float,
        default=None,
        help="seconds leased blocks (a prefilled prompt, a drained stream) wait for a peer's read (30)",
    )
    add("--kvstore-url", default=None, help="shared KV tier (grpc://host:port): offload blocks, fetch misses")
    add(
        "--kv-offload-cpu-bytes",
        type=int,
        default=0,
        help="bytes of host memory for this engine's own second KV tier: finished requests' blocks are "
        "copied there off the step, and a prefix found there is loaded back instead of recomputed (0: none)",
    )
    add(
        "--kv-offload-disk-path",
        default=None,
        help="folder of a local-disk KV tier behind the host tier: blocks the host tier evicts are written "
        "there (checksummed files, kept across restarts) and loaded back on a prefix hit",
    )
    add("--kv-offload-disk-bytes", type=int, default=0, help="the disk KV tier's budget in bytes")
    add(
        "--kv-offload-policy",
        choices=["lru", "arc"],
        default="lru",
        help="which block the host tier evicts: lru (least recently used) or arc (adaptive replacement: "
        "prefixes used again are kept over a scan of one-off prompts)",
    )
    add(
        "--no-nixl",
        dest="use_nixl",
        action="store_false",
        help="prefill/decode: move KV through the kvstore instead of NIXL",
    )
    add("--redis-url", default=None, help="publish KV cache events to this prefix index (redis://host:port)")
    add("--engine-id", default=None, help="stable id in the prefix index (default: $POD_NAME or host:port)")
    add(
        "--advertise-url",
        default=None,
        help="URL routers use for this engine, as listed in the index (default: http://host:port)",
    )
    add(
        "--pool-secret-file",
        default=None,
        help="a file holding the pool's secret token: this engine's /kv/ side channel requires it, and the "
        "engine sends it to prefill engines and the kvstore (default: side channels open)",
    )
