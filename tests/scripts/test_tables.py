"""scripts/tables.py: the record's tables are written from its JSON, never by hand (plain Python, no model)."""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
import tables  # noqa: E402


def committed() -> dict:
    return json.loads((ROOT / tables.RECORD).read_text())


def test_the_committed_tables_are_the_committed_records():
    """The round trip: rendering docs/bench/record.json gives every marked table of README.md and BENCHMARKS.md
    (`tables.py --check` runs in tests/scripts/test_readme_scripts.py)."""
    blocks = tables.render(committed())
    seen = set()
    for doc in tables.DOCS:
        text = (ROOT / doc).read_text()
        for m in tables.MARKER.finditer(text):
            seen.add(m.group(1))
            if m.group(1) in blocks:
                assert m.group(2) == blocks[m.group(1)], (doc, m.group(1))
    # the headline comparison and every section the record has are shown somewhere
    assert {"modes-headline", "modes", "sources"} <= seen
    assert {name for name in blocks} <= seen, set(blocks) - seen


def test_a_table_edited_by_hand_is_found_and_put_back():
    record = committed()
    blocks = tables.render(record)
    readme = (ROOT / "README.md").read_text()
    first = tables.MARKER.search(readme)
    name, body = first.group(1), first.group(2)
    digit = next(i for i, ch in enumerate(body) if ch.isdigit() and i > body.index("|"))
    edited = readme.replace(body, body[:digit] + str((int(body[digit]) + 1) % 10) + body[digit + 1 :], 1)
    assert edited != readme
    restored, changed = tables.rewrite(edited, blocks)
    assert changed == [name] and restored == readme
    again, changed = tables.rewrite(restored, blocks)
    assert again == readme and changed == []


def test_a_block_the_record_lacks_stays_as_written_and_unknown_blocks_are_refused():
    record = committed()
    text = "before\n<!-- record:peers -->\nmeasured elsewhere\n<!-- /record:peers -->\nafter\n"
    without = copy.deepcopy(record)
    without["sections"].pop("peers", None)
    assert tables.rewrite(text, tables.render(without)) == (text, [])
    with pytest.raises(SystemExit, match="unknown block <!-- record:nonsense -->"):
        tables.rewrite("<!-- record:nonsense -->\nx\n<!-- /record:nonsense -->\n", {})


def test_a_run_replaces_only_the_sections_it_measured():
    record = committed()
    name = next(iter(record["sections"]))
    fresh = copy.deepcopy(record["sections"][name])
    fresh["run"] = fresh["run"] | {"date": "2099-01-01", "commit": "f" * 12}
    merged = tables.merge(record, {"sections": {name: fresh}, "notes": ["a note"]})
    assert merged["sections"][name]["run"]["date"] == "2099-01-01"
    for other in set(record["sections"]) - {name}:
        assert merged["sections"][other] == record["sections"][other]
    assert merged["notes"] == ["a note"]
    # and every block is stamped with its own section's run
    assert "2099-01-01" in "".join(v for v in tables.render(merged).values())


def test_every_stamp_names_its_date_commit_and_machine():
    record = committed()
    for name, body in tables.render(record).items():
        if name == "sources":
            continue
        head = body.splitlines()[0]
        needs = tables.BLOCKS[name][0][0]
        run = record["sections"][needs]["run"]
        assert run["date"] in head and run["commit"][:10] in head and run["machine"]["cpu"] in head, head


def test_a_block_built_from_two_runs_names_both():
    """The serving table takes its prefill columns from the prefill section: when another run measured that,
    the block carries one stamp per section, so no figure sits under a run that did not measure it."""
    record = committed()
    assert {"serving", "prefill"} <= set(record["sections"])
    same = copy.deepcopy(record)
    same["sections"]["prefill"]["run"] = same["sections"]["serving"]["run"]
    head = tables.render(same)["serving"].split("\n\n")[0]
    assert head.count("commit `") == 1 and not head.startswith("serving:")
    other = copy.deepcopy(same)
    other["sections"]["prefill"]["run"] = other["sections"]["prefill"]["run"] | {"commit": "e" * 12}
    lines = tables.render(other)["serving"].split("\n\n")[0].splitlines()
    assert [line.split(":")[0] for line in lines] == ["serving", "prefill"]
    assert "eeeeeeeeee" in lines[1] and same["sections"]["serving"]["run"]["commit"][:10] in lines[0]


def test_peers_with_sampled_runs_get_a_column_group_each():
    row = dict(rss_peak_mb=1, rss_after_mb=1)
    sec = {
        "models": [
            {
                "label": "built-in",
                "rows": [
                    {"c": 1, "server": "minibatch native", "sampling": "greedy", "tok_s": 110.0, **row},
                    {"c": 1, "server": "llama.cpp Q4_1", "sampling": "greedy", "tok_s": 80.0, **row},
                    {"c": 1, "server": "minibatch native", "sampling": "chat", "tok_s": 105.0, **row},
                    {"c": 1, "server": "llama.cpp Q4_1", "sampling": "chat", "tok_s": 70.0, **row},
                ],
            }
        ]
    }
    text = tables.peers(sec)
    header, rule, line = text.splitlines()[2:5]
    assert header == (
        "| c | minibatch native tok/s (greedy) | llama.cpp Q4_1 tok/s (greedy) | minibatch / best llama.cpp (greedy) |"
        " minibatch native tok/s (chat) | llama.cpp Q4_1 tok/s (chat) | minibatch / best llama.cpp (chat) |"
    )
    assert rule.count("---:") == 7
    assert line.startswith("| 1 | 110.0 | 80.0 | 1.38× | 105.0 | 70.0 | 1.50× |"), line
