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
# one STREAM_TICK entry naming the streams written (readers block on it, then read those). KEYS: the
# writer's key, STREAM_TICK, streams and job hashes. ARGV: maxlen, stream ttl, job ttl, seq, the number
# of fences, per fence its stream index, job index (into KEYS) and the writer's attempt; per entry its
# stream index and either 0 and a plain token's (index, text, token id, emit stamp: most entries), or -1
# and joined tokens' (first index, count, texts joined, ids, lengths, stamp), or the number of field
# pairs, the job index (0: none), the number of job-state pairs, the field pairs, the job-state pairs.
# Returns the job hashes fenced off.
WRITE_BATCH = """
if tonumber(redis.call('GET', KEYS[1]) or '0') >= tonumber(ARGV[4]) then return {} end
redis.call('SET', KEYS[1], ARGV[4], 'EX', 86400)
local maxlen = ARGV[1]
local fenced, out, wrote = {}, {}, {}
local i = 6
for _ = 1, tonumber(ARGV[5]) do
  local job = KEYS[tonumber(ARGV[i + 1])]
  if redis.call('HGET', job, 'attempt') ~= ARGV[i + 2] then
    fenced[tonumber(ARGV[i])] = true
    out[#out + 1] = job
  end
  i = i + 3
end
while i <= #ARGV do
  local key = KEYS[tonumber(ARGV[i])]
  local skip = fenced[tonumber(ARGV[i])]
  local n = tonumber(ARGV[i + 1])
  if not skip then wrote[ARGV[i]] = true end
  if n == 0 then
    if not skip then
      redis.call('XADD', key, 'MAXLEN', '~', maxlen, '*', 'type', 'token', 'i', ARGV[i + 2], 'text', ARGV[i + 3],
        'id', ARGV[i + 4], 'ts', ARGV[i + 5])
    end
    i = i + 6
  elseif n == -1 then
    if not skip then
      redis.call('XADD', key, 'MAXLEN', '~', maxlen, '*', 'type', 'token', 'i', ARGV[i + 2], 'n', ARGV[i + 3],
        'text', ARGV[i + 4], 'id', ARGV[i + 5], 'len', ARGV[i + 6], 'ts', ARGV[i + 7])
    end
    i = i + 8
  elseif skip then
    i = i + 4 + 2 * n + 2 * tonumber(ARGV[i + 3])
  else
    local job, m = tonumber(ARGV[i + 2]), tonumber(ARGV[i + 3])
    local cmd = {'XADD', key, 'MAXLEN', '~', maxlen, '*'}
    for j = 1, 2 * n do cmd[#cmd + 1] = ARGV[i + 3 + j] end
    redis.call(unpack(cmd))
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
local ids = {}
for k in pairs(wrote) do ids[#ids + 1] = KEYS[tonumber(k)] end
redis.call('XADD', KEYS[2], 'MAXLEN', '64', '*', 'seq', ARGV[4], 'keys', table.concat(ids, ' '))
return out
"""

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

# Move waiting messages between two queues, list by list (the most urgent first), the oldest first, up to
# ARGV[1] (0: all), put where they are taken next, in order: a stealing worker takes a backlogged one's, a
# dead or stopping worker's own queue goes to the shared one. Atomic. KEYS: the source's lists, then the
# destination's (as many). ARGV: most messages. Returns the count.
MOVE_QUEUED = """
local n = tonumber(ARGV[1])
local half = #KEYS / 2
local moved = 0
for i = 1, half do
  local got = {}
  while n == 0 or moved < n do
    local m = redis.call('RPOP', KEYS[i])
    if not m then break end
    got[#got + 1] = m
    moved = moved + 1
  end
  for j = #got, 1, -1 do
    redis.call('RPUSH', KEYS[half + i], got[j])
  end
end
return moved
"""

# Fair staging (start-time fair queuing, Goyal et al. 1996, charged in weight units). A staged job of
# tenant t and weight w gets the start tag S = max(v, F_t), and F_t becomes S + w: a tenant's jobs keep
# their order, a flooding tenant's tags run far ahead of v, and a tenant back from idle starts at v
# (staying away saves no credit). Jobs are released by class, then by start tag. A member is
# "<tenant> <the kombu message>" (a tenant holds no space: ID_PATTERN). The hash's `n` counts the staged
# jobs (only RELEASE takes it down), so an idle worker's release costs a read, not a look at twenty sets.
# KEYS: the staged set of the job's priority, the target's fair hash. ARGV: the kombu message (as kombu
# would push it), tenant, weight, its priority index (each class has its virtual clock `v:<index>`;
# a tenant's finish tag counts its service in every class). Returns the start tag.
STAGE = """
local v = tonumber(redis.call('HGET', KEYS[2], 'v:' .. ARGV[4]) or '0')
local f = tonumber(redis.call('HGET', KEYS[2], 't:' .. ARGV[2]) or '0')
local s = math.max(v, f)
redis.call('HSET', KEYS[2], 't:' .. ARGV[2], string.format('%.17g', s + tonumber(ARGV[3])))
redis.call('ZADD', KEYS[1], string.format('%.17g', s), ARGV[2] .. ' ' .. ARGV[1])
redis.call('HINCRBY', KEYS[2], 'n', 1)
return string.format('%.17g', s)
"""

