"""The Lua scripts that change a job's state, each atomic in Redis: part of the job contract
(tasks/contract.py re-exports them), kept apart because they are Lua. Every key they touch comes in
KEYS, spelled by contract.py; a script's answer is one of the IntEnums below, never a bare number."""

from __future__ import annotations

from enum import IntEnum


class Requeued(IntEnum):  # REQUEUE's answer
    QUEUED = 0  # back in the queue
    ENDED = 1  # its client had cancelled it: ended here, cancelled
    SUPERSEDED = 2  # a later run has begun (this worker was taken for dead): nothing done


class Begun(IntEnum):  # BEGIN's first value when no run starts (a run that starts gets its attempt, >= 1)
    CANCELLED = -1
    DONE = -2  # finished before: the stored result comes with it
    DEAD_LETTERED = -3  # charged with too many crashes: the dead letter's message comes with it


class Aborted(IntEnum):  # ABORT's answer
    UNCHANGED = 0  # already ended
    ENDED = 1
    SUPERSEDED = 2  # a later run owns the job


# Submit: the job's state, tenant, request (a job whose message is lost is sent again from it) and place
# in the queued set; a known id keeps what it has. KEYS: job hash, queued set. ARGV: request, now, ttl, id, tenant.
SUBMIT = """
redis.call('HSETNX', KEYS[1], 'state', 'queued')
redis.call('HSETNX', KEYS[1], 'tenant', ARGV[5])
redis.call('HSETNX', KEYS[1], 'request', ARGV[1])
redis.call('HSETNX', KEYS[1], 'queued_at', ARGV[2])
redis.call('EXPIRE', KEYS[1], ARGV[3])
redis.call('ZADD', KEYS[2], 'NX', ARGV[2], ARGV[4])
"""

# Back to the queue at a worker's shutdown, queued since `since` (JobRunner._requeue), unless its client
# cancelled it meanwhile (flagged even if the engine never heard of it): then it ends here, cancelled,
# with what it had generated. Returns a `Requeued`. KEYS: job hash, queued set, stream. ARGV: since,
# job id, result JSON, stream maxlen, stream ttl, attempt.
REQUEUE = """
if redis.call('HGET', KEYS[1], 'attempt') ~= ARGV[6] then return 2 end
if redis.call('HGET', KEYS[1], 'cancel') then
  redis.call('HSET', KEYS[1], 'state', 'cancelled', 'result', ARGV[3])
  redis.call('XADD', KEYS[3], 'MAXLEN', '~', ARGV[4], '*', 'type', 'end', 'reason', 'cancelled', 'result', ARGV[3])
  redis.call('EXPIRE', KEYS[3], ARGV[5])
  return 1
end
redis.call('HSET', KEYS[1], 'state', 'queued')
redis.call('ZADD', KEYS[2], ARGV[1], ARGV[2])
return 0
"""

