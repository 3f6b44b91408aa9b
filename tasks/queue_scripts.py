"""The Lua scripts of the queue in front of the workers (the staged sets and the lists Celery consumes),
each atomic in Redis: part of the job contract (tasks/contract.py re-exports them), apart from the
scripts of a job's state and stream (scripts.py). Every key they touch comes in KEYS, spelled by contract.py."""

from __future__ import annotations

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
# A release that leaves a source with nothing staged drops its tenants' finish tags there (the
# class clocks stay). With nothing staged every tag is within a job of its class's clock, so a new job's
# start tag is what it would have been, give or take a job (and service in one class no longer counts
# against another once the queue empties: there was no contention left to arbitrate); kept, the hash
# would hold every tenant that ever sent a job, for ever. Between two empty moments it holds those that did.
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
local staged_any, left = {}, {}  -- per source: whether anything is staged, how much (the script is atomic)
for s = 0, sources - 1 do
  left[s] = tonumber(redis.call('HGET', KEYS[21 + s * 11], 'n') or '0')
  staged_any[s] = left[s] > 0
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
      left[s] = left[s] - 1
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
for s = 0, sources - 1 do  -- a source this call emptied forgets its tenants' finish tags (see above)
  local fair = KEYS[21 + s * 11]
  if staged_any[s] and left[s] <= 0 then
    local gone = {}
    for _, f in ipairs(redis.call('HKEYS', fair)) do
      if string.sub(f, 1, 2) == 't:' then gone[#gone + 1] = f end
      if #gone == 512 then redis.call('HDEL', fair, unpack(gone)); gone = {} end
    end
    if #gone > 0 then redis.call('HDEL', fair, unpack(gone)) end
  end
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

# A queue that is forgotten (a dead worker's own queue, drained and unregistered) takes its fair state
# with it, unless something was staged there since (a client that still routed to it): then it stays
# for RELEASE to find. KEYS: the queue's fair hash. Returns 1 if deleted.
FORGET_FAIR = """
if tonumber(redis.call('HGET', KEYS[1], 'n') or '0') > 0 then return 0 end
return redis.call('DEL', KEYS[1])
"""
