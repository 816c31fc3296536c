-- claim: ARGV digest, consumer, lease_id, lease_ms, count, min_count, by_group, ordered, lo, hi,
-- stop_at_target, max_age, whole_groups, ncols, columns...
-- Picks up to `count` rows whose columns are final and that `consumer` has not claimed, leases
-- them until now + lease_ms, and returns {deadline, nrows, rows[nrows], ages[nrows]}; the client
-- then reads the values (val:{column}:{row}); the claimed columns are final, nobody rewrites them.
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
for i = 15, #ARGV do ready[#ready + 1] = redis.call('GET', k('ready:' .. ARGV[i])) or '' end
local consumed = redis.call('GET', k('consumed:' .. consumer)) or ''
local live = redis.call('GET', k('live')) or ''
local function row_free(row)
  if bit_at(consumed, row) or not bit_at(live, row) then return false end
  for _, bitmap in ipairs(ready) do
    if not bit_at(bitmap, row) then return false end
  end
  return true
end

local picked = {}
if ordered then
  local start = lo
  while start < hi and bit_at(consumed, start) do start = start + 1 end
  for row = start, math.min(start + count, hi) - 1 do
    if not row_free(row) then picked = {} break end
    picked[#picked + 1] = row
  end
elseif not (stop_at_target and tonumber(meta.complete) >= tonumber(meta.target) and max_age < 0) then
  local after_target = stop_at_target and tonumber(meta.complete) >= tonumber(meta.target)
  local flat = redis.call('ZRANGE', k('age'), 0, -1, 'WITHSCORES')
  local groups = {}
  for i = 1, #flat, 2 do groups[#groups + 1] = {tonumber(flat[i]), tonumber(flat[i + 1])} end
  table.sort(groups, function(a, b)
    if a[2] ~= b[2] then return a[2] > b[2] end
    return a[1] < b[1]
  end)
  for _, entry in ipairs(groups) do
    if #picked >= count then break end
    local group, age = entry[1], entry[2]
    local eligible = (not after_target or age >= max_age) and
      (not whole_groups or tonumber(redis.call('HGET', k('done'), group) or '0') >= n)
    if eligible then
      local first = group * n
      if by_group then
        local all = #picked + n <= count
        for row = first, first + n - 1 do
          if not all then break end
          all = row_free(row)
        end
        if all then
          for row = first, first + n - 1 do picked[#picked + 1] = row end
        end
      else
        for row = first, first + n - 1 do
          if #picked < count and row_free(row) then picked[#picked + 1] = row end
        end
      end
    end
  end
end
if #picked < min_count or #picked == 0 then return {0, 0} end

local deadline = now + lease_ms
local leases, owners, age_of = {}, {}, {}
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
return reply
