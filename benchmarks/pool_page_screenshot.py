"""The docs' pool page picture: ``kvferry up`` (a real P/D pool of SmolLM2 by default), real chat traffic
through the router with the ``openai`` client, and a headless-Chromium screenshot of ``/ui`` taken while
the traffic runs.

    python benchmarks/pool_page_screenshot.py [--model PATH] [--prefill 1 --decode 2 | --engines 2]
        [--seconds 40] [--out docs/images/pool-page.png]
"""

from __future__ import annotations

import argparse
import random
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import openai

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.chromium import HeadlessChromium  # noqa: E402

TOPICS = ("the tides", "compilers", "bread", "volcanoes", "chess openings", "honey bees", "glaciers", "jazz")
# Long shared system prompts (past the P/D threshold): the first request under each is split into prefill
# + decode, the next ones find it cached on their decode engine.
SYSTEMS = [
    f"You are assistant #{i} of a support team. "
    + "Answer briefly, kindly and precisely; cite no sources. " * 30
    for i in range(3)
]


def start_up(args: argparse.Namespace) -> tuple[subprocess.Popen[str], str, str]:
    """``kvferry up``; returns it, the OpenAI base URL and the pool page URL it printed."""
    pool = ["--prefill", str(args.prefill), "--decode", str(args.decode)] if args.prefill else []
    pool = pool or ["--engines", str(args.engines)]
    cmd = [sys.executable, "-m", "services.cli", "up", *([args.model] if args.model else []), *pool]
    cmd += ["--port", "0", "--serve-args", args.serve_args]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    api = page = None
    for line in proc.stdout:
        print(line, end="", flush=True)
        if m := re.search(r"OpenAI API at (http://\S+/v1)", line):
            api = m.group(1)
        if m := re.search(r"pool page: (http://\S+/ui)", line):
            page = m.group(1)
        if "Press Ctrl-C" in line:
            break
    if api is None or page is None:
        proc.kill()
        raise SystemExit("kvferry up did not come up (see its output above)")
    threading.Thread(target=_drain, args=(proc,), daemon=True).start()
    return proc, api, page


def _drain(proc: subprocess.Popen[str]) -> None:
    """Keep reading ``kvferry up``'s output (a full pipe would block it)."""
    assert proc.stdout is not None
    for _ in proc.stdout:
        pass


def _messages(rng: random.Random) -> list[dict[str, str]]:
    """Half under a shared system prompt (cached: decode-only), a quarter short, a quarter a long new
    text to summarize (past the P/D threshold, uncached: prefill + decode)."""
    ask = {"role": "user", "content": f"Tell me one fact about {rng.choice(TOPICS)}."}
    kind = rng.random()
    if kind < 0.5:
        return [{"role": "system", "content": rng.choice(SYSTEMS)}, ask]
    if kind < 0.75:
        return [ask]
    text = " ".join(rng.choice(TOPICS) + f" {rng.randrange(10**6)}" for _ in range(80))
    return [{"role": "user", "content": f"Summarize these notes in one line: {text}"}]


def traffic(api: str, model: str, stop: threading.Event, seed: int) -> None:
    """Chats in a loop until ``stop``."""
    rng = random.Random(seed)
    client = openai.OpenAI(base_url=api, api_key="unused", max_retries=0, timeout=120)
    while not stop.is_set():
        messages = _messages(rng)
        stream = client.chat.completions.create(
            model=model,
            messages=messages,
            max_tokens=rng.randrange(12, 40),
            stream=True,  # type: ignore[arg-type]
        )
        for _ in stream:
            pass


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="checkpoint folder or .gguf (default: SmolLM2 Q4_1)")
    p.add_argument("--prefill", type=int, default=1)
    p.add_argument("--decode", type=int, default=2)
    p.add_argument("--engines", type=int, default=2, help="aggregated engines (with --prefill 0)")
    p.add_argument("--serve-args", default="--num-kv-blocks 512 --max-num-seqs 8")
    p.add_argument("--clients", type=int, default=3, help="concurrent chat loops")
    p.add_argument("--seconds", type=float, default=40.0, help="traffic before the screenshot")
    p.add_argument("--decisions", type=int, default=8, help="decisions the page shows")
    p.add_argument("--out", type=Path, default=REPO / "docs/images/pool-page.png")
    args = p.parse_args()
    proc, api, page_url = start_up(args)
    stop = threading.Event()
    try:
        model = openai.OpenAI(base_url=api, api_key="unused").models.list().data[0].id
        loops = [
            threading.Thread(target=traffic, args=(api, model, stop, i), daemon=True)
            for i in range(args.clients)
        ]
        for loop in loops:
            loop.start()
        time.sleep(args.seconds)
        with HeadlessChromium(f"{page_url}?decisions={args.decisions}", width=1440, height=900) as browser:
            browser.wait_for("document.querySelectorAll('#decisions tr[data-request-id]').length > 0")
            time.sleep(1.5)  # one more refresh, so the sparklines carry the latest poll
            args.out.parent.mkdir(parents=True, exist_ok=True)
            browser.screenshot(args.out)
        print(f"wrote {args.out}")
    finally:
        stop.set()
        proc.send_signal(signal.SIGINT)
        proc.wait(120)


if __name__ == "__main__":
    main()
