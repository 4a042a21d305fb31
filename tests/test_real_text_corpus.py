"""benchmarks/real_text_corpus.py's ``--parts``: the documents dealt in turn into several corpora, none lost,
none twice, each corpus in the source's order."""

from __future__ import annotations

import json

from benchmarks.real_text_corpus import deal


def test_deal_splits_the_documents_in_turn(tmp_path):
    docs = [{"text": f"document {i}"} for i in range(8)]
    source = tmp_path / "sources.jsonl"
    source.write_text("".join(json.dumps(d) + "\n" for d in docs))
    names = deal(source, 3)
    assert list(names.values()) == ["python-1", "python-2", "python-3"]
    parts = [[json.loads(x) for x in (tmp_path / f).read_text().splitlines()] for f in names]
    assert parts == [docs[0::3], docs[1::3], docs[2::3]]
