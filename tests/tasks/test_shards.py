"""Where a job's keys live on a sharded token plane: the shard its id names, else its id's CRC32."""

from __future__ import annotations

import zlib

from weightq.tasks.contract import on_shard, shard_of


def test_an_id_that_names_its_shard_stays_there_as_the_list_grows():
    made = [on_shard(f"job{i}", i % 3) for i in range(30)]
    for shards in (3, 4, 7):
        assert [shard_of(j, shards) for j in made] == [i % 3 for i in range(30)]
    # a caller's own id is hashed (CRC32), as is a named shard beyond the list or a tag that is no number
    for job_id in ("mine-1", "x.s", "x.sab", "x.s-1", on_shard("late", 5), on_shard("huge", 10**6)):
        assert shard_of(job_id, 3) == zlib.crc32(job_id.encode()) % 3
    assert {shard_of(on_shard("any", 2), 1), shard_of("any", 1)} == {0}  # one Redis: no shards
