from __future__ import annotations

import json

import pytest

from artcache.data import locate_sharegpt, read_sharegpt, to_messages
from artcache.errors import DataError


def _rec(i, turns=(("human", "hi"), ("gpt", "hello"))):
    return {"id": str(i), "conversations": [{"from": f, "value": v} for f, v in turns]}


def test_complete_list(tmp_path):
    p = tmp_path / "d.json"
    p.write_text(json.dumps([_rec(i) for i in range(3)]))
    r = read_sharegpt(p)
    assert len(r.records) == 3 and r.bytes_dropped == 0 and r.records_dropped == 0
    assert r.bytes_total == p.stat().st_size


def test_truncated_mid_string(tmp_path):
    full = json.dumps([_rec(i) for i in range(5)])
    cut = full.index('"id": "4"') + 12  # inside the last record
    p = tmp_path / "d.json"
    p.write_text(full[:cut])
    r = read_sharegpt(p)
    assert [x["id"] for x in r.records] == ["0", "1", "2", "3"]
    assert r.records_dropped == 1 and r.bytes_dropped > 0
    assert r.bytes_dropped == len(full[:cut].encode()) - full[:cut].rindex("{")


def test_truncated_mid_utf8_sequence(tmp_path):
    data = json.dumps([_rec(0), _rec(1, (("human", "é€"), ("gpt", "ö")))], ensure_ascii=False).encode()
    cut = data.index("€".encode()) + 1  # cut inside a 3-byte character
    p = tmp_path / "d.json"
    p.write_bytes(data[:cut])
    r = read_sharegpt(p)
    assert len(r.records) == 1 and r.records_dropped == 1
    assert r.bytes_dropped == cut - data.index(b'{"id": "1"')


def test_non_record_items_counted(tmp_path):
    p = tmp_path / "d.json"
    p.write_text(json.dumps([_rec(0), 5, {"id": "x"}, {"conversations": "no"}, _rec(1)]))
    r = read_sharegpt(p)
    assert len(r.records) == 2 and r.records_dropped == 3


def test_garbage_between_records(tmp_path):
    p = tmp_path / "d.json"
    p.write_text(json.dumps([_rec(0)])[:-1] + " @@@ garbage " + "x" * 1000)
    r = read_sharegpt(p)
    assert len(r.records) == 1 and r.records_dropped == 1 and r.bytes_dropped > 1000


@pytest.mark.parametrize("content", ["", "   \n", "hello", "{\"a\": 1}", "[1, 2]", "[", "[[[[[[[[", "[" * 100000,
                                     "\x00\xff garbage"])
def test_unusable_files_raise_dataerror(tmp_path, content):
    p = tmp_path / "bad.json"
    p.write_text(content, errors="surrogateescape") if isinstance(content, str) else p.write_bytes(content)
    with pytest.raises(DataError, match="bad.json"):
        read_sharegpt(p)


def test_missing_file(tmp_path):
    with pytest.raises(DataError, match="nope.json"):
        read_sharegpt(tmp_path / "nope.json")


def test_jsonl(tmp_path):
    p = tmp_path / "d.jsonl"
    lines = [json.dumps(_rec(0)), "", "{broken", json.dumps([1]), json.dumps(_rec(1))]
    p.write_text("\n".join(lines) + "\n")
    r = read_sharegpt(p)
    assert [x["id"] for x in r.records] == ["0", "1"]
    assert r.records_dropped == 2 and r.bytes_dropped == len("{broken")


def test_role_mapping_and_skips():
    msgs, why = to_messages(_rec(0, (("system", "s"), ("human", "q"), ("chatgpt", "a"), ("user", "q2"),
                                     ("bard", "a2"), ("bing", "a3"), ("model", "a4"), ("assistant", "a5"))))
    assert why is None
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "user", "assistant", "assistant",
                                         "assistant", "assistant"]
    assert to_messages({"conversations": []}) == (None, "empty")
    assert to_messages(_rec(0, (("human", "q"), ("tool", "x")))) == (None, "role:tool")
    assert to_messages(_rec(0, (("human", "q"),))) == (None, "no_assistant")
    assert to_messages({"conversations": [{"from": "gpt", "value": 3}]}) == (None, "bad_turn")


def test_real_sharegpt_file():
    r = read_sharegpt(locate_sharegpt())
    assert abs(len(r.records) - 17671) <= 50
    assert r.bytes_dropped > 0 and r.records_dropped >= 1
    assert r.bytes_total == locate_sharegpt().stat().st_size
