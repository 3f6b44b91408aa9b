"""The streamed chunks' JSON from templates is byte for byte what json.dumps of the chunk gives."""

import json

import pytest
from weightq.gateway.openai_api import ChunkWriter

TEXTS = ["", " the", 'a "quoted" \\ back', "line\nbreak\ttab", "\x00\x1f ctl", "é ü 漢字 🙂", "</script>"]


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("resumed", [False, True])
def test_delta_json_is_the_dumped_chunk(chat: bool, resumed: bool) -> None:
    fast = ChunkWriter("job-1", 'm"odel', chat=chat, resumed=resumed)
    slow = ChunkWriter("job-1", 'm"odel', chat=chat, resumed=resumed)
    slow.base = fast.base  # the same `created`
    for index in (0, 3, 0, 3):
        for text in TEXTS:
            got = fast.delta_json(text, index)
            want = json.dumps(slow.delta(text, index=index), separators=(",", ":"))
            assert got == want
            assert json.loads(got)["choices"][0]["index"] == index


def test_chat_first_chunk_carries_the_role_once() -> None:
    w = ChunkWriter("job-1", "m", chat=True)
    first, second = (json.loads(w.delta_json("x")) for _ in range(2))
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": "x"}
    assert second["choices"][0]["delta"] == {"content": "x"}
