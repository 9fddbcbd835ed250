"""``--request-log`` rows from a run's results: paired with the request sent, by start time, and what a
replay needs from a failed, dropped or chat request."""

from __future__ import annotations

from services.bench.client import RequestResult
from services.bench.datasets import BenchRequest, plain_token_space, synthetic_dataset
from services.bench.request_log import RequestLogRow, log_rows
from services.sim.trace import TraceRow


def test_rows_pair_each_result_with_its_request_and_leave_out_invalid_ones() -> None:
    sent = synthetic_dataset(plain_token_space(100), 3, 4, 5, prefix_len=8, num_prefixes=2, seed=1)
    results = [
        RequestResult(12, 5, True, ttft=0.2, latency=0.5, start=1.0, index=2),
        RequestResult(12, 0, False, latency=0.1, start=0.5, error="HTTP 503: busy", index=0),
        RequestResult(12, 0, False, start=0.7, kind="bad", error="", index=1),
        RequestResult(12, 2, True, latency=0.3, start=0.9, kind="dropped", index=1),
    ]
    rows = log_rows(sent, results, "completions")
    assert [r.start_s for r in rows] == [0.5, 0.9, 1.0]  # by start; the invalid request is not in it
    assert [r.prompt_token_ids for r in rows] == [list(sent[i].prompt_ids) for i in (0, 1, 2)]
    assert all(r.prefix_group and r.prefix_group.startswith("prefix-1-") and r.prefix_len == 8 for r in rows)
    failed, dropped, ok = rows
    assert failed.ttft_s is None and not failed.success and failed.error == "HTTP 503: busy"
    assert dropped.kind == "dropped" and dropped.ttft_s is None and ok.ttft_s == 0.2
    replay = [
        TraceRow.from_bench(RequestLogRow.model_validate_json(r.model_dump_json()), i)
        for i, r in enumerate(rows)
    ]
    assert [r.output_len for r in replay] == [5, 2, 5]  # a failed request replays its max_tokens
    assert replay[2].prompt_token_ids == list(sent[2].prompt_ids)


def test_a_chat_row_counted_by_the_server_replays_by_length_and_group() -> None:
    request = BenchRequest(tuple(range(20)), "text", 4, "prefix-0-0", 16)
    (row,) = log_rows([request], [RequestResult(31, 4, True, ttft=0.1, start=0.0, index=0)], "chat")
    trace = TraceRow.from_bench(row, 0)
    assert trace.prompt_token_ids is None and trace.prompt_len == 31  # the template's tokens counted
    assert (trace.prefix_group, trace.prefix_len) == ("prefix-0-0", 16)
