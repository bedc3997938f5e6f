"""The doc-mix workload (long documents arriving while chats run) and per-group reports."""

from __future__ import annotations

from radixserve.bench.client import RequestRecord
from radixserve.bench.loadgen import RunResult
from radixserve.bench.report import summarize
from radixserve.bench.workloads import build_workload


def test_doc_mix_runs_chats_first_then_long_documents():
    w = build_workload("doc-mix", seed=1, num_chats=3, turns=4, num_docs=2, doc_len=300)
    assert [c.id for c in w.conversations] == ["chat-0", "chat-1", "chat-2", "doc-0", "doc-1"]
    assert all(len(c.user_turns) == 4 for c in w.conversations[:3])
    doc = w.conversations[3].user_turns
    assert len(doc) == 1 and len(doc[0].split()) == 3 + 300  # "Summarise this document:"
    assert w.num_requests == 3 * 4 + 2
    again = build_workload("doc-mix", seed=1, num_chats=3, turns=4, num_docs=2, doc_len=300)
    assert again.conversations == w.conversations


def _rec(cid: str, ttft: float, itl: list[float]) -> RequestRecord:
    return RequestRecord(cid, 1, 0.0, success=True, ttft=ttft, e2e=ttft + sum(itl), itl=itl)


def test_reports_split_ttft_and_itl_by_conversation_group():
    records = [
        _rec("chat-0", 0.1, [0.02, 0.02, 0.5]),
        _rec("chat-1", 0.1, [0.02, 0.02]),
        _rec("doc-0", 2.0, [0.03]),
    ]
    groups = summarize(RunResult("m", records, 3.0))["by_group"]
    assert set(groups) == {"chat", "doc"}
    assert groups["chat"]["requests"] == 2 and groups["doc"]["ttft_p50_s"] == 2.0
    assert groups["chat"]["itl_p50_s"] == 0.02 and groups["chat"]["itl_p99_s"] > 0.4
    assert summarize(RunResult("m", records[:2], 1.0))["by_group"] == {}  # one group: none
