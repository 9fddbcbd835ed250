"""P/D with multi-head latent attention: DeepSeek-V3's cached latents ([c_kv | k_pe], one head) ferried
over NIXL from a prefill to a decode engine give the aggregated engine's text."""

from __future__ import annotations

import json

from tests.pd.parallel_pd import RECEIVED, check_pd_equals_aggregated, pd_trio

BYTES = 'kvferry_kv_transfer_bytes_total{direction="received",path="nixl"}'


def test_mla_latent_blocks_ferried_equal_aggregated(family_dir) -> None:
    """Every ferried block holds 16 tokens' latents of every layer, nothing per head."""
    model = family_dir("deepseek_v3")
    cfg = json.loads((model / "config.json").read_text())
    latent_elems = 16 * cfg["num_hidden_layers"] * (cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"])
    with pd_trio(model, ()) as trio:
        check_pd_equals_aggregated(trio, 10, seed=7)
        m = trio[1].metrics()
        per_block = m[BYTES] / m[RECEIVED]
        assert per_block in (2 * latent_elems, 4 * latent_elems)  # bf16 or fp32, whichever the engine serves
