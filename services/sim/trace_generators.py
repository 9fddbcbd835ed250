"""Trace generators: chat (shared system prompt), rag (shared documents), agentic (growing sessions),
diurnal (chat whose arrival rate rises and falls over the trace)."""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from typing import Literal

from pydantic import BaseModel, Field

from services.sim.trace import TraceRow

GeneratorName = Literal["chat", "rag", "agentic", "diurnal"]
GENERATORS: tuple[GeneratorName, ...] = ("chat", "rag", "agentic", "diurnal")


class GeneratorSettings(BaseModel):
    """Open-loop arrivals: ``rate`` requests (agentic: sessions) per second for ``duration_s``."""

    rate: float = Field(4.0, gt=0)
    duration_s: float = Field(60.0, gt=0)
    seed: int = 0
    system_len: int = Field(256, ge=0, description="chat: the shared system prompt")
    documents: int = Field(32, ge=1, description="rag: distinct documents (Zipf popularity)")
    document_len: int = Field(1024, ge=1)
    turns: int = Field(6, ge=1, description="agentic: turns per session")
    turn_gap_s: float = Field(8.0, gt=0, description="agentic: mean gap between a session's turns")
    max_output: int = Field(4096, ge=1, description="cap on every row's output length")
    trough: float = Field(0.1, ge=0, le=1, description="diurnal: the lowest rate, as a share of the peak")


def _diurnal_arrivals(rng: random.Random, s: GeneratorSettings) -> list[float]:
    """Poisson arrivals whose rate follows one day over the trace: ``trough * rate`` at the start and the
    end, ``rate`` (the peak) halfway (a raised cosine; thinning of a peak-rate process)."""
    out = []
    for t in _arrivals(rng, s.rate, s.duration_s):
        phase = (1 - math.cos(2 * math.pi * t / s.duration_s)) / 2
        if rng.random() < s.trough + (1 - s.trough) * phase:
            out.append(t)
    return out


def _arrivals(rng: random.Random, rate: float, duration_s: float) -> list[float]:
    out, t = [], rng.expovariate(rate)
    while t < duration_s:
        out.append(round(t, 6))
        t += rng.expovariate(rate)
    return out


def chat(s: GeneratorSettings, diurnal: bool = False) -> list[TraceRow]:
    """Single-turn chat: one shared system prompt, a user message of 50-800 tokens, 30-300 out."""
    rng = random.Random(s.seed)
    rows = []
    times = _diurnal_arrivals(rng, s) if diurnal else _arrivals(rng, s.rate, s.duration_s)
    for i, t in enumerate(times):
        user = int(min(max(rng.lognormvariate(5.3, 0.7), 50), 800))
        rows.append(
            TraceRow(
                t=t,
                prompt_len=s.system_len + user,
                prefix_group="system" if s.system_len else None,
                prefix_len=s.system_len,
                output_len=min(rng.randint(30, 300), s.max_output),
                id=f"chat-{s.seed}-{i}",
            )
        )
    return rows


def rag(s: GeneratorSettings) -> list[TraceRow]:
    """Retrieval-augmented: a Zipf-popular shared document, then a 20-120 token question, 50-250 out."""
    rng = random.Random(s.seed)
    weights = [1.0 / (k + 1) for k in range(s.documents)]
    rows = []
    for i, t in enumerate(_arrivals(rng, s.rate, s.duration_s)):
        doc = rng.choices(range(s.documents), weights)[0]
        rows.append(
            TraceRow(
                t=t,
                prompt_len=s.document_len + rng.randint(20, 120),
                prefix_group=f"doc-{doc}",
                prefix_len=s.document_len,
                output_len=min(rng.randint(50, 250), s.max_output),
                id=f"rag-{s.seed}-{i}",
            )
        )
    return rows


def agentic(s: GeneratorSettings) -> list[TraceRow]:
    """Sessions of ``turns`` turns: each prompt is the whole history so far (previous prompt, the model's
    answer, a tool result of 100-600 tokens), so every turn extends the session's cached prefix."""
    rng = random.Random(s.seed)
    rows = []
    for n, start in enumerate(_arrivals(rng, s.rate, s.duration_s)):
        session, t = f"s-{s.seed}-{n}", start
        context = 400 + rng.randint(0, 800)  # system prompt, tool definitions and the task
        for turn in range(s.turns):
            out = min(rng.randint(40, 250), s.max_output)
            rows.append(
                TraceRow(
                    t=round(t, 6),
                    prompt_len=context,
                    prefix_group=session,
                    prefix_len=context,
                    output_len=out,
                    session=session,
                    id=f"{session}-{turn}",
                )
            )
            context += out + rng.randint(100, 600)
            t += rng.expovariate(1.0 / s.turn_gap_s)
    rows.sort(key=lambda r: r.t)
    return rows


def generate(name: GeneratorName, settings: GeneratorSettings) -> list[TraceRow]:
    makers: dict[str, Callable[[GeneratorSettings], list[TraceRow]]] = {
        "chat": chat,
        "rag": rag,
        "agentic": agentic,
        "diurnal": lambda settings: chat(settings, diurnal=True),
    }
    return makers[name](settings)
