-- claim: ARGV caller (lib.lua), consumer, lease_id, lease_ms, count, min_count, by_group, ordered, lo, hi,
-- stop_at_target, max_age, whole_groups, ncols, columns[ncols], nread, read_columns[nread], wait_ms.
-- Picks up to `count` rows whose columns are final and that `consumer` has not claimed, leases
-- them until now + lease_ms, and returns {deadline, nrows, rows[nrows], ages[nrows], then the
-- values of each read column at those rows (false: not stored)}: values come back in the same
-- round trip as the claim.
-- ordered: the next rows of [lo, hi) in index order, or nothing while those are not ready.
-- otherwise: groups oldest first (age desc), then in admission order (put.lua's `order`). After the iteration's target of
-- complete groups is reached (stop_at_target), only groups of age >= max_age stay claimable.
-- A claim that finds too few rows and whose caller will wait (wait_ms > 0) is listed in `waiting`
-- until then, so the next put or release wakes it (lib.lua's wake_consumers).
local meta, err = open(ARGV[1])
if not meta then return err end
local consumer, lease_id = ARGV[2], ARGV[3]
local lease_ms, count, min_count = tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6])
local by_group, ordered = ARGV[7] == '1', ARGV[8] == '1'
local lo, hi = tonumber(ARGV[9]), tonumber(ARGV[10])
local stop_at_target, max_age, whole_groups = ARGV[11] == '1', tonumber(ARGV[12]), ARGV[13] == '1'
local ncols = tonumber(ARGV[14])
local n = tonumber(meta.n)
local now = now_ms()
redis.call('SADD', k('consumers'), consumer)
requeue_expired(consumer, now)