# Start (or resume) a run: refuse a cancelled or finished job; dead-letter one charged with `max
# attempts` worker crashes (the last while it ran alone: app/worker/reaper.py); else bump the attempt
# (the fence: writes of earlier runs are refused from now on), record the run and instance, and mark
# the stream with where this run resumes (after its last token). A job still 'running' from an
# uncharged run of an instance still registered (kombu's visibility timeout brought it back before a
# reaper saw it die) is charged here; a reaper-handled instance's runs never again. A retry of the
# same run's BEGIN (lost reply, unconfirmed replicas) answers the same: retries, warm-shutdown
# requeues and redeliveries never count as crashes.
# KEYS: job hash, stream, queued set, high-water mark, dead list, the instance's held tags, RESUMING,
# LEASES. ARGV: stream maxlen, stream ttl, job ttl, max attempts, now, worker name, job id, cancelled
# result, run id (unique per run), the job's priority class, worker instance, delivery tag ('' if none).
# Returns {attempt, '', the job's submission stamp, crashes, resumed from} for a run that starts, else
# {code < 0, the stored result or the dead letter's message}: -1 cancelled, -2 done, -3 dead-lettered.
BEGIN = """
local state = redis.call('HGET', KEYS[1], 'state')
redis.call('ZREM', KEYS[3], ARGV[7])
redis.call('SREM', KEYS[7], ARGV[7])
if state == 'cancelled' or redis.call('HGET', KEYS[1], 'cancel') then
  if state ~= 'cancelled' then  -- cancelled while its worker died: end it here, once
    redis.call('HSET', KEYS[1], 'state', 'cancelled')
    redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[1], '*', 'type', 'end', 'reason', 'cancelled', 'result', ARGV[8])
    redis.call('EXPIRE', KEYS[2], ARGV[2])
  end
  return {-1, ''}
end
if state == 'done' then return {-2, redis.call('HGET', KEYS[1], 'result') or ''} end
local run = redis.call('HGET', KEYS[1], 'run')
local crashes = tonumber(redis.call('HGET', KEYS[1], 'crashes') or '0')
local submitted = redis.call('HGET', KEYS[1], 'queued_at') or ''
if state == 'running' and run == ARGV[9] then
  return {tonumber(redis.call('HGET', KEYS[1], 'attempt')), '', submitted, crashes,
    tonumber(redis.call('HGET', KEYS[1], 'from'))}
end
if ARGV[12] ~= '' then
  redis.call('SADD', KEYS[6], ARGV[12])
  redis.call('EXPIRE', KEYS[6], 86400)
end
local q = tonumber(redis.call('HGET', KEYS[1], 'queued_at') or '0')
if q > tonumber(redis.call('HGET', KEYS[4], ARGV[10]) or '0') then redis.call('HSET', KEYS[4], ARGV[10], q) end
local owner = redis.call('HGET', KEYS[1], 'owner')
if state == 'running' and run and redis.call('HGET', KEYS[1], 'charged') ~= run and owner
    and redis.call('HEXISTS', KEYS[8], owner) == 1 then
  crashes = redis.call('HINCRBY', KEYS[1], 'crashes', 1)
  redis.call('HSET', KEYS[1], 'charged', run)
end
redis.call('EXPIRE', KEYS[1], ARGV[3])
if crashes >= tonumber(ARGV[4]) then
  local msg = 'dead-lettered: its worker died ' .. crashes .. ' times while running it, the last time with ' ..
    'no other job (the limit is ' .. ARGV[4] .. '); it may crash the worker'
  redis.call('HSET', KEYS[1], 'state', 'done', 'error', msg, 'field', '')
  redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[1], '*', 'type', 'error', 'message', msg, 'field', '')
  redis.call('EXPIRE', KEYS[2], ARGV[2])
  redis.call('LPUSH', KEYS[5], cjson.encode({id = ARGV[7], attempts = crashes, at = tonumber(ARGV[5]),
    worker = ARGV[6], request = redis.call('HGET', KEYS[1], 'request') or ''}))
  return {-3, msg}
end
local n = redis.call('HINCRBY', KEYS[1], 'attempt', 1)
local from, before = 0, '+'
while true do  -- the last token entry (a few attempt entries may follow it); it holds 'n' tokens, else 1
  local rows = redis.call('XREVRANGE', KEYS[2], before, '-', 'COUNT', 16)
  for _, row in ipairs(rows) do
    local f = row[2]
    local t, i, n = nil, 0, 1
    for k = 1, #f, 2 do
      if f[k] == 'type' then t = f[k + 1] elseif f[k] == 'i' then i = tonumber(f[k + 1])
      elseif f[k] == 'n' then n = tonumber(f[k + 1]) end
    end
    if t == 'token' then from = i + n end
    if from > 0 then break end
    before = '(' .. row[1]
  end
  if from > 0 or #rows < 16 then break end
end
redis.call('HSET', KEYS[1], 'state', 'running', 'run', ARGV[9], 'owner', ARGV[11], 'from', from)
redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[1], '*', 'type', 'attempt', 'attempt', n, 'from', from)
redis.call('EXPIRE', KEYS[2], ARGV[2])
return {n, '', submitted, crashes, from}
"""

# A dead worker instance's jobs (app/worker/reaper.py): those inside its engine are charged a crash, the
# others released uncharged; each dead run once, however many reapers race. Each stays in RESUMING until
# a run of it begins (BEGIN), so the lost-job sweep re-sends it should its message be lost on the way.
# KEYS: RESUMING, then job hashes. ARGV: the instance, then per job 1 (inside its engine) or 0 and its
# id. Returns the hash keys of the jobs charged.
CHARGE = """
local out = {}
for i = 2, #KEYS do
  local key = KEYS[i]
  local run = redis.call('HGET', key, 'run')
  if run and redis.call('HGET', key, 'state') == 'running' and redis.call('HGET', key, 'owner') == ARGV[1]
      and redis.call('HGET', key, 'charged') ~= run then
    if ARGV[2 * i - 2] == '1' then
      redis.call('HINCRBY', key, 'crashes', 1)
      out[#out + 1] = key
    end
    redis.call('HSET', key, 'charged', run)
    redis.call('SADD', KEYS[1], ARGV[2 * i - 1])
  end
end
return out
"""

