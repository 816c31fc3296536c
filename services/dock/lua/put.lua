-- put: ARGV caller (lib.lua), consumer, lease_id, version, partial, append, max_bytes, nrows, ncols,
-- rows[nrows], per column: name, appendable; then the values, column by column (value of
-- column c, row i at 10 + nrows + 2 * ncols + c * nrows + i).
-- The values travel in the script's own call, so a put is one command, one round trip and one
-- write per value. Checks the token and (with a consumer) that the lease still holds every row
-- before writing anything, and (max_bytes > 0) that Redis's used_memory plus the put's bytes stays
-- within max_bytes, so a full Redis refuses a put instead of evicting keys or failing mid-way
-- (used_memory already holds this call's arguments: the check errs on the safe side). A final put sets the ready flags and ends the lease; a partial put
-- (partial rollout) stores without ready flags, returns the rows to the consumer's pool and
-- ages them.
local consumer, lease_id, version = ARGV[2], ARGV[3], ARGV[4]
local partial, append, max_bytes = ARGV[5] == '1', ARGV[6] == '1', tonumber(ARGV[7])
local nrows, ncols = tonumber(ARGV[8]), tonumber(ARGV[9])
local rows = {}
for i = 1, nrows do rows[i] = ARGV[9 + i] end
local first_value = 10 + nrows + 2 * ncols

local meta, err = open(ARGV[1])
if not meta then return err end
if consumer ~= '' then
  requeue_expired(consumer, now_ms())
  local stale = check_owned(consumer, lease_id, rows)
  if stale then return stale end
end
if max_bytes > 0 then
  local bytes = 0
  for i = first_value, #ARGV do bytes = bytes + #ARGV[i] end
  local used = tonumber(string.match(redis.call('INFO', 'memory'), 'used_memory:(%d+)'))
  if used + bytes > max_bytes then
    return fail('DOCK_MEMORY', string.format('a put of %.1f MiB would take Redis from %.1f MiB of used_memory past ' ..
      'dock.max_memory_mb = %.1f; retire trained groups (begin_iteration), clear old runs or raise the limit',
      bytes / 1048576, used / 1048576, max_bytes / 1048576))
  end
end
local n = tonumber(meta.n)

-- Rows new to the pool: admitted, and their groups enter the age set at 0 and the admission
-- order at (this round, group id), so claims can take the groups admitted first first.
-- One entry per group, not per row: a prompts put admits n rows of each group.
local admitted, new_groups, new_order, seen = 0, {}, {}, {}
local round = tonumber(redis.call('HGET', k('meta'), 'rounds') or '0')
local groups_total = math.floor(tonumber(meta.capacity) / n)
for i, was in ipairs(set_bits(k('live'), rows, 1)) do
  if was == 0 then
    local group = math.floor(tonumber(rows[i]) / n)
    admitted = admitted + 1
    if not seen[group] then
      seen[group] = true
      new_groups[#new_groups + 1] = 0
      new_groups[#new_groups + 1] = group
      new_order[#new_order + 1] = round * groups_total + group
      new_order[#new_order + 1] = group
    end
  end
end
if admitted > 0 then
  redis.call('HINCRBY', k('meta'), 'admitted', admitted)
  batched('ZADD', k('age'), new_groups, 'NX')
  batched('ZADD', k('order'), new_order, 'NX')
end

-- The columns that hold values: begin_iteration removes only theirs (lib.lua's drop_rows).
local names = {}
for c = 0, ncols - 1 do names[#names + 1] = ARGV[10 + nrows + 2 * c] end
redis.call('SADD', k('stored'), unpack(names))
for c = 0, ncols - 1 do
  local name, appendable = ARGV[10 + nrows + 2 * c], ARGV[11 + nrows + 2 * c] == '1'
  local prefix = value_prefix(name)
  local writes = {}  -- key, value pairs for MSET: one command per 500 values instead of a SET each
  for i, row in ipairs(rows) do
    local value, dst = ARGV[first_value + c * nrows + i - 1], prefix .. row
    if append and appendable and redis.call('EXISTS', dst) == 1 then
      -- 1-D values: dimension 0 (bytes 3-6) grows, the data is appended after the stored data.
      local length = struct.unpack('<I4', redis.call('GETRANGE', dst, 2, 5)) + struct.unpack('<I4', value, 3)
      redis.call('APPEND', dst, string.sub(value, 7))
      redis.call('SETRANGE', dst, 2, struct.pack('<I4', length))
    else
      writes[#writes + 1] = dst
      writes[#writes + 1] = value
    end
  end
  for first = 1, #writes, 1000 do redis.call('MSET', unpack(writes, first, math.min(first + 999, #writes))) end
  if not partial then
    local was_ready = set_bits(k('ready:' .. name), rows, 1)
    if name == meta.completion then
      -- A group is complete when its n-th row's completion column becomes final.
      local finished = {}
      for i, was in ipairs(was_ready) do
        if was == 0 then
          local group = math.floor(tonumber(rows[i]) / n)
          finished[group] = (finished[group] or 0) + 1
        end
      end
      for group, count in pairs(finished) do
        local done = redis.call('HINCRBY', k('done'), group, count)
        if done == n then redis.call('HINCRBY', k('meta'), 'complete', 1) end
      end
    end
  end
end

if version ~= '' then
  local versions = {}
  for _, row in ipairs(rows) do versions[#versions + 1] = row; versions[#versions + 1] = version end
  batched('HSET', k('version'), versions)
end
if consumer ~= '' then
  batched('ZREM', k('lease:' .. consumer), rows)
  batched('HDEL', k('owner:' .. consumer), rows)
  if partial then
    set_bits(k('consumed:' .. consumer), rows, 0)
    local aged = {}
    for _, row in ipairs(rows) do
      aged[#aged + 1] = redis.call('HINCRBY', k('rowage'), row, 1)
      aged[#aged + 1] = math.floor(tonumber(row) / n)
    end
    batched('ZADD', k('age'), aged, 'GT')
  end
end
wake_consumers()
return nrows
