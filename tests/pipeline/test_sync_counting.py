"""pipeline.cuda_graphs.sync_reports: what the benchmarks' "host syncs per round" and the CUDA tests' sync bounds
count. torch's one-time notice that sync debug mode is a prototype mentions "synchronizing operations" and was
counted as a sync: every hybrid bench read 2 syncs per round at its first budget."""

from __future__ import annotations

import warnings

from pipeline.cuda_graphs import sync_reports

NOTICE = "Synchronization debug mode is a prototype feature and does not yet detect all synchronizing operations"
SYNC = "called a synchronizing CUDA operation"  # what torch's sync debug mode warns for each host sync


def caught(*messages: str) -> list[warnings.WarningMessage]:
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        for m in messages:
            warnings.warn(m, UserWarning)
    return got


def test_the_prototype_notice_is_not_a_sync_and_every_real_report_is():
    assert sync_reports(caught(NOTICE)) == []
    got = sync_reports(caught(NOTICE, SYNC, "an unrelated warning", SYNC))
    assert [str(w.message) for w in got] == [SYNC, SYNC]
