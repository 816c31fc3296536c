-- Shared by every dock script (prepended by scripts.py). KEYS[1] is the run's key base
-- "{prefix}:{run_id}:"; errors start with a tag the client maps to a typed error.
local base = KEYS[1]
local function k(name) return base .. name end

local function fail(tag, message) return redis.error_reply(tag .. ' ' .. message) end

-- The run's meta hash as a table; nil when the dock was never created.
local function load_meta()
  local flat = redis.call('HGETALL', k('meta'))
  if #flat == 0 then return nil end
  local meta = {}
  for i = 1, #flat, 2 do meta[flat[i]] = flat[i + 1] end
  return meta
end

-- Returns meta, or nil plus the error reply to return (not created / wrong token).
local function open(digest)
  local meta = load_meta()
  if not meta then return nil, fail('DOCK_NOT_CREATED', 'no dock under ' .. base .. '; the trainer creates it') end
  if meta.token ~= '' and meta.token ~= digest then
    return nil, fail('DOCK_AUTH', 'the dock under ' .. base .. ' needs the run\'s token for this call')
  end
  return meta
end

local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

-- Bit i of a Redis bitmap string (most significant bit first, as SETBIT writes it).
local function bit_at(bitmap, i)
  local byte = string.byte(bitmap, math.floor(i / 8) + 1)
  if not byte then return false end
  return bit.band(byte, bit.rshift(128, i % 8)) ~= 0
end

-- Rows of `consumer` whose lease deadline passed go back to the pool; returns how many.
local function requeue_expired(consumer, now)
  local lease_key = k('lease:' .. consumer)
  local expired = redis.call('ZRANGEBYSCORE', lease_key, '-inf', now)
  if #expired == 0 then return 0 end
  for _, row in ipairs(expired) do
    redis.call('SETBIT', k('consumed:' .. consumer), row, 0)
    redis.call('HDEL', k('owner:' .. consumer), row)
  end
  redis.call('ZREMRANGEBYSCORE', lease_key, '-inf', now)
  redis.call('HINCRBY', k('meta'), 'requeued', #expired)
  return #expired
end

local function requeue_all(now)
  local total = 0
  for _, consumer in ipairs(redis.call('SMEMBERS', k('consumers'))) do
    total = total + requeue_expired(consumer, now)
  end
  return total
end

-- Error reply naming the first rows of `rows` that `lease_id` of `consumer` does not hold, or nil.
local function check_owned(consumer, lease_id, rows)
  local stale = {}
  for first = 1, #rows, 1000 do
    local last = math.min(first + 999, #rows)
    local owners = redis.call('HMGET', k('owner:' .. consumer), unpack(rows, first, last))
    for i, owner in ipairs(owners) do
      if owner ~= lease_id and #stale < 5 then stale[#stale + 1] = rows[first + i - 1] end
    end
  end
  if #stale > 0 then
    return fail('DOCK_STALE', 'lease of ' .. consumer .. ' no longer holds rows ' .. table.concat(stale, ',') ..
      ' (expired and requeued, or taken over)')
  end
  return nil
end

-- Deletes `keys` in batches (unpack has a stack limit).
local function delete_keys(keys)
  for first = 1, #keys, 1000 do
    redis.call('DEL', unpack(keys, first, math.min(first + 999, #keys)))
  end
end

local function value_key(column, row) return base .. 'val:' .. column .. ':' .. row end

-- Removes rows from every key of the run (values, flags, leases, ages, completion counts).
local function drop_rows(meta, rows)
  if #rows == 0 then return end
  local layout = cjson.decode(meta.layout)
  local n = tonumber(meta.n)
  local consumers = redis.call('SMEMBERS', k('consumers'))
  local values, done_groups = {}, {}
  for _, row in ipairs(rows) do
    for _, column in ipairs(layout.columns) do
      values[#values + 1] = value_key(column.name, row)
      redis.call('SETBIT', k('ready:' .. column.name), row, 0)
    end
    for _, consumer in ipairs(consumers) do
      redis.call('SETBIT', k('consumed:' .. consumer), row, 0)
      redis.call('ZREM', k('lease:' .. consumer), row)
      redis.call('HDEL', k('owner:' .. consumer), row)
    end
    redis.call('SETBIT', k('live'), row, 0)
    redis.call('HDEL', k('version'), row)
    redis.call('HDEL', k('rowage'), row)
    done_groups[math.floor(tonumber(row) / n)] = true
  end
  delete_keys(values)
  for group, _ in pairs(done_groups) do
    if tonumber(redis.call('HGET', k('done'), group) or '0') >= n then
      redis.call('HINCRBY', k('meta'), 'complete', -1)
    end
    redis.call('HDEL', k('done'), group)
    redis.call('ZREM', k('age'), group)
  end
end

-- Deletes every data key of the run: every row's values, flags, leases, ages (not meta).
local function delete_pool(meta)
  local keys = {k('live'), k('version'), k('rowage'), k('age'), k('done')}
  local capacity = tonumber(meta.capacity)
  for _, column in ipairs(cjson.decode(meta.layout).columns) do
    keys[#keys + 1] = k('ready:' .. column.name)
    for row = 0, capacity - 1 do keys[#keys + 1] = value_key(column.name, row) end
  end
  for _, consumer in ipairs(redis.call('SMEMBERS', k('consumers'))) do
    keys[#keys + 1] = k('consumed:' .. consumer)
    keys[#keys + 1] = k('lease:' .. consumer)
    keys[#keys + 1] = k('owner:' .. consumer)
  end
  delete_keys(keys)
end
