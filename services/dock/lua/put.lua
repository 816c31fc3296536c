-- put: ARGV digest, consumer, lease_id, version, partial, append, nrows, ncols, nonce, rows[nrows],
-- then per column: name, appendable. The values were SET just before (same pipeline) under
-- stage:{nonce}:{c * nrows + i} (column c, row i, from 0); this script moves them into place.
-- Checks the token and (with a consumer) that the lease still holds every row before moving
-- anything; on refusal the staged values are deleted. A final put sets the ready flags and ends
-- the lease; a partial put (partial rollout) stores without ready flags, returns the rows to the
-- consumer's pool and ages them.
local consumer, lease_id, version = ARGV[2], ARGV[3], ARGV[4]
local partial, append = ARGV[5] == '1', ARGV[6] == '1'
local nrows, ncols, nonce = tonumber(ARGV[7]), tonumber(ARGV[8]), ARGV[9]
local rows = {}
for i = 1, nrows do rows[i] = ARGV[9 + i] end
local function staged(index) return k('stage:' .. nonce .. ':' .. index) end
local stage_keys = {}
for index = 0, nrows * ncols - 1 do stage_keys[#stage_keys + 1] = staged(index) end
local function refuse(reply)
  delete_keys(stage_keys)
  return reply
end

local meta, err = open(ARGV[1])
if not meta then return refuse(err) end
if consumer ~= '' then
  requeue_expired(consumer, now_ms())
  local stale = check_owned(consumer, lease_id, rows)
  if stale then return refuse(stale) end
end
local present = 0
for first = 1, #stage_keys, 1000 do
  present = present + redis.call('EXISTS', unpack(stage_keys, first, math.min(first + 999, #stage_keys)))
end
if present ~= #stage_keys then
  return refuse(fail('DOCK_STAGE', (#stage_keys - present) .. ' staged values of this put are missing (expired?); put again'))
end
local n = tonumber(meta.n)

local admitted = 0
for _, row in ipairs(rows) do
  if redis.call('SETBIT', k('live'), row, 1) == 0 then
    admitted = admitted + 1
    redis.call('ZADD', k('age'), 'NX', 0, math.floor(tonumber(row) / n))
  end
end
if admitted > 0 then redis.call('HINCRBY', k('meta'), 'admitted', admitted) end
for c = 0, ncols - 1 do
  local name, appendable = ARGV[10 + nrows + 2 * c], ARGV[11 + nrows + 2 * c] == '1'
  local ready_key = k('ready:' .. name)
  for i, row in ipairs(rows) do
    local src, dst = staged(c * nrows + i - 1), value_key(name, row)
    if append and appendable and redis.call('EXISTS', dst) == 1 then
      -- 1-D values: dimension 0 (bytes 3-6) grows, the data is appended after the stored data.
      local add = redis.call('GET', src)
      local length = struct.unpack('<I4', redis.call('GETRANGE', dst, 2, 5)) + struct.unpack('<I4', add, 3)
      redis.call('APPEND', dst, string.sub(add, 7))
      redis.call('SETRANGE', dst, 2, struct.pack('<I4', length))
      redis.call('DEL', src)
    else
      redis.call('RENAME', src, dst)
      redis.call('PERSIST', dst)
    end
    if not partial and redis.call('SETBIT', ready_key, row, 1) == 0 and name == meta.completion then
      if redis.call('HINCRBY', k('done'), math.floor(tonumber(row) / n), 1) == n then
        redis.call('HINCRBY', k('meta'), 'complete', 1)
      end
    end
  end
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
