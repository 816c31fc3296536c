-- put: ARGV digest, consumer, lease_id, version, partial, append, nrows, ncols, rows[nrows],
-- then per column: name, appendable, values[nrows].
-- Checks the token and (with a consumer) that the lease still holds every row before writing
-- anything. A final put sets the ready flags and ends the lease; a partial put (partial rollout)
-- stores the values without ready flags, returns the rows to the consumer's pool and ages them.
local meta, err = open(ARGV[1])
if not meta then return err end
local consumer, lease_id, version = ARGV[2], ARGV[3], ARGV[4]
local partial, append = ARGV[5] == '1', ARGV[6] == '1'
local nrows, ncols = tonumber(ARGV[7]), tonumber(ARGV[8])
local n = tonumber(meta.n)
local rows = {}
for i = 1, nrows do rows[i] = ARGV[8 + i] end
if consumer ~= '' then
  requeue_expired(consumer, now_ms())
  local stale = check_owned(consumer, lease_id, rows)
  if stale then return stale end
end

-- Appends a 1-D value's data to a stored 1-D value: dimension 0 grows, the header stays 6 bytes.
local function append_value(old, add)
  local length = struct.unpack('<I4', old, 3) + struct.unpack('<I4', add, 3)
  return string.sub(old, 1, 2) .. struct.pack('<I4', length) .. string.sub(old, 7) .. string.sub(add, 7)
end

for _, row in ipairs(rows) do
  if redis.call('SETBIT', k('live'), row, 1) == 0 then
    redis.call('ZADD', k('age'), 'NX', 0, math.floor(tonumber(row) / n))
  end
end
local pos = 9 + nrows
for _ = 1, ncols do
  local name, appendable = ARGV[pos], ARGV[pos + 1] == '1'
  pos = pos + 2
  local col_key, ready_key = k('col:' .. name), k('ready:' .. name)
  local pairs_ = {}
  for i, row in ipairs(rows) do
    local value = ARGV[pos + i - 1]
    if append and appendable then
      local old = redis.call('HGET', col_key, row)
      if old then value = append_value(old, value) end
    end
    pairs_[#pairs_ + 1] = row
    pairs_[#pairs_ + 1] = value
    if #pairs_ == 1000 then
      redis.call('HSET', col_key, unpack(pairs_))
      pairs_ = {}
    end
    if not partial and redis.call('SETBIT', ready_key, row, 1) == 0 and name == meta.completion then
      if redis.call('HINCRBY', k('done'), math.floor(tonumber(row) / n), 1) == n then
        redis.call('HINCRBY', k('meta'), 'complete', 1)
      end
    end
  end
  if #pairs_ > 0 then redis.call('HSET', col_key, unpack(pairs_)) end
  pos = pos + nrows
end
for _, row in ipairs(rows) do
  if version ~= '' then redis.call('HSET', k('version'), row, version) end
  if consumer ~= '' then
    redis.call('ZREM', k('lease:' .. consumer), row)
    redis.call('HDEL', k('owner:' .. consumer), row)
    if partial then
      redis.call('SETBIT', k('consumed:' .. consumer), row, 0)
      local age = redis.call('HINCRBY', k('rowage'), row, 1)
      redis.call('ZADD', k('age'), 'GT', age, math.floor(tonumber(row) / n))
    end
  end
end
return nrows
