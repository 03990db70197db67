"""``pdserve generate --stats``: a readable table, not Python reprs."""

from __future__ import annotations

from pdserve.client.cli import stats_lines
from pdserve.client.results import Completion, Usage
from pdserve.timing import Timing


def test_stats_read_as_a_table() -> None:
    done = Completion(
        text="x", token_ids=[1, 2, 3, 4, 5], logprobs=[], finish_reason="length",
        usage=Usage(prompt_tokens=12, completion_tokens=5, cached_tokens=8),
        timing=Timing(queue_ms=1.0, prefill_ms=20.0, transfer_ms=2.5, decode_ms=40.0,
                      ttft_ms=24.0, e2e_ms=64.0, transfer_bytes=1_500_000, transport="shm"),
    )  # fmt: skip
    lines = stats_lines(done)
    text = "\n".join(lines)
    assert "Usage(" not in text and "Timing(" not in text
    assert lines[0].split() == ["finish", "length"]
    assert "12 prompt (8 cached), 5 generated" in lines[1]
    assert any(ln.strip().startswith("KV transfer") and "1.50 MB by shm" in ln for ln in lines)
    assert lines[-1].split(maxsplit=3)[3] == "10.0 ms after the first"
    column = len("time to first token") + 2  # the longest label, then the values in a column
    assert all(ln[column - 2 : column] == "  " and ln[column] != " " for ln in lines)


def test_without_accounting_it_says_what_it_has() -> None:
    done = Completion("x", [1, 2], [], "stop", None, None)
    assert stats_lines(done) == ["finish  stop", "tokens  2 generated"]