# Fail a job before it runs (a refused request), once however often retried or redelivered; or a run
# that raised (ARGV[7], its attempt: a no-op once a later run has begun).
# KEYS: job hash, stream, queued set, STREAM_TICK. ARGV: stream maxlen, stream ttl, job ttl, message, field,
# job id, attempt or ''. Ticks (as WRITE_BATCH does), so a gateway answers a refused request at once.
FAIL = """
if redis.call('HGET', KEYS[1], 'state') == 'done' then return 0 end
if ARGV[7] ~= '' and redis.call('HGET', KEYS[1], 'attempt') ~= ARGV[7] then return 0 end
redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[1], '*', 'type', 'error', 'message', ARGV[4], 'field', ARGV[5])
redis.call('EXPIRE', KEYS[2], ARGV[2])
redis.call('HSET', KEYS[1], 'state', 'done', 'error', ARGV[4], 'field', ARGV[5])
redis.call('EXPIRE', KEYS[1], ARGV[3])
redis.call('ZREM', KEYS[3], ARGV[6])
redis.call('XADD', KEYS[4], 'MAXLEN', '64', '*', 'keys', KEYS[2])
return 1
"""

# End a running job with an error entry when a worker cannot write its stream (a non-transient error,
# e.g. OOM under maxmemory) instead of retrying for ever. Its first write (HDEL of the stored request,
# which a finished job no longer needs) frees memory and is not refused under maxmemory; Redis then
# lets the script's other writes through (a script that has begun writing is not stopped midway).
# Fenced as WRITE_BATCH is: a job that has begun a later run is not its to end (`Aborted`).
# KEYS: job hash, stream. ARGV: stream maxlen, stream ttl, job ttl, message, the writer's attempt ('': any).
ABORT = """
local state = redis.call('HGET', KEYS[1], 'state')
if state == 'done' or state == 'cancelled' then return 0 end
if ARGV[5] ~= '' and redis.call('HGET', KEYS[1], 'attempt') ~= ARGV[5] then return 2 end
redis.call('HDEL', KEYS[1], 'request')
redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[1], '*', 'type', 'error', 'message', ARGV[4], 'field', '')
redis.call('EXPIRE', KEYS[2], ARGV[2])
redis.call('HSET', KEYS[1], 'state', 'done', 'error', ARGV[4], 'field', '')
redis.call('EXPIRE', KEYS[1], ARGV[3])
return 1
"""