-- The rows this consumer may take: live, not consumed, every asked column final. One bitmap,
-- made by BITOP at C speed, so the picking below tests one bit per row and skips runs of
-- untakeable rows with string.find instead of walking every group in Lua.
local consumed = redis.call('GET', k('consumed:' .. consumer)) or ''
local free_key = k('free')
local missing = redis.call('STRLEN', k('live')) - #consumed  -- rows past the consumed bitmap's end are unclaimed
redis.call('SET', free_key, missing > 0 and consumed .. string.rep('\0', missing) or consumed)
redis.call('BITOP', 'NOT', free_key, free_key)
local sources = {k('live')}
for i = 15, 14 + ncols do sources[#sources + 1] = k('ready:' .. ARGV[i]) end
redis.call('BITOP', 'AND', free_key, free_key, unpack(sources))
local free = redis.call('GET', free_key) or ''
redis.call('DEL', free_key)

-- The first row >= `row` whose bit is set in `free`, or nil.
local function next_free(row)
  local byte = math.floor(row / 8) + 1
  while byte <= #free do
    local bits = string.byte(free, byte)
    if bits ~= 0 then
      for r = math.max(row, (byte - 1) * 8), byte * 8 - 1 do
        if bit_at(free, r) then return r end
      end
    end
    byte = string.find(free, '[^%z]', byte + 1)
    if not byte then return nil end
  end
  return nil
end
local function group_free(first)
  for row = first, first + n - 1 do
    if not bit_at(free, row) then return false end
  end
  return true
end
-- A group is complete when all n rows' completion column is final (read only when asked).
local complete = whole_groups and (redis.call('GET', k('ready:' .. meta.completion)) or '')
local function group_complete(first)
  for row = first, first + n - 1 do
    if not bit_at(complete, row) then return false end
  end
  return true
end

local picked, age_of = {}, {}  -- age_of: group -> age, where the pick already read it
-- Takes what `group` offers (all n rows, or with by_group=false its free rows) within count.
local function take(group, age)
  local first = group * n
  local before = #picked
  if by_group then
    if #picked + n <= count and group_free(first) and (not whole_groups or group_complete(first)) then
      for row = first, first + n - 1 do picked[#picked + 1] = row end
    end
  elseif not whole_groups or group_complete(first) then
    for row = first, first + n - 1 do
      if #picked < count and bit_at(free, row) then picked[#picked + 1] = row end
    end
  end
  if #picked > before then age_of[group] = age end
end

if ordered then
  local start = lo
  while start < hi and bit_at(consumed, start) do start = start + 1 end
  for row = start, math.min(start + count, hi) - 1 do
    if not bit_at(free, row) then picked = {} break end
    picked[#picked + 1] = row
  end
else
  local after_target = stop_at_target and tonumber(meta.complete) >= tonumber(meta.target)
  -- After the target only the last split's groups (max_age >= 0: require_max_age_all_finished) go on.
  local function age_open(age) return not after_target or (max_age >= 0 and age >= max_age) end
  local youngest = redis.call('ZRANGE', k('age'), 0, 0, 'WITHSCORES')
  local oldest = redis.call('ZRANGE', k('age'), -1, -1, 'WITHSCORES')
  -- Admission rounds of the first and the last admitted group (put.lua's `order` scores).
  local groups_total = math.floor(tonumber(meta.capacity) / n)
  local first_in = redis.call('ZRANGE', k('order'), 0, 0, 'WITHSCORES')
  local last_in = redis.call('ZRANGE', k('order'), -1, -1, 'WITHSCORES')
  local one_round = #first_in == 0 or math.floor(tonumber(first_in[2]) / groups_total) == math.floor(tonumber(last_in[2]) / groups_total)
  local function full() return #picked >= count or (by_group and #picked + n > count) end
  if #youngest > 0 and youngest[2] == oldest[2] then
    -- Every group has one age (always so without partial rollout).
    local age = tonumber(oldest[2])
    if age_open(age) and one_round then
      -- One admission round: group id order is admission order and row order, so the free rows'
      -- bitmap gives the groups in order.
      local row = next_free(0)
      while row and not full() do
        local group = math.floor(row / n)
        take(group, age)
        row = next_free((group + 1) * n)
      end
    elseif age_open(age) then
      -- Several rounds (asynchronous RL admits each iteration): the groups admitted first go first,
      -- so a group is not left to go stale while younger ones in lower slots are trained.
      local start = 0
      while not full() do
        local groups = redis.call('ZRANGE', k('order'), start, start + 255)
        if #groups == 0 then break end
        for _, group in ipairs(groups) do
          take(tonumber(group), age)
          if full() then break end
        end
        start = start + 256
      end
    end
  elseif #youngest > 0 then
    -- Groups by age, oldest first, each age's groups in admission order.
    local rank = {}
    for i, group in ipairs(redis.call('ZRANGE', k('order'), 0, -1)) do rank[tonumber(group)] = i end
    local flat = redis.call('ZRANGE', k('age'), 0, -1, 'WITHSCORES')
    local by_age, ages = {}, {}
    for i = 1, #flat, 2 do
      local age = tonumber(flat[i + 1])
      if not by_age[age] then by_age[age] = {}; ages[#ages + 1] = age end
      by_age[age][#by_age[age] + 1] = tonumber(flat[i])
    end
    table.sort(ages, function(a, b) return a > b end)
    for _, age in ipairs(ages) do
      if #picked >= count then break end
      if age_open(age) then
        local groups = by_age[age]
        table.sort(groups, function(a, b) return (rank[a] or a + groups_total) < (rank[b] or b + groups_total) end)
        for _, group in ipairs(groups) do
          if #picked >= count then break end
          take(group, age)
        end
      end
    end
  end
end
if #picked < min_count or #picked == 0 then
  local wait_ms = tonumber(ARGV[#ARGV])
  if wait_ms > 0 then redis.call('HSET', k('waiting'), consumer, now + wait_ms) end
  return {0, 0}
end

local deadline = now + lease_ms
local leases, owners = {}, {}
for _, row in ipairs(picked) do
  leases[#leases + 1] = deadline; leases[#leases + 1] = row
  owners[#owners + 1] = row; owners[#owners + 1] = lease_id
end
set_bits(k('consumed:' .. consumer), picked, 1)
batched('ZADD', k('lease:' .. consumer), leases)
batched('HSET', k('owner:' .. consumer), owners)
local reply = {deadline, #picked}
for _, row in ipairs(picked) do reply[#reply + 1] = row end
for _, row in ipairs(picked) do
  local group = math.floor(row / n)
  if age_of[group] == nil then age_of[group] = tonumber(redis.call('ZSCORE', k('age'), group) or '0') end
  reply[#reply + 1] = age_of[group]
end
for c = 16 + ncols, 15 + ncols + tonumber(ARGV[15 + ncols]) do
  local keys = {}
  local prefix = value_prefix(ARGV[c])
  for _, row in ipairs(picked) do keys[#keys + 1] = prefix .. row end
  for first = 1, #keys, 1000 do
    for _, value in ipairs(redis.call('MGET', unpack(keys, first, math.min(first + 999, #keys)))) do
      reply[#reply + 1] = value
    end
  end
end
return reply
