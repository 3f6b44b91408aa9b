"""A tick's streams and their parts (tasks/ticks.py): what a reader may take from a tick, and when it
must read the stream instead."""

from __future__ import annotations

import json

import pytest
from weightq.tasks.contract import tick_entries, tick_streams


def test_a_tick_names_its_streams_with_their_parts_or_none():
    part = json.dumps(["0-0", "5-0", ["type", "token", "i", "0", "text", '\x1e"x']])
    assert tick_streams("a b", part + "\x1e") == [("a", part), ("b", "")]  # b's batch was too large to carry
    assert tick_streams("a b", None) == [("a", ""), ("b", "")]  # a worker of an earlier version: read both
    assert tick_streams("a b", part) == [("a", ""), ("b", "")]  # parts that do not match the names: read
    assert tick_streams("", "") == [] and tick_streams(None, None) is None  # nothing, and read everything
    assert tick_entries(part) == ("0-0", [("5-0", ["type", "token", "i", "0", "text", '\x1e"x'])])
    for broken in ("[not json", "{}", '["0-0", "5-0"]'):
        with pytest.raises(ValueError):
            tick_entries(broken)