# Stream entries, applied at most once per (writer, seq). A job's last entry and final state go together
# (a worker dying after the end never leaves a 'running' job to run again). Fenced: a stream whose job
# has begun a later run than the writer's (paused, taken for dead, resumed elsewhere) gets nothing. Then
# one STREAM_TICK entry naming the streams written and carrying what was written to each (tasks/ticks.py),
# so a reader that follows many streams reads one entry per batch instead of one per stream. A stream's
# part names the entry before the batch's: the writer says which it last wrote there, and XSETID to it
# (a no-op then) is refused if an entry above it exists; only then is the last id looked up (an XREVRANGE
# per stream costs as much as the rest of the batch's work for that stream).
# KEYS: the writer's key, STREAM_TICK, streams and job hashes. ARGV: maxlen, stream ttl, job ttl, seq,
# the number of fences, per fence its stream index, job index (into KEYS) and the writer's attempt; the
# number of last ids, per one its stream index and the id the writer last wrote there; per entry its
# stream index and either 0 and a plain token's (index, text, token id, emit stamp: most entries), or -1
# and joined tokens' (first index, count, texts joined, ids, lengths, stamp), or the number of field
# pairs, the job index (0: none), the number of job-state pairs, the field pairs, the job-state pairs.
# Returns {the job hashes fenced off, {per stream written its index and the id of its last entry}}.
WRITE_BATCH = """
if tonumber(redis.call('GET', KEYS[1]) or '0') >= tonumber(ARGV[4]) then return {} end
redis.call('SET', KEYS[1], ARGV[4], 'EX', 86400)
local maxlen, enc = ARGV[1], cjson.encode
local fenced, out, segs, order, tops, lasts = {}, {}, {}, {}, {}, {}
-- A stream's part of the tick (JSON built as it goes: a table and cjson per entry cost more than the
-- XADD), begun with the id of the entry before the batch's: a reader there may take the batch as is.
local function part(s, key)
  local top = tops[s]  -- refused unless no entry above the writer's last one exists
  local held = top and redis.pcall('XSETID', key, top)
  if not (held and held.ok) then
    local last = redis.call('XREVRANGE', key, '+', '-', 'COUNT', 1)
    top = last[1] and last[1][1] or '0-0'
  end
  local seg = {'["' .. top .. '"'}
  segs[s] = seg
  order[#order + 1] = s
  return seg
end
local i = 6
for _ = 1, tonumber(ARGV[5]) do
  local job = KEYS[tonumber(ARGV[i + 1])]
  if redis.call('HGET', job, 'attempt') ~= ARGV[i + 2] then
    fenced[tonumber(ARGV[i])] = true
    out[#out + 1] = job
  end
  i = i + 3
end
for _ = 1, tonumber(ARGV[i]) do
  tops[ARGV[i + 1]] = ARGV[i + 2]
  i = i + 2
end
i = i + 1
while i <= #ARGV do
  local s = ARGV[i]
  local key, skip, n = KEYS[tonumber(s)], fenced[tonumber(s)], tonumber(ARGV[i + 1])
  if n == 0 then  -- (index, token id and stamp are the writer's numbers: no escaping needed)
    if not skip then
      local seg = segs[s] or part(s, key)
      local id = redis.call('XADD', key, 'MAXLEN', '~', maxlen, '*', 'type', 'token', 'i', ARGV[i + 2],
        'text', ARGV[i + 3], 'id', ARGV[i + 4], 'ts', ARGV[i + 5])
      seg[#seg + 1] = ',"' .. id .. '",["type","token","i","' .. ARGV[i + 2] .. '","text",' .. enc(ARGV[i + 3]) ..
        ',"id","' .. ARGV[i + 4] .. '","ts","' .. ARGV[i + 5] .. '"]'
      lasts[s] = id
    end
    i = i + 6
  elseif n == -1 then
    if not skip then
      local seg = segs[s] or part(s, key)
      local id = redis.call('XADD', key, 'MAXLEN', '~', maxlen, '*', 'type', 'token', 'i', ARGV[i + 2],
        'n', ARGV[i + 3], 'text', ARGV[i + 4], 'id', ARGV[i + 5], 'len', ARGV[i + 6], 'ts', ARGV[i + 7])
      seg[#seg + 1] = ',"' .. id .. '",["type","token","i","' .. ARGV[i + 2] .. '","n","' .. ARGV[i + 3] ..
        '","text",' .. enc(ARGV[i + 4]) .. ',"id","' .. ARGV[i + 5] .. '","len","' .. ARGV[i + 6] ..
        '","ts","' .. ARGV[i + 7] .. '"]'
      lasts[s] = id
    end
    i = i + 8
  elseif skip then
    i = i + 4 + 2 * n + 2 * tonumber(ARGV[i + 3])
  else
    local job, m = tonumber(ARGV[i + 2]), tonumber(ARGV[i + 3])
    local f = {}
    for j = 1, 2 * n do f[j] = ARGV[i + 3 + j] end
    local seg = segs[s] or part(s, key)
    local id = redis.call('XADD', key, 'MAXLEN', '~', maxlen, '*', unpack(f))
    seg[#seg + 1] = ',"' .. id .. '",' .. enc(f)
    lasts[s] = id
    if job > 0 then
      redis.call('EXPIRE', key, ARGV[2])
      local h = {'HSET', KEYS[job]}
      for j = 1, 2 * m do h[#h + 1] = ARGV[i + 3 + 2 * n + j] end
      if m > 0 then redis.call(unpack(h)) end
      redis.call('EXPIRE', KEYS[job], ARGV[3])
    end
    i = i + 4 + 2 * n + 2 * m
  end
end
local ids, data, size, written = {}, {}, 0, {}
for n, s in ipairs(order) do
  ids[n] = KEYS[tonumber(s)]
  written[2 * n - 1], written[2 * n] = tonumber(s), lasts[s]
  local seg = size < @TICK_DATA@ and table.concat(segs[s]) .. ']' or ''
  if #seg > @TICK_DATA@ - size then seg = '' end  -- too much to keep in a tick: readers read the stream
  data[n], size = seg, size + #seg
end
redis.call('XADD', KEYS[2], 'MAXLEN', '64', '*', 'seq', ARGV[4], 'keys', table.concat(ids, ' '),
  'data', table.concat(data, '\\30'))
return {out, written}
"""
TICK_DATA = 131_072  # bytes of entries a tick carries at most (64 ticks kept: 8 MiB a shard at worst)
WRITE_BATCH = WRITE_BATCH.replace("@TICK_DATA@", str(TICK_DATA))

# Cancel from a client: a queued job ends here and now; a running one is flagged for its worker.
CANCEL = """
local state = redis.call('HGET', KEYS[1], 'state')
if state == 'done' or state == 'cancelled' then return state end
if state == 'running' then
  redis.call('HSET', KEYS[1], 'cancel', '1')
  redis.call('PUBLISH', ARGV[4], ARGV[5])
  return 'running'
end
redis.call('HSET', KEYS[1], 'state', 'cancelled')
redis.call('ZREM', KEYS[3], ARGV[5])
redis.call('EXPIRE', KEYS[1], ARGV[2])
redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[1], '*', 'type', 'end', 'reason', 'cancelled', 'result', ARGV[3])
redis.call('EXPIRE', KEYS[2], ARGV[2])
return 'queued'
"""
