-- claim: ARGV digest, consumer, lease_id, lease_ms, count, min_count, by_group, ordered, lo, hi,
-- stop_at_target, max_age, whole_groups, ncols, columns[ncols], nread, read_columns[nread].
-- Picks up to `count` rows whose columns are final and that `consumer` has not claimed, leases
-- them until now + lease_ms, and returns {deadline, nrows, rows[nrows], ages[nrows], then the
-- values of each read column at those rows (false: not stored)}: values come back in the same
-- round trip as the claim.
-- ordered: the next rows of [lo, hi) in index order, or nothing while those are not ready.
-- otherwise: groups oldest first (age desc), then by group id. After the iteration's target of
-- complete groups is reached (stop_at_target), only groups of age >= max_age stay claimable.
local meta, err = open(ARGV[1])
if not meta then return err end
local consumer, lease_id = ARGV[2], ARGV[3]
local lease_ms, count, min_count = tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6])
local by_group, ordered = ARGV[7] == '1', ARGV[8] == '1'
local lo, hi = tonumber(ARGV[9]), tonumber(ARGV[10])
local stop_at_target, max_age, whole_groups = ARGV[11] == '1', tonumber(ARGV[12]), ARGV[13] == '1'
local n = tonumber(meta.n)
local now = now_ms()
redis.call('SADD', k('consumers'), consumer)
requeue_expired(consumer, now)

local ready = {}
local ncols = tonumber(ARGV[14])
for i = 15, 14 + ncols do ready[#ready + 1] = redis.call('GET', k('ready:' .. ARGV[i])) or '' end
local consumed = redis.call('GET', k('consumed:' .. consumer)) or ''
local live = redis.call('GET', k('live')) or ''
local function row_free(row)
  if bit_at(consumed, row) or not bit_at(live, row) then return false end
  for _, bitmap in ipairs(ready) do
    if not bit_at(bitmap, row) then return false end
  end
  return true
end

local picked, age_of = {}, {}  -- age_of: group -> age, where the pick already read it
if ordered then
  local start = lo
  while start < hi and bit_at(consumed, start) do start = start + 1 end
  for row = start, math.min(start + count, hi) - 1 do
    if not row_free(row) then picked = {} break end
    picked[#picked + 1] = row
  end
elseif not (stop_at_target and tonumber(meta.complete) >= tonumber(meta.target) and max_age < 0) then
  local after_target = stop_at_target and tonumber(meta.complete) >= tonumber(meta.target)
  -- A group is complete when all n rows' completion column is final: its ready bits, read once.
  local complete = whole_groups and (redis.call('GET', k('ready:' .. meta.completion)) or '')
  local function group_free(first)
    for row = first, first + n - 1 do
      if not row_free(row) then return false end
    end
    return true
  end
  local function group_complete(first)
    for row = first, first + n - 1 do
      if not bit_at(complete, row) then return false end
    end
    return true
  end
  -- Groups by age, oldest first, each age's groups by id: numbers sorted with Lua's own `<`
  -- (a comparator closure over {group, age} pairs cost more than the rest of a claim).
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
    if not after_target or age >= max_age then
      local groups = by_age[age]
      table.sort(groups)
      for _, group in ipairs(groups) do
        if #picked >= count then break end
        local first = group * n
        local before = #picked
        if by_group then
          -- free first: a consumed group fails at its first row, before its completion bits are read
          if #picked + n <= count and group_free(first) and (not whole_groups or group_complete(first)) then
            for row = first, first + n - 1 do picked[#picked + 1] = row end
          end
        elseif not whole_groups or group_complete(first) then
          for row = first, first + n - 1 do
            if #picked < count and row_free(row) then picked[#picked + 1] = row end
          end
        end
        if #picked > before then age_of[group] = age end
      end
    end
  end
end
if #picked < min_count or #picked == 0 then return {0, 0} end

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
  for _, row in ipairs(picked) do keys[#keys + 1] = value_key(ARGV[c], row) end
  for first = 1, #keys, 1000 do
    for _, value in ipairs(redis.call('MGET', unpack(keys, first, math.min(first + 999, #keys)))) do
      reply[#reply + 1] = value
    end
  end
end
return reply