# Release staged jobs into the lists Celery consumes: the most urgent class first, within a class the
# smallest start tag first, each source in the order given (a worker's own target, then the shared one).
# Up to ARGV[1] of any class, then ARGV[2] more of the urgent classes (priority index <= ARGV[3]), then
# ARGV[6] more of the urgent classes whose tenant is not among ARGV[8..] (the heavy: an equal share of
# the engine or more), the first such among the next LIGHT_SCAN (past a heavy tenant's jobs at the
# head): the batcher preempts the heaviest tenant's newest requests for it. Those beyond ARGV[1] go to
# the consuming end of their list, ahead of what the room let in before. Each release moves v of its
# source and class to its tag (never back). Atomic: a job is never out of Redis. KEYS: the destination's
# 10 lists, the 10 whose messages count as waiting for this worker (the destination's, or the shared
# queue's), per source its fair hash and 10 staged sets. ARGV[5] '1': the destination's waiting messages
# count against ARGV[1] (all) and ARGV[2] (the urgent classes', released and not yet taken), never
# against light, whose jobs go ahead of them. Returns {released, the urgent classes' messages waiting
# in both's lists: 0, uncounted, when nothing was released, ARGV[2] is 0 and ARGV[7] (recount) is 0}.
LIGHT_SCAN = 32  # staged jobs RELEASE looks through for a light tenant's, beyond the room
RELEASE = """
local LIGHT_SCAN = @LIGHT_SCAN@
local any, urgent, last = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local sources, light = tonumber(ARGV[4]), tonumber(ARGV[6])
local heavy = {}
for i = 8, #ARGV do heavy[ARGV[i]] = true end
if ARGV[5] == '1' then
  local queued_urgent = 0
  for p = 1, 10 do
    local n = redis.call('LLEN', KEYS[p])
    any = any - n
    if p - 1 <= last then queued_urgent = queued_urgent + n end
  end
  if any < 0 then any = 0 end
  urgent = math.max(0, urgent - queued_urgent)
end
local released = 0
local beyond = {}
local staged_any = {}
for s = 0, sources - 1 do
  staged_any[s] = tonumber(redis.call('HGET', KEYS[21 + s * 11], 'n') or '0') > 0
end
for p = 0, 9 do
  for s = 0, sources - 1 do
    local base = 20 + s * 11
    local fair, staged = KEYS[base + 1], KEYS[base + 2 + p]
    while staged_any[s] and (any > 0 or (p <= last and (urgent > 0 or light > 0))) do
      local member, tag, past = nil, nil, any == 0
      if any > 0 or (p <= last and urgent > 0) then
        local head = redis.call('ZRANGE', staged, 0, 0, 'WITHSCORES')
        if #head == 0 then break end
        member, tag = head[1], head[2]
        if any > 0 then any = any - 1 else urgent = urgent - 1 end
      else
        -- the first job of a tenant not heavy among the next few: a heavy tenant's job at the head
        -- (its tag ahead by one job) must not hold a light tenant's back until the engine has room
        local ahead = redis.call('ZRANGE', staged, 0, LIGHT_SCAN - 1, 'WITHSCORES')
        for j = 1, #ahead, 2 do
          local cut = string.find(ahead[j], ' ', 1, true)
          if not heavy[string.sub(ahead[j], 1, cut - 1)] then member, tag = ahead[j], ahead[j + 1]; break end
        end
        if member == nil then break end
        light = light - 1
      end
      local space = string.find(member, ' ', 1, true)
      redis.call('ZREM', staged, member)
      redis.call('HINCRBY', fair, 'n', -1)
      if past then  -- beyond the room: taken before what waits in the list (pushed at its consuming end below)
        beyond[p] = beyond[p] or {}
        table.insert(beyond[p], string.sub(member, space + 1))
      else
        redis.call('LPUSH', KEYS[1 + p], string.sub(member, space + 1))
      end
      local v = tonumber(redis.call('HGET', fair, 'v:' .. p) or '0')
      if tonumber(tag) > v then redis.call('HSET', fair, 'v:' .. p, tag) end
      released = released + 1
    end
  end
end
for p, jobs in pairs(beyond) do
  for i = #jobs, 1, -1 do redis.call('RPUSH', KEYS[1 + p], jobs[i]) end
end
local waiting = 0
-- counted only when something may have gone beyond the room: an idle worker's look stays two reads
if released == 0 and ARGV[2] == '0' and ARGV[7] ~= '1' then return {0, 0} end
for p = 0, last do
  waiting = waiting + redis.call('LLEN', KEYS[1 + p])
  if KEYS[11 + p] ~= KEYS[1 + p] then waiting = waiting + redis.call('LLEN', KEYS[11 + p]) end
end
return {released, waiting}
"""
RELEASE = RELEASE.replace("@LIGHT_SCAN@", str(LIGHT_SCAN))
